"""Known upstream failures of the family checks, as data (`known_failures.json` beside this
file), loaded into the known-failure rule's own entries (`mpt_kv.checks.known_failures.Entry`,
whose field, pattern and version checks this file shares), keyed by implementation, family,
variant, property and path: an entry's target is "<implementation>/<family>/<variant>", the name
of the family target the conformance run checks (`mpt_kv.targets.FamilyTarget`).

    {"family": "mpt", "variant": "alibi", "property": "family-P3",
     "when": {"transformers": ">=4.55,<4.56"},
     "pattern": "layer 0 key .* (is a view|are views) of .*Wqkv's output",
     "upstream": "transformers/cache_utils.py:NNN", "reason": "..."}

required  family, variant (a variant of the registry), property (a check id of
          `mpt_kv.checks.family.CHECKS`), when ({distribution: specifier}), pattern (a regular
          expression of the PropertyFailure message), upstream (file and line), reason
optional  implementation ("transformers", the default, or "optimum-habana"); path ("concat",
          "static", "static+reuse"; absent: every path); views (a list of "key", "value",
          "key_value": which cached tensors view the fused output, for the cost); cost_config (the
          name of a real config in mpt_kv/data/families/, or mpt-7b: mpt_kv/data/mpt-7b.json)

Any other field is an error naming it (a typo must not pass silently). A case an entry applies to
(the installed versions match `when`) is a strict xfail that only a `PropertyFailure` whose message
the pattern finds (`re.search`) satisfies; a pass or any other failure fails the case (the pytest
plugin applies it to every case, MPT and family alike: `mpt_kv.plugin.known_failures`). New entries
go at the END of the list."""

from __future__ import annotations

import json
from pathlib import Path

from mpt_kv import package_data
from mpt_kv.checks.known_failures import Entry, check_fields, compile_pattern, parse_when
from mpt_kv.checks.index import FAMILY_PATHS, NAMES
from mpt_kv.errors import KnownFailuresError
from mpt_kv.families import FAMILIES
from mpt_kv.families.implementations import IMPLEMENTATIONS
from mpt_kv.checks.registry import CHECKS, applies
from mpt_kv.families.implementations import PATHS
from mpt_kv.targets import FamilyTarget

FILE = package_data.FAMILY_KNOWN_FAILURES
COST_CONFIGS = package_data.REAL_CONFIGS
REQUIRED = {"family": str, "variant": str, "property": str, "pattern": str, "reason": str, "upstream": str,
            "when": dict}
OPTIONAL = {"implementation": str, "path": str, "views": list, "cost_config": str}
VIEWS = ("key", "value", "key_value")


Known = Entry  # the name of a family entry before the one known-failure rule


def cost_configs() -> set[str]:
    """The names of the real configs kept as data: mpt_kv/data/families/<name>.json, and the seed's
    MPT config mpt_kv/data/mpt-7b.json."""
    names = {p.stem for p in COST_CONFIGS.glob("*.json")} if COST_CONFIGS.is_dir() else set()
    return names | ({"mpt-7b"} if package_data.MPT_7B_CONFIG.is_file() else set())


def _entry(raw, i: int, path, first_index: int = 0) -> Entry:

    def bad(what):
        return KnownFailuresError(f"family known failures {path}: entry {i}: {what}")

    check_fields(raw, REQUIRED, OPTIONAL, bad)
    if raw["family"] not in FAMILIES or raw["variant"] not in FAMILIES[raw["family"]].variants:
        raise bad(f"no family variant {raw['family']}/{raw['variant']}")
    if not raw["property"].startswith("family-") or raw["property"] not in NAMES:
        raise bad(f"unknown property {raw['property']!r}; expected one of "
                  f"{tuple(n for n in NAMES if n.startswith('family-'))}")
    implementation = raw.get("implementation", "transformers")
    if implementation not in IMPLEMENTATIONS:
        raise bad(f"unknown implementation {implementation!r}; expected one of {tuple(IMPLEMENTATIONS)}")
    if raw.get("path", FAMILY_PATHS[0]) not in FAMILY_PATHS:
        raise bad(f"unknown path {raw['path']!r}; expected one of {FAMILY_PATHS}")
    views = raw.get("views", [])
    if not views and "views" in raw or any(v not in VIEWS for v in views) or len(set(views)) != len(views):
        raise bad(f"'views' {views!r}: a non-empty list of distinct names out of {VIEWS}")
    if "cost_config" in raw and raw["cost_config"] not in cost_configs():
        raise bad(f"'cost_config' {raw['cost_config']!r} is no real config of {COST_CONFIGS} "
                  f"(there: {sorted(cost_configs())})")
    if not raw["reason"].strip():
        raise bad("'reason' is empty: say what upstream does wrong and since when")
    return Entry(first_index + i, f"{implementation}/{raw['family']}/{raw['variant']}", raw["property"],
                 raw["reason"], compile_pattern(raw["pattern"], bad), raw.get("path"), None,
                 parse_when(raw["when"], bad), str(path), None, raw["upstream"], tuple(views), raw.get("cost_config"))


def check_entries_cover_cells(entries) -> None:
    """An entry about a cell the family matrix does not have (P0 of transformers, P2 on concat, a path
    the implementation lacks: `mpt_kv.checks.registry.applies`) would never apply: an error naming it,
    not an entry silently unused."""

    for e in entries:
        target = FamilyTarget(e.implementation, e.family, e.variant, PATHS[e.implementation],
                              oracle=e.implementation == "transformers")
        if not any(c.property == e.property and e.path in (None, c.path) and applies(c, target) for c in CHECKS.values()):
            raise KnownFailuresError(
                f"family known failure {e.implementation} {e.family}/{e.variant} {e.property} path {e.path or 'any'}: "
                f"the matrix has no such cell (paths of {e.implementation}: {PATHS[e.implementation]}; family-P0 only on "
                "concat and not for transformers; family-P2 only on static paths)")


def load(path: str | Path = FILE, first_index: int = 0) -> list[Entry]:
    """Every entry, checked (its fields, and that the matrix has its cell): a malformed one is a
    KnownFailuresError (a ValueError) naming the file, the entry and why."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise KnownFailuresError(f"family known failures {path}: expected a JSON list of entries, got "
                                 f"{type(data).__name__}")
    entries = [_entry(raw, i, path, first_index) for i, raw in enumerate(data)]
    check_entries_cover_cells(entries)
    return entries


def applying(implementation: str, family: str, variant: str, prop: str, path: str,
             entries: list[Entry]) -> Entry | None:
    """The entry that applies to the case here (its versions installed), if any."""
    for e in entries:
        if e.covers(f"{implementation}/{family}/{variant}", prop, path, None) and e.applies():
            return e
    return None
