"""What a known failure is: one entry format for every known-failures file, MPT targets and families
alike, and the rule that applies an entry to a case. Known upstream failures are data: a JSON list
of entries, one per (target, property, path) with the package versions it applies to.

    {"target": "transformers", "property": "P3", "path": "concat",
     "when": {"transformers": "<4.56"},
     "pattern": "(key|value) \\([0-9, ]+\\) (is a view|are views) of (layer \\d+'s )?mixed_qkv",
     "reason": "transformers <4.56: DynamicLayer.update stores the first K/V as is ...",
     "repro": "transformers-mpt-alibi-kv-views"}
    {"target": "transformers/mpt/alibi", "property": "family-P3", "path": "concat",
     "when": {"transformers": ">=4.32.0,<4.56.0"},
     "pattern": "layer 0 key .* (is a view|are views) of .*Wqkv's output",
     "views": ["key", "value"], "cost_config": "mpt-7b",
     "upstream": "transformers 4.55.4 cache_utils.py:99-100 ...", "reason": "..."}

every entry  target, property, pattern (a regular expression of the PropertyFailure message, which
             must name its failure: `mpt_kv.findings.patterns`), reason; optional path (absent:
             any), when ({distribution: PEP 440 specifier}; absent: every version), upstream (the
             upstream file and line), dtype ("float32" or "bfloat16": the cases of that dtype only,
             for a failure one precision shows and the other does not; absent: either) and device
             ("cpu", "cuda" or "hpu": the cases of that device kind only, for a failure of one
             device's code path, such as a port's CPU fallback of an HPU kernel; absent: any); a
             caller that does not say a case's dtype or device matches no entry that names one
an MPT entry (a property of the MPT checks, P0 ... ops-*; its target a built-in target or a
             project's own): optional bucket (true/false; absent: either), check (a registry check
             id, e.g. "P0/alibi-bias-max-16": that check only; a caller that does not say which
             check a case is matches no entry that names one), repro (the finding's standalone
             repro, a folder of `python -m mpt_kv findings --repro DIR`)
a family entry (a property family-*): target "<implementation>/<family>/<variant>" (the family
             target the conformance run checks, `mpt_kv.targets.FamilyTarget`); in the family file when
             and upstream required; optional views (which cached tensors view the fused output: key,
             value, key_value, for the cost) and cost_config (a real config of mpt_kv/data/families/, or
             mpt-7b: the cost is computed there). A project's own file may hold family entries about its
             own family targets (`mpt_kv.FamilyModel`, target "<its spec>/<family>/<variant>"): the
             required fields, optional path, when and upstream.

A family entry written before this format names its target by three fields, family, variant and
implementation (default "transformers"), instead of `target`: it is read the same (`mpt_kv.findings.raw.normalized`).
Any other field is an error naming it (a typo must not pass silently).

The files: `MPT_FILE`, mpt-kv's own for its MPT targets (a project's own file replaces it: option
`mpt_kv_known_failures`), read by `load`; `FAMILY_FILE`, the family checks', read by
`load_families` (each of its entries must name a cell the family matrix has). A case an entry covers
and applies to (the installed versions match `when`: `match`) is a strict xfail that only a
`PropertyFailure` whose message the pattern finds satisfies (`Entry.explains`); a pass or any other
failure fails the case. A malformed file is a `KnownFailuresError` naming the file, the entry and
what is wrong. New entries go at the END of a file (an entry is named by its index there).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from mpt_kv import package_data, recipes, versions
from mpt_kv.checks import index
from mpt_kv.errors import KnownFailuresError, PropertyFailure
from mpt_kv.findings.patterns import compile_pattern
# the files and an entry as a file has it (re-exported: the findings' tables, costs and repros read them there)
from mpt_kv.findings.raw import FAMILY_FILE, MPT_FILE, is_family, normalized, raw_entries, target_of  # noqa: F401

FILE = MPT_FILE  # the plugin's default file

PROPERTIES = tuple(p.name for p in index.PROPERTIES if not p.family)  # what an MPT entry may name
# what a family entry may name: the family checks, and the generate checks (which run on both kinds of target)
FAMILY_PROPERTIES = tuple(p.name for p in index.PROPERTIES if p.family or p.runs == "generate")
BOTH = tuple(p.name for p in index.PROPERTIES if p.runs == "generate")  # an MPT or a family entry, by its target
PATHS = ("concat", "static")  # an MPT entry's paths (a bucketed case: "bucket": true)
FAMILY_PATHS = index.FAMILY_PATHS
VIEWS = ("key", "value", "key_value")

# the one format: every entry's fields, and what each kind adds
REQUIRED = {"target": str, "property": str, "pattern": str, "reason": str}
OPTIONAL = {"path": str, "when": dict, "upstream": str, "dtype": str, "device": str}
DTYPES = ("float32", "bfloat16")  # an entry's dtype: a case's, as its report names it
DEVICES = ("cpu", "cuda", "hpu")  # an entry's device: a case's kind (mpt_kv.devices.KINDS)
MPT_OPTIONAL = {**OPTIONAL, "bucket": bool, "check": str, "repro": str}
FAMILY_REQUIRED = {**REQUIRED, "when": dict, "upstream": str}
# check: a generate entry's mode; repro: the kept script or another finding's folder that shows it
FAMILY_OPTIONAL = {"path": str, "views": list, "cost_config": str, "dtype": str, "device": str, "check": str,
                   "repro": str}
# a family entry's target before this format: its three parts as fields (`mpt_kv.findings.raw.normalized`)


@dataclass(frozen=True)
class Entry:
    index: int
    target: str
    property: str
    reason: str
    pattern: re.Pattern
    path: str | None = None
    bucket: bool | None = None
    when: dict = field(default_factory=dict)  # distribution -> SpecifierSet
    file: str = ""
    check: str | None = None  # one registry check id only
    # a family entry's: the upstream file and line, which cached tensors view the fused output, the
    # real config its cost is computed at (an MPT entry may give its upstream too)
    upstream: str = ""
    views: tuple = ()
    cost_config: str | None = None
    # an entry a family declaration inherits (`mpt_kv.findings.known.inherited`): the target of the
    # entry it copies ("optimum-habana/mistral/gqa"); its own target is the declaration's case
    origin: str = ""
    dtype: str | None = None  # "float32" / "bfloat16": the cases of that dtype only
    device: str | None = None  # "cpu" / "cuda" / "hpu": the cases of that device kind only

    @property
    def implementation(self) -> str:
        """The built-in target or family implementation the entry is about (a family entry's target is
        "<implementation>/<family>/<variant>", the implementation with its attention where it names one:
        "transformers[sdpa]" is transformers)."""
        return versions.split_attention(self.target.split("/", 1)[0])[0]

    @property
    def attention(self) -> str | None:
        """The attention implementation a family entry names ("transformers[sdpa]/..."): it covers that
        one's cases only; None: every attention implementation of its target."""
        return versions.split_attention(self.target.split("/", 1)[0])[1] if self.family else None

    @property
    def key(self) -> tuple:
        """The entry's identity in a run that judges several files: (its file, its index there), and for
        an inherited copy the target that inherits it."""
        return (self.file, self.index, self.target) if self.origin else (self.file, self.index)

    @property
    def family(self) -> str | None:
        parts = self.target.split("/")
        return parts[1] if len(parts) == 3 else None

    @property
    def variant(self) -> str | None:
        parts = self.target.split("/")
        return parts[2] if len(parts) == 3 else None

    @property
    def name(self) -> str:
        where = "".join(f" {x}" for x in (self.path, {True: "bucket", False: "no bucket"}.get(self.bucket),
                                           self.dtype, self.device) if x)
        if self.origin:
            return f"entry {self.index} ({self.origin} {self.property}{where}, inherited by {self.implementation})"
        return f"entry {self.index} ({self.target} {self.check or self.property}{where})"

    def applies(self) -> bool:
        """True where every package of `when` is installed in a version it names."""
        return installed_versions_match(self.when)

    def covers(self, target: str, prop: str, path: str | None, bucket: int | None, check: str | None = None,
               dtype: str | None = None, device: str | None = None) -> bool:
        """This entry is about the case (target, property, path, bucketed or not, check id, dtype,
        device kind). A recipe's cells ("static@gemma", mpt_kv/recipes.py) are a path of their own: an
        entry of their base path ("static") does not cover them (a recipe's flags take other branches: a
        failure there may be gone), an entry of every path does, after the recipe path's own (`match`)."""
        return (same_target(self.target, target) and self.property == prop and self.path in (None, path)
                and self.bucket in (None, bucket is not None) and self.check in (None, check)
                and self.dtype in (None, dtype) and self.device in (None, device))

    def explains(self, exc: BaseException | None) -> bool:
        """This entry alone explains the failure (`explaining([self], exc)`)."""
        return explaining([self], exc) is not None


