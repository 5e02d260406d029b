"""Known upstream failures of the family checks, as data (`known_failures.json` beside this
file): the same idea as `mpt_kv.targets.known_failures` (whose field, pattern and version checks
it shares), keyed by implementation, family, variant, property and path.

    {"family": "mpt", "variant": "alibi", "property": "family-P3",
     "when": {"transformers": ">=4.55,<4.56"},
     "pattern": "layer 0 key .* (is a view|are views) of .*Wqkv's output",
     "upstream": "transformers/cache_utils.py:NNN", "reason": "..."}

required  family, variant (a variant of the registry), property (a check id of
          `mpt_kv.families.checks.CHECKS`), when ({distribution: specifier}), pattern (a regular
          expression of the PropertyFailure message), upstream (file and line), reason
optional  implementation ("transformers", the default, or "optimum-habana"); path ("concat",
          "static", "static+reuse"; absent: every path); views (a list of "key", "value",
          "key_value": which cached tensors view the fused output, for the cost); cost_config (the
          name of a real config in mpt_kv/data/families/, or mpt-7b: mpt_kv/data/mpt-7b.json)

Any other field is an error naming it (a typo must not pass silently). A case an entry applies to
(the installed versions match `when`) is a strict xfail that only a `PropertyFailure` whose message
the pattern finds (`re.search`) satisfies; a pass or any other failure fails the case (the
conformance test does this: `NotTheKnownFailure`). New entries go at the END of the list."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from mpt_kv.targets.known_failures import check_fields, compile_pattern, installed_versions_match, parse_when

FILE = Path(__file__).with_name("known_failures.json")
COST_CONFIGS = Path(__file__).resolve().parent.parent / "data" / "families"
REQUIRED = {"family": str, "variant": str, "property": str, "pattern": str, "reason": str, "upstream": str,
            "when": dict}
OPTIONAL = {"implementation": str, "path": str, "views": list, "cost_config": str}
VIEWS = ("key", "value", "key_value")


@dataclass(frozen=True)
class Known:
    family: str
    variant: str
    property: str
    pattern: re.Pattern
    reason: str
    upstream: str
    when: dict  # distribution -> SpecifierSet
    implementation: str = "transformers"
    path: str | None = None  # None: every path
    views: tuple = ()
    cost_config: str | None = None

    def applies(self) -> bool:
        return installed_versions_match(self.when)

    def covers(self, implementation: str, family: str, variant: str, prop: str, path: str) -> bool:
        case = (implementation, family, variant, prop)
        return ((self.implementation, self.family, self.variant, self.property) == case
                and self.path in (None, path))


def cost_configs() -> set[str]:
    """The names of the real configs kept as data: mpt_kv/data/families/<name>.json, and the seed's
    MPT config mpt_kv/data/mpt-7b.json."""
    names = {p.stem for p in COST_CONFIGS.glob("*.json")} if COST_CONFIGS.is_dir() else set()
    return names | ({"mpt-7b"} if (COST_CONFIGS.parent / "mpt-7b.json").is_file() else set())


def _entry(raw, i: int, path) -> Known:
    from mpt_kv.families import FAMILIES
    from mpt_kv.families.checks import CHECKS, PATHS
    from mpt_kv.families.implementations import IMPLEMENTATIONS

    def bad(what):
        return ValueError(f"family known failures {path}: entry {i}: {what}")

    check_fields(raw, REQUIRED, OPTIONAL, bad)
    if raw["family"] not in FAMILIES or raw["variant"] not in FAMILIES[raw["family"]].variants:
        raise bad(f"no family variant {raw['family']}/{raw['variant']}")
    if raw["property"] not in CHECKS:
        raise bad(f"unknown property {raw['property']!r}; expected one of {tuple(CHECKS)}")
    implementation = raw.get("implementation", "transformers")
    if implementation not in IMPLEMENTATIONS:
        raise bad(f"unknown implementation {implementation!r}; expected one of {tuple(IMPLEMENTATIONS)}")
    if raw.get("path", PATHS[0]) not in PATHS:
        raise bad(f"unknown path {raw['path']!r}; expected one of {PATHS}")
    views = raw.get("views", [])
    if not views and "views" in raw or any(v not in VIEWS for v in views) or len(set(views)) != len(views):
        raise bad(f"'views' {views!r}: a non-empty list of distinct names out of {VIEWS}")
    if "cost_config" in raw and raw["cost_config"] not in cost_configs():
        raise bad(f"'cost_config' {raw['cost_config']!r} is no real config of {COST_CONFIGS} "
                  f"(there: {sorted(cost_configs())})")
    if not raw["reason"].strip():
        raise bad("'reason' is empty: say what upstream does wrong and since when")
    return Known(raw["family"], raw["variant"], raw["property"], compile_pattern(raw["pattern"], bad), raw["reason"],
                 raw["upstream"], parse_when(raw["when"], bad), implementation, raw.get("path"), tuple(views),
                 raw.get("cost_config"))


def load(path: str | Path = FILE) -> list[Known]:
    """Every entry, checked: a malformed one is a ValueError naming the file, the entry and why."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"family known failures {path}: expected a JSON list of entries, got {type(data).__name__}")
    return [_entry(raw, i, path) for i, raw in enumerate(data)]


def applying(implementation: str, family: str, variant: str, prop: str, path: str,
             entries: list[Known]) -> Known | None:
    """The entry that applies to the case here (its versions installed), if any."""
    for e in entries:
        if e.covers(implementation, family, variant, prop, path) and e.applies():
            return e
    return None
