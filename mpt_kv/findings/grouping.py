"""A finding: the known-failures entries of one upstream bug, seen by several checks, grouped and
worded once for the findings table (`python -m mpt_kv findings`), the standalone repros
(`mpt_kv.findings.repros`) and their READMEs. The entries are raw, as the file has them
(`mpt_kv.findings.raw.raw_entries`)."""

from __future__ import annotations

import re

from mpt_kv.families import FAMILIES
from mpt_kv.findings.raw import target_of

DTYPE_NAME = "bfloat16"  # 2 bytes per element: the dtype these checkpoints are served in on Gaudi
# (batch, tokens); tokens None: the checkpoint's own context length, from its config.json
POINTS = [(16, 1024), (1, None)]
VIEW_NAMES = {("key", "value"): "K and V view", ("value",): "V views", ("key",): "K views",
              ("key_value",): "the fused K/V views"}


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def what(entry: dict) -> str:
    """What pins (the views) or the error the finding's pattern names."""
    views = entry.get("views")
    if views:
        fused = FAMILIES[target_of(entry)[1]].fused
        verb = VIEW_NAMES.get(tuple(views), " and ".join(views) + " view")
        if "no fused projection's output" in entry["pattern"]:  # e.g. DBRX: a clamp of the output, same size
            return f"{verb} a new buffer of `{fused}`'s output size"
        return f"{verb} `{fused}`'s output"
    return "`" + re.sub(r"\\(\W)", r"\1", entry["pattern"]) + "`"  # the pattern, unescaped


def versions(entry: dict) -> str:
    """The versions it holds in, and the one dtype or device it holds on where the entry names one."""
    text = ", ".join(f"{package} {spec}" for package, spec in entry.get("when", {}).items()) or "all"
    only = [entry[k] for k in ("dtype", "device") if entry.get(k)]
    return text + (f" ({', '.join(only)} only)" if only else "")


def checks_seen(entries: list[dict]) -> str:
    """The checks (with the path where an entry names one; a check id where it names one, as a generate
    entry does: generate/static/beam) that see one finding."""
    return ", ".join(e["check"] if e.get("check") else e["property"] + (f" ({e['path']})" if e.get("path") else "")
                     for e in entries)


def grouped(entries: list[dict]) -> list[list[dict]]:
    """The file's entries grouped by finding: the same family variant, implementation, versions,
    what pins or fails, and upstream line make one finding, seen by several checks. A finding
    is a row (the file keeps an entry per check: each xfails its own cases)."""
    groups: dict[tuple, list[dict]] = {}
    for entry in entries:
        implementation, family, variant = target_of(entry)
        key = (family, variant, implementation, versions(entry), what(entry), entry["upstream"])
        groups.setdefault(key, []).append(entry)
    return list(groups.values())