def failures_in(exc: BaseException) -> list[BaseException]:
    """A failure's independent failures: every leaf of an exception group (hypothesis reports several) or
    of `Failures` (a check's independent parts, family-ops' two programs); else the failure itself."""
    group = getattr(exc, "exceptions", None)
    if group is None:
        return [exc]
    return [leaf for e in group for leaf in failures_in(e)]


def explaining(entries: list, exc: BaseException | None) -> list | None:
    """The known-failure rule, for every case, MPT and family alike, by hand and in the plugin: a case's
    failure is known when each of its independent failures (`failures_in`) is a PropertyFailure whose
    message the pattern of one of the case's applying entries finds. The entries that explain them, in
    the case's order (None: the failure is not known; an empty group is never known)."""
    parts = [] if exc is None else failures_in(exc)
    used = []
    for part in parts:
        entry = next((e for e in entries if isinstance(part, PropertyFailure) and e.pattern.search(str(part))), None)
        if entry is None:
            return None
        if entry not in used:
            used.append(entry)
    return used or None


def known_verdict(entries: list, exc: BaseException | None) -> tuple[str, list]:
    """The verdict of a case its applying `entries` cover, after it ran (`exc`: its failure; None: it passed),
    by hand and in the plugin alike:

        ("known", used)      each independent failure is named by an entry (`explaining`) and each entry's
                             failure is among them: the case xfails, naming `used`
        ("unknown", [])      a failure no entry names: the case fails as it is
        ("stale", entries)   its failures are named, but these entries' failure did not happen here: the
                             case fails as XPASS (a fix upstream made them stale; with several entries a case
                             could otherwise keep xfailing on another's failure and hide that)
        ("pass", entries)    it passed: every entry is stale for it (XPASS)
    """
    if exc is None:
        return "pass", list(entries)
    used = explaining(entries, exc)
    if used is None:
        return "unknown", []
    parts = [str(part) for part in failures_in(exc)]
    unseen = [e for e in entries if not any(e.pattern.search(part) for part in parts)]
    return ("stale", unseen) if unseen else ("known", used)


