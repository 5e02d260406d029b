"""The known-failure rule, one for every check (MPT and family alike) and every file: known upstream
failures are data, a JSON list of entries, one per (target, property, path) with the package
versions it applies to. mpt-kv's own for its MPT targets is mpt_kv/targets/known_failures.json (a
project's own file replaces it); the family checks' is mpt_kv/families/known_failures.json, whose
loader (`mpt_kv.families.known_failures`) makes the same `Entry` objects, its target
"<implementation>/<family>/<variant>".

    {"target": "transformers", "property": "P3", "path": "concat",
     "when": {"transformers": "<4.56"},
     "pattern": "(key|value) \\([0-9, ]+\\) (is a view|are views) of (layer \\d+'s )?mixed_qkv",
     "reason": "transformers <4.56: DynamicLayer.update stores the first K/V as is ..."}

required  target, property (one of PROPERTIES), pattern (a regular expression), reason
optional  path (one of PATHS; absent: any), bucket (true/false; absent: either),
          when ({distribution: PEP 440 specifier}; absent: every version),
          check (a registry check id, e.g. "P0/alibi-bias-max-16": that check only; absent: every
          check of the property. A caller that does not say which check a case is, matches no
          entry that names one: the case then fails, never xfails by accident)

A matching case is expected to fail with a `PropertyFailure` whose message the pattern finds
(`re.search`); only that failure xfails. Any other exception, a message the pattern does not
find, or a pass (the day upstream fixes it) fails the case: a known failure must never hide a
different one. So a pattern must name its failure (`compile_pattern`): a literal text of
MIN_LITERAL characters in every match, and no match in `generic_failures()`. The plugin lists entries that matched no case of a run, an error with
`--strict-known-failures`. A malformed file is a `KnownFailuresError` naming the file, the
entry and what is wrong."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from mpt_kv import package_data, versions
from mpt_kv.checks import index
from mpt_kv.errors import KnownFailuresError, PropertyFailure

FILE = package_data.MPT_KNOWN_FAILURES
PROPERTIES = tuple(p.name for p in index.PROPERTIES if not p.family)  # what an MPT entry may name
PATHS = ("concat", "static")
REQUIRED = {"target": str, "property": str, "pattern": str, "reason": str}
# "repro": the finding's standalone repro, a folder of `python -m mpt_kv findings --repro DIR`
# (mpt_kv.families.repros: a script kept in mpt_kv/targets/repros/, or a family finding's repro)
OPTIONAL = {"path": str, "bucket": bool, "when": dict, "check": str, "repro": str}




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
    # a family entry's (mpt_kv.families.known_failures): the upstream file and line, which cached
    # tensors view the fused output, the real config its cost is computed at
    upstream: str = ""
    views: tuple = ()
    cost_config: str | None = None

    @property
    def implementation(self) -> str:
        """The built-in target or family implementation the entry is about (a family entry's target is
        "<implementation>/<family>/<variant>")."""
        return self.target.split("/", 1)[0]

    @property
    def key(self) -> tuple[str, int]:
        """The entry's identity in a run that judges several files: (its file, its index there)."""
        return (self.file, self.index)

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
        where = "".join(f" {x}" for x in (self.path, {True: "bucket", False: "no bucket"}.get(self.bucket)) if x)
        return f"entry {self.index} ({self.target} {self.check or self.property}{where})"

    def applies(self) -> bool:
        """True where every package of `when` is installed in a version it names."""
        return installed_versions_match(self.when)

    def covers(self, target: str, prop: str, path: str | None, bucket: int | None, check: str | None = None) -> bool:
        """This entry is about the case (target, property, path, bucketed or not, check id)."""
        return (self.target == target and self.property == prop and self.path in (None, path)
                and self.bucket in (None, bucket is not None) and self.check in (None, check))

    def explains(self, exc: BaseException | None) -> bool:
        """The failure is the known one: a PropertyFailure (every one, when hypothesis reports
        several) whose message the pattern finds."""
        if exc is None:
            return False
        group = getattr(exc, "exceptions", None)  # an exception group of distinct failures
        if group is not None and not isinstance(exc, PropertyFailure):
            return bool(group) and all(self.explains(e) for e in group)
        return isinstance(exc, PropertyFailure) and self.pattern.search(str(exc)) is not None


