"""Known upstream failures of the family checks, as data (`known_failures.json` beside this
file): the same idea as `mpt_kv.targets.known_failures`, keyed by family and variant.

    {"family": "mpt", "variant": "alibi", "property": "family-P3",
     "when": {"transformers": "<4.56"},
     "pattern": "layer 0 key .* (is a view|are views) of .*Wqkv's output",
     "upstream": "transformers/cache_utils.py:NNN", "reason": "..."}

A case an entry applies to (the installed versions match `when`) is a strict xfail that only a
`PropertyFailure` whose message the pattern finds (`re.search`) satisfies; a pass or any other
failure fails the case (the test does this: `expect_known`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet

FILE = Path(__file__).with_name("known_failures.json")
FIELDS = {"family": str, "variant": str, "property": str, "pattern": str, "reason": str, "upstream": str,
          "when": dict}
PROPERTIES = ("family-P1", "family-P3")


@dataclass(frozen=True)
class Known:
    family: str
    variant: str
    property: str
    pattern: re.Pattern
    reason: str
    upstream: str
    when: dict  # distribution -> SpecifierSet

    def applies(self) -> bool:
        for package, spec in self.when.items():
            try:
                if not spec.contains(version(package), prereleases=True):
                    return False
            except PackageNotFoundError:
                return False
        return True


def load(path: str | Path = FILE) -> list[Known]:
    """Every entry, checked: a malformed one is a ValueError naming the file, the entry and why."""
    from mpt_kv.families import FAMILIES

    out = []
    for i, raw in enumerate(json.loads(Path(path).read_text())):
        def bad(what):
            return ValueError(f"family known failures {path}: entry {i}: {what}")
        if not isinstance(raw, dict) or set(raw) != set(FIELDS):
            raise bad(f"expected an object with exactly the fields {sorted(FIELDS)}, got {raw!r}")
        for name, kind in FIELDS.items():
            if not isinstance(raw[name], kind):
                raise bad(f"{name!r} must be a {kind.__name__}, got {raw[name]!r}")
        if raw["family"] not in FAMILIES or raw["variant"] not in FAMILIES[raw["family"]].variants:
            raise bad(f"no family variant {raw['family']}/{raw['variant']}")
        if raw["property"] not in PROPERTIES:
            raise bad(f"unknown property {raw['property']!r}; expected one of {PROPERTIES}")
        pattern = re.compile(raw["pattern"])
        if pattern.search(""):
            raise bad(f"pattern {raw['pattern']!r} matches the empty string, so any message")
        try:
            when = {p: SpecifierSet(s) for p, s in raw["when"].items()}
        except InvalidSpecifier as e:
            raise bad(f"'when' is not a version specifier: {e}") from None
        out.append(Known(raw["family"], raw["variant"], raw["property"], pattern, raw["reason"], raw["upstream"],
                         when))
    return out


def applying(family: str, variant: str, prop: str, entries: list[Known]) -> Known | None:
    """The entry that applies to the case here, if any."""
    for e in entries:
        if (e.family, e.variant, e.property) == (family, variant, prop) and e.applies():
            return e
    return None