def same_target(entry_target: str, case_target: str) -> bool:
    """An entry's target covers a case's: the same name, or the entry names no attention implementation
    and the case's target is its family target with one ("transformers/gpt2/mha" covers
    "transformers[sdpa]/gpt2/mha" and "transformers[eager]/gpt2/mha"; "transformers[sdpa]/gpt2/mha" only itself)."""
    if entry_target == case_target:
        return True
    head, slash, rest = case_target.partition("/")
    base, attention = versions.split_attention(head)
    return bool(slash and attention) and entry_target == f"{base}/{rest}"


# --- one entry as the file has it --------------------------------------------------------------------

def check_fields(raw, required: dict, optional: dict, bad) -> None:
    """An object with every required field, no unknown one (a typo must not pass silently), each of
    its type; `bad(what)` makes the error that names the file and the entry."""
    if not isinstance(raw, dict):
        raise bad(f"expected an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(required) - set(optional))
    if unknown:
        raise bad(f"unknown field(s) {unknown}; fields are {sorted(required)} and optional {sorted(optional)}")
    missing = sorted(set(required) - set(raw))
    if missing:
        raise bad(f"missing field(s) {missing}")
    for name, kind in {**required, **optional}.items():
        if name in raw and not isinstance(raw[name], kind):
            raise bad(f"{name!r} must be a {kind.__name__}, got {raw[name]!r}")


def parse_when(value: dict, bad) -> dict:
    """{distribution: PEP 440 specifier} -> {distribution: SpecifierSet}."""
    when = {}
    for package, spec in value.items():
        try:
            when[package] = SpecifierSet(spec)
        except (InvalidSpecifier, TypeError):
            raise bad(f"'when' {package}: {spec!r} is not a version specifier (e.g. '<4.56')") from None
    return when


installed_versions_match = versions.versions_match  # every distribution of `when` installed, in its range


def read(path, label: str) -> list:
    """The file's JSON list (`label` names the file in an error)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KnownFailuresError(f"{label} {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KnownFailuresError(f"{label} {path}: not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise KnownFailuresError(f"{label} {path}: expected a JSON list of entries, got {type(data).__name__}")
    return data


# --- an MPT targets' file (mpt-kv's own, or a project's) ----------------------------------------------

def mpt_entry(raw, i: int, file: str) -> Entry:
    def bad(what: str):
        label = f"entry {i}"
        if isinstance(raw, dict) and isinstance(raw.get("target"), str) and isinstance(raw.get("property"), str):
            label += f" ({raw['target']} {raw['property']})"
        return KnownFailuresError(f"known failures file {file}: {label}: {what}")

    check_fields(raw, REQUIRED, MPT_OPTIONAL, bad)
    if raw["property"] not in PROPERTIES:
        raise bad(f"unknown property {raw['property']!r}; expected one of {PROPERTIES}")
    if raw.get("path", PATHS[0]) not in PATHS:
        raise bad(f"unknown path {raw['path']!r}; expected one of {PATHS}")
    if not raw["reason"].strip():
        raise bad("'reason' is empty: say what upstream does wrong and since when")
    pattern = compile_pattern(raw["pattern"], bad)
    when = parse_when(raw.get("when", {}), bad)
    if "check" in raw and raw["check"].split("/", 1)[0] != raw["property"]:
        raise bad(f"'check' {raw['check']!r} is not a check of property {raw['property']!r}")
    if "repro" in raw:
        check_repro(raw["repro"], bad)
    check_dtype(raw, bad)
    return Entry(i, raw["target"], raw["property"], raw["reason"], pattern, raw.get("path"), raw.get("bucket"),
                 when, file, raw.get("check"), raw.get("upstream", ""), dtype=raw.get("dtype"),
                 device=raw.get("device"))


def check_dtype(raw: dict, bad) -> None:
    """'dtype' and 'device', where given, name a dtype and a device kind the cases run on."""
    if raw.get("dtype", DTYPES[0]) not in DTYPES:
        raise bad(f"'dtype' {raw['dtype']!r}: expected one of {DTYPES} (absent: either)")
    if raw.get("device", DEVICES[0]) not in DEVICES:
        raise bad(f"'device' {raw['device']!r}: expected one of {DEVICES} (absent: any)")


def check_repro(name: str, bad) -> None:
    """'repro' names a folder `python -m mpt_kv findings --repro DIR` writes (a kept MPT script or a
    family finding's repro): a name of none is refused, not kept as a dead link."""
    # lazy: the repros read the family registry, which imports torch (the plugin loads an MPT file
    # before an xdist worker's card is pinned; only an entry that names a repro needs them)
    from mpt_kv.findings.repros import repro_names

    names = repro_names()
    if name not in names:
        close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
        raise bad(f"'repro' {name!r} names no repro of `python -m mpt_kv findings --repro DIR` "
                  + (f"(closest: {', '.join(close)})" if close else f"({len(names)} exist; the list: docs/findings.md)")
                  + ": name one, or drop the field while the finding has none")


def own_family_entry(raw, i: int, file: str) -> Entry:
    """A family entry of a project's own file: about one of its family targets (`mpt_kv.FamilyModel`,
    target "<its spec>/<family>/<variant>"); the required fields, optional path, when and upstream. Its
    family and variant are not looked up here (the registry imports torch): an entry naming a case the
    run does not have matches none, which the summary lists (an error with --strict-known-failures)."""
    def bad(what: str):
        return KnownFailuresError(f"known failures file {file}: entry {i} ({raw['target']} {raw['property']}): {what}")

    check_fields(raw, REQUIRED, OPTIONAL, bad)
    if len(raw["target"].split("/")) != 3 or not all(raw["target"].split("/")):
        raise bad(f"a family entry's target is '<spec>/<family>/<variant>' (e.g. 'mypkg.mpt_kv_target:build/mistral/"
                  f"gqa'), not {raw['target']!r}")
    if raw.get("path", FAMILY_PATHS[0]) not in FAMILY_PATHS:
        raise bad(f"unknown path {raw['path']!r}; expected one of {FAMILY_PATHS}")
    if not raw["reason"].strip():
        raise bad("'reason' is empty: say what fails and why it is kept")
    check_dtype(raw, bad)
    # its dtype and device kept: dropped, an entry about one dtype's failure would xfail every dtype's
    return Entry(i, raw["target"], raw["property"], raw["reason"], compile_pattern(raw["pattern"], bad),
                 raw.get("path"), None, parse_when(raw.get("when", {}), bad), file, None, raw.get("upstream", ""),
                 dtype=raw.get("dtype"), device=raw.get("device"))


def load(path: str | Path = MPT_FILE) -> list[Entry]:
    """Every entry of an MPT targets' file (mpt-kv's, or a project's own, which may also hold family
    entries about the project's family targets: `own_family_entry`), checked; KnownFailuresError if
    the file or an entry is malformed."""
    def entry(raw, i):
        if isinstance(raw, dict) and raw.get("property") in FAMILY_PROPERTIES and isinstance(raw.get("target"), str) \
                and (raw["property"] not in BOTH or raw["target"].count("/") == 2):
            return own_family_entry(raw, i, str(path))
        return mpt_entry(raw, i, str(path))

    return [entry(raw, i) for i, raw in enumerate(read(path, "known failures file"))]


# --- the family checks' file ---------------------------------------------------------------------------

def family_entry(raw, i: int, path, families, implementations) -> Entry:
    def bad(what):
        return KnownFailuresError(f"family known failures {path}: entry {i}: {what}")

    if isinstance(raw, dict) and "target" not in raw:  # the shape before this format: its fields checked as such
        check_fields(raw, {k: v for k, v in FAMILY_REQUIRED.items() if k != "target"} | {"family": str, "variant": str},
                     FAMILY_OPTIONAL | {"implementation": str}, bad)
    raw = normalized(raw)
    check_fields(raw, FAMILY_REQUIRED, FAMILY_OPTIONAL, bad)
    named, family, variant = target_of(raw)
    if family is None:
        raise bad(f"'target' {raw['target']!r}: a family entry's target is '<implementation>/<family>/<variant>'")
    implementation, attention = versions.split_attention(named)
    if attention is not None and (implementation != "transformers" or attention not in attention_names()):
        raise bad(f"'target' {raw['target']!r}: an attention implementation is named on transformers only, one of "
                  f"{attention_names()} (transformers[sdpa]/<family>/<variant>)")
    if family not in families or variant not in families[family].variants:
        raise bad(f"no family variant {family}/{variant}")
    if raw["property"] not in FAMILY_PROPERTIES:
        raise bad(f"unknown property {raw['property']!r}; expected one of {FAMILY_PROPERTIES}")
    if implementation not in implementations:
        raise bad(f"unknown implementation {implementation!r}; expected one of {tuple(implementations)}")
    if raw.get("path", FAMILY_PATHS[0]) not in FAMILY_PATHS:
        raise bad(f"unknown path {raw['path']!r}; expected one of {FAMILY_PATHS}")
    views = raw.get("views", [])
    if not views and "views" in raw or any(v not in VIEWS for v in views) or len(set(views)) != len(views):
        raise bad(f"'views' {views!r}: a non-empty list of distinct names out of {VIEWS}")
    if "cost_config" in raw and raw["cost_config"] not in cost_configs():
        raise bad(f"'cost_config' {raw['cost_config']!r} is no real config of {package_data.REAL_CONFIGS} "
                  f"(there: {sorted(cost_configs())})")
    if not raw["reason"].strip():
        raise bad("'reason' is empty: say what upstream does wrong and since when")
    if "repro" in raw:
        check_repro(raw["repro"], bad)
    if "check" in raw and (raw["property"] not in BOTH or raw["check"].split("/", 1)[0] != raw["property"]):
        raise bad(f"'check' {raw['check']!r}: a generate entry's check id (generate/<path>/<mode>) names one check of "
                  "its property; the family checks' entries name a property and a path")
    check_dtype(raw, bad)
    return Entry(i, raw["target"], raw["property"], raw["reason"], compile_pattern(raw["pattern"], bad),
                 raw.get("path"), None, parse_when(raw["when"], bad), str(path), raw.get("check"), raw["upstream"],
                 tuple(views), raw.get("cost_config"), dtype=raw.get("dtype"), device=raw.get("device"))


def attention_names() -> tuple[str, ...]:
    """transformers' attention implementations a family entry may name (the matrix's attention axis)."""
    from mpt_kv.families.implementations import ATTENTION  # lazy: as load_families'

    return tuple(ATTENTION)


def cost_configs() -> set[str]:
    """The names of the real configs kept as data: mpt_kv/data/families/<name>.json, and the seed's
    MPT config mpt_kv/data/mpt-7b.json."""
    folder = package_data.REAL_CONFIGS
    names = {p.stem for p in folder.glob("*.json")} if folder.is_dir() else set()
    return names | ({"mpt-7b"} if package_data.MPT_7B_CONFIG.is_file() else set())


def load_families(path: str | Path = FAMILY_FILE) -> list[Entry]:
    """Every entry of a family known-failures file, checked (its fields, and that the matrix has its
    cell): a malformed one is a KnownFailuresError (a ValueError) naming the file, the entry and why."""
    # lazy: the family registry, its implementations and the check registry import torch (the
    # plugin reads the family file when it collects the first family case)
    from mpt_kv.families import FAMILIES
    from mpt_kv.families.implementations import IMPLEMENTATIONS

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise KnownFailuresError(f"family known failures {path}: expected a JSON list of entries, got "
                                 f"{type(data).__name__}")
    entries = [family_entry(raw, i, path, FAMILIES, IMPLEMENTATIONS) for i, raw in enumerate(data)]
    check_entries_cover_cells(entries)
    return entries


def check_entries_cover_cells(entries) -> None:
    """An entry about a cell the family matrix does not have (P0 of transformers, P2 on concat, a path
    the implementation lacks: `mpt_kv.checks.registry.applies`) would never apply: an error naming it,
    not an entry silently unused."""
    # lazy: as load_families'
    from mpt_kv.checks.registry import CHECKS, applies
    from mpt_kv.families.implementations import ORACLE_ATTENTION, PATHS as IMPLEMENTATION_PATHS, recipe_paths
    from mpt_kv.targets import FamilyTarget

    for e in entries:
        paths = IMPLEMENTATION_PATHS[e.implementation] + recipe_paths(e.implementation, e.family, e.variant)
        target = FamilyTarget(e.implementation, e.family, e.variant, paths,
                              oracle=e.implementation == "transformers" and e.attention in (None, ORACLE_ATTENTION),
                              attention=e.attention)
        if not any(c.property == e.property and e.path in (None, c.path) and e.check in (None, c.id) and applies(c, target)
                   for c in CHECKS.values()):
            raise KnownFailuresError(
                f"family known failure {e.implementation} {e.family}/{e.variant} {e.property} path {e.path or 'any'}: "
                f"the matrix has no such cell (paths of {e.implementation}/{e.family}/{e.variant}: {paths}; "
                "family-P0 only on concat and not for transformers with eager attention; family-P2 only on static paths)")


# --- the rule ----------------------------------------------------------------------------------------

def matching(target: str, prop: str, path: str | None, entries: list[Entry] | None = None,
             bucket: int | None = None, check: str | None = None, dtype: str | None = None,
             device: str | None = None) -> list[Entry]:
    """The entries that apply (installed versions) to the case (target, property, path, bucketed or
    not, check id, dtype, device kind), in file order; [] for none. Every case's, MPT and family alike
    (the pytest plugin asks here). Only the most specific apply: an entry that names the case's target
    as it is (with its attention implementation, "transformers[sdpa]/falcon/alibi") replaces those that
    name its family target ("transformers/falcon/alibi"), a recipe cell's own entries replace those
    of every path, and a bucketed case's own (`bucket`: true) those of every bucket, whatever their order
    in the file. Several entries at that level are several known failures of the case (`known_verdict`:
    each of its independent failures explained by one, each one's failure seen)."""
    candidates = [e for e in (load() if entries is None else entries)
                  if e.covers(target, prop, path, bucket, check, dtype, device) and e.applies()]
    recipe_cell = bool(path and recipes.SEPARATOR in path)

    def specificity(e):
        return (e.target != target, recipe_cell and e.path != path, bucket is not None and e.bucket is None)

    best = min(map(specificity, candidates), default=None)
    return [e for e in candidates if specificity(e) == best]


def match(target: str, prop: str, path: str | None, entries: list[Entry] | None = None,
          bucket: int | None = None, check: str | None = None, dtype: str | None = None,
          device: str | None = None) -> Entry | None:
    """The first of the entries that apply to the case (`matching`), or None."""
    found = matching(target, prop, path, entries, bucket, check, dtype, device)
    return found[0] if found else None