def _entry(raw, index: int, file: str) -> Entry:
    def bad(what: str):
        label = f"entry {index}"
        if isinstance(raw, dict) and isinstance(raw.get("target"), str) and isinstance(raw.get("property"), str):
            label += f" ({raw['target']} {raw['property']})"
        return KnownFailuresError(f"known failures file {file}: {label}: {what}")

    check_fields(raw, REQUIRED, OPTIONAL, bad)
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
    return Entry(index, raw["target"], raw["property"], raw["reason"], pattern, raw.get("path"), raw.get("bucket"),
                 when, file, raw.get("check"))


def check_repro(name: str, bad) -> None:
    """'repro' names a folder `python -m mpt_kv findings --repro DIR` writes (mpt_kv.families.repros:
    a kept MPT script or a family finding's repro): a name of none is refused, not kept as a dead link."""
    import difflib

    from mpt_kv.families.repros import repro_names  # lazy: the families import torch (the loader runs in hooks)

    names = repro_names()
    if name not in names:
        close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
        raise bad(f"'repro' {name!r} names no repro of `python -m mpt_kv findings --repro DIR` "
                  + (f"(closest: {', '.join(close)})" if close else f"({len(names)} exist; the list: docs/findings.md)")
                  + ": name one, or drop the field while the finding has none")


# --- what every known-failures file checks (mpt_kv.families.known_failures too) ----------------------------

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


def compile_pattern(value: str, bad) -> re.Pattern:
    """The entry's regular expression, which must name a failure, not any failure: it may not
    match the empty string, must require a literal text of at least MIN_LITERAL characters in every
    match (`literal_run`), and may not match any line of GENERIC_FAILURES (what the suite prints for
    a crash with a generic error, or a check's header with no finding). The one rule of every
    known-failures file (MPT targets, families, a project's own)."""
    try:
        pattern = re.compile(value)
    except re.error as e:
        raise bad(f"'pattern' {value!r} is not a regular expression: {e}") from None
    if pattern.search(""):
        raise bad(f"'pattern' {value!r} matches the empty string, so any message: name the failure")
    run = literal_run(value)
    if run < MIN_LITERAL:
        raise bad(f"'pattern' {value!r} requires a literal text of only {run} characters in a match, fewer "
                  f"than {MIN_LITERAL}: it would match failures it does not name; quote the failure's message")
    generic = next((line for line in generic_failures() if pattern.search(line)), None)
    if generic is not None:
        raise bad(f"'pattern' {value!r} matches a generic failure that names no finding ({generic!r}): quote "
                  f"what is specific to the failure (the finding, or the exception's own message)")
    return pattern


# A known failure's pattern quotes its message: the shortest literal every shipped pattern requires
# is 15 characters ("') is a view of "' in the MPT P3 entries); the generic words a pattern must not stop at
# ("error", "failed", "Traceback", "P3 cache", "is a view") are shorter.
MIN_LITERAL = 12


def literal_run(value: str) -> int:
    """The length of the longest run of literal characters that every match of the regular
    expression `value` contains (an alternation: the shortest over its branches; an optional or
    repeated-from-zero part: none), from its parse tree."""
    try:
        import re._parser as sre_parse
        from re import _constants as sre
    except ImportError:  # Python < 3.11
        import sre_constants as sre
        import sre_parse
    zero_width = {sre.AT, sre.ASSERT, sre.ASSERT_NOT}

    def seq(items):  # -> (whole, prefix, suffix, best); whole: the length when all literal, else None
        whole, pre, suf, best = 0, 0, 0, 0
        for op, av in items:
            w, p, s, b = node(op, av)
            if whole is not None:
                pre = whole + (w if w is not None else p)
            best = max(best, b, suf + p)
            suf = suf + w if w is not None else s
            whole = whole + w if whole is not None and w is not None else None
        best = max(best, pre, suf)
        return whole, pre if whole is None else whole, suf, best

    def node(op, av):
        if op is sre.LITERAL:
            return 1, 1, 1, 1
        if op is sre.IN and len(av) == 1 and av[0][0] is sre.LITERAL:  # [.] is the literal .
            return 1, 1, 1, 1
        if op in zero_width:
            return 0, 0, 0, 0
        if op is sre.SUBPATTERN:
            return seq(av[-1])
        if getattr(sre, "ATOMIC_GROUP", None) is not None and op is sre.ATOMIC_GROUP:
            return seq(av)
        if op is sre.BRANCH:
            parts = [seq(branch) for branch in av[1]]
            wholes = {w for w, *_ in parts}
            return (wholes.pop() if len(wholes) == 1 else None if None in wholes else min(wholes),
                    *(min(part[i] for part in parts) for i in (1, 2, 3)))
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
            low, high, sub = av
            if low == 0:
                return None, 0, 0, 0
            w, p, s, b = seq(sub)
            if w is not None and low == high:
                return w * low, w * low, w * low, w * low
            return None, p, s, max(b, s + p if low > 1 else 0)
        return None, 0, 0, 0  # any character, a class, a category, a back reference

    return seq(sre_parse.parse(value))[3]


