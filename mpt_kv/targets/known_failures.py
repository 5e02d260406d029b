"""Known upstream failures are data: `known_failures.json`, one entry per (target, property,
path) with the package versions it applies to. The plugin turns each match into a strict
xfail, so the day upstream fixes it, the suite says so (XPASS fails) and the entry goes."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.specifiers import SpecifierSet

FILE = Path(__file__).with_name("known_failures.json")


def load(path: Path = FILE) -> list[dict]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"cannot read known failures from {path}: {e}") from e
    for e in entries:
        missing = {"target", "property", "reason"} - e.keys()
        if missing:
            raise RuntimeError(f"{path}: entry {e} lacks {sorted(missing)}")
    return entries


def applies(entry: dict) -> bool:
    for package, spec in entry.get("when", {}).items():
        try:
            if version(package) not in SpecifierSet(spec):
                return False
        except PackageNotFoundError:
            return False
    return True


def match(target: str, prop: str, path: str | None, entries: list[dict] | None = None,
          bucket: int | None = None) -> str | None:
    """The reason if (target, property, path, bucketed or not) is a known failure with the
    installed versions. An entry without "path" or "bucket" matches any."""
    for e in load() if entries is None else entries:
        if (e["target"] == target and e["property"] == prop and e.get("path", path) == path
                and e.get("bucket", bucket is not None) == (bucket is not None) and applies(e)):
            return e["reason"]
    return None
