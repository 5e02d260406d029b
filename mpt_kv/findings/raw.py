"""The known-failures files as they are written: their entries as raw dicts (every key kept), a family
entry of either shape given its `target`. What the findings' tables, costs, repros and sweeps read
(`mpt_kv.findings.entries` checks the files and applies them). No torch, no other module of the
findings: the repros import it, and `entries` imports the repros (a `repro` field must name one).
"""

from __future__ import annotations

import json
from pathlib import Path

from mpt_kv import package_data

MPT_FILE = package_data.MPT_KNOWN_FAILURES
FAMILY_FILE = package_data.FAMILY_KNOWN_FAILURES
LEGACY_TARGET = ("family", "variant", "implementation")


def normalized(raw):
    """A family entry of the shape before this format (family, variant, implementation) with its
    `target`, the other fields as they are; any other entry (or a non-object) unchanged."""
    if not isinstance(raw, dict) or "target" in raw or not {"family", "variant"} <= set(raw):
        return raw
    out = {"target": f"{raw.get('implementation', 'transformers')}/{raw['family']}/{raw['variant']}"}
    out.update((k, v) for k, v in raw.items() if k not in LEGACY_TARGET)
    return out


def target_of(entry: dict) -> tuple[str, str | None, str | None]:
    """(implementation, family, variant) of a raw entry of either shape (an MPT entry: (its target,
    None, None))."""
    if "target" not in entry:
        return entry.get("implementation", "transformers"), entry.get("family"), entry.get("variant")
    split = entry["target"].split("/")
    return (split[0], split[1], split[2]) if len(split) == 3 else (entry["target"], None, None)


def is_family(entry: dict) -> bool:
    """A raw entry about a family target (of either shape)."""
    return target_of(entry)[1] is not None


def raw_entries(path: str | Path | None = None) -> list[dict]:
    """A file's entries (default: the family file, `FAMILY_FILE`) as raw dicts, every key kept and a
    family entry with its `target`, for the findings' tables, costs and repros: what the file says,
    unchecked (`mpt_kv.findings.entries.load`, `load_families` check it)."""
    return [normalized(raw) for raw in json.loads(Path(path or FAMILY_FILE).read_text(encoding="utf-8"))]