def generic_failures() -> tuple[str, ...]:
    """What the suite's checks print for a failure that names no finding, filled with neutral
    values: the crash wrappers with a generic error (mpt_kv/checks/programs.py run_op,
    mpt_kv/checks/family_driver.py call), the headers of the aliasing and memory checks, an
    assert_close (mpt_kv/checks/compare.py) of neutral tensors, and bare words. A pattern that
    matches one of them would xfail a different failure than the one it was written for."""
    global _GENERIC
    if _GENERIC:
        return _GENERIC
    crashes = [f"{t}: {t in ('KeyError',) and repr('boom') or 'boom'}" for t in
               ("RuntimeError", "ValueError", "TypeError", "KeyError", "IndexError", "AttributeError",
                "AssertionError", "ZeroDivisionError", "NotImplementedError")]
    ops = {"decode": "decode", "extend": "extend 2", "crop": "crop -1", "reorder": "reorder [1, 0]"}
    mpt = ["ops-P1", "ops-P2 (concat)", "ops-P2 (static)", "ops-P2 (fp32 twin)", "ops-P3", "ops-memory"]
    family = ["family-P0", "family-P1", "family-P2", "family-P3", "family-P4", "family-ops", "family-memory"]
    lines = ["error", "failed", "AssertionError", "Traceback (most recent call last)", "PropertyFailure",
             "x differ at 1 of 2 elements (bound 1.000e-05 = 1e-05 + 1e-05 x max|expected|, float32 logits): "
             "max abs err 1.000e+00 = 1e+05 x bound at (0,) (got 1, expected 0); max rel err 1.000e+12 at (0,); "
             "shape (2,) [step=0]",
             "x: shape (2,) != expected (3,) [step=0]",
             "x: NaN/inf appeared (got: 1 NaN, 0 inf of 2 compared elements, first at (0,)); shape (2,) [step=0]",
             "P3 cache aliasing after step prefill: x [step=prefill]",
             "ops-P3 cache aliasing after decode (step 0): x [step=0]",
             "family-P3 cache pins storage after prefill: x [step=prefill, operation=prefill]",
             "family-memory after prefill: the cache's distinct storages hold 2 bytes, the family's analytic K/V "
             "for 1 x 1 tokens 1: +1 bytes; x [step=prefill, operation=prefill]",
             "ops-memory decode: transient 2 bytes > bound 1 bytes: x [operation=decode]"]
    lines += [f"{p}: raised while running the target [step=0]" for p in index.NAMES]
    for crash in crashes:
        for kind, described in ops.items():
            lines += [f"{what}: the target's {kind} raised {crash} at step 0 ({described}) "
                      f"[step=0, operation={kind}]" for what in mpt]
        for operation in ("prefill", "decode", "extend", "crop", "reorder", "logits"):
            lines += [f"{check}{what}: the implementation's {operation} raised {crash} "
                      f"[step=0, operation={operation}]"
                      for check in family for what in ("", " prefill", " decode 0")]
    _GENERIC = tuple(lines)
    return _GENERIC


_GENERIC: tuple[str, ...] = ()


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


def load(path: str | Path = FILE) -> list[Entry]:
    """Every entry of the file, checked; KnownFailuresError if the file or an entry is malformed."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise KnownFailuresError(f"known failures file {path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KnownFailuresError(f"known failures file {path}: not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise KnownFailuresError(f"known failures file {path}: expected a JSON list of entries, got "
                                 f"{type(data).__name__}")
    return [_entry(raw, i, str(path)) for i, raw in enumerate(data)]


def match(target: str, prop: str, path: str | None, entries: list[Entry] | None = None,
          bucket: int | None = None, check: str | None = None) -> Entry | None:
    """The entry that applies (installed versions) to the case (target, property, path,
    bucketed or not, check id), or None."""
    for e in load() if entries is None else entries:
        if e.covers(target, prop, path, bucket, check) and e.applies():
            return e
    return None
