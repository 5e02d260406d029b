"""Known failures of a new generate mode derived from an existing mode's entries, where a new cell fails
with a finding already known (`python -m mpt_kv findings --derive SOURCE NEW REPORT`).

A new mode's cells (say `generate/concat/multi-turn`) often fail by a finding the suite already holds for
another mode of the same cell (`generate/concat/greedy`: a view of the fused projection pinned at the
prefill, a window layer kept too long). An entry is derived for a failed cell only where one of the source
mode's entries that applies to the cell (same target, path, dtype and device, installed versions) finds the
cell's own failure message with its pattern, the mode's name in it replaced, or else where a direct-drive entry
of the cell's target (family-memory, family-P1 ...) finds it as it is; the derived entry is that entry
with the new check id and pattern, the same range, upstream line and repro (one finding, one repro folder),
and a reason that says it was derived. A failed cell no source entry explains is listed, never guessed.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from mpt_kv.findings import entries as known_entries


def derive(results: list[dict], source: str, new: str, entries: list, raw: dict[str, list]) -> tuple[list, list]:
    """(derived raw entries, unexplained results) for the failed `generate/<path>/<new>` cells of `results` (a
    conformance report's "results"); `entries` the loaded entries, `raw` each entry file's raw list by the
    file name the entries carry (`Entry.file`)."""
    derived, unexplained, seen = [], [], set()
    for r in results:
        if r.get("outcome") not in ("failed", "error") or not str(r.get("check", "")).endswith(f"/{new}"):
            continue
        path = r.get("path")
        check = f"generate/{path}/{source}"
        found = None
        for e in known_entries.matching(r["target"], "generate", path, entries, r.get("bucket"), check, r.get("dtype"),
                                        r.get("device")):
            pattern = e.pattern.pattern.replace(re.escape(check), re.escape(r["check"])).replace(
                f"/{source}", f"/{new}")
            if re.search(pattern, r.get("message", "")):
                found = (e, pattern)
                break
        if found is None:  # a direct-drive finding of the cell's target (family-memory's stored windows ...)
            found = next(((e, e.pattern.pattern) for e in entries
                          if e.property != "generate" and e.covers(r["target"], e.property, path, r.get("bucket"),
                                                                    e.check, r.get("dtype"), r.get("device"))
                          and e.applies() and e.pattern.search(r.get("message", ""))), None)
        if found is None:
            unexplained.append(r)
            continue
        e, pattern = found
        mode = source if e.property == "generate" else f"{e.check or e.property} (the direct drive)"
        if (e.file, e.index, r["check"], r["target"]) in seen:
            continue
        seen.add((e.file, e.index, r["check"], r["target"]))
        entry = copy.deepcopy(raw[e.file][e.index])
        entry.update(property="generate", check=r["check"], path=path, pattern=pattern,
                     reason=f"Derived from the {mode} entry: the same failure message, seen in the {new} cell "
                            f"(`python -m mpt_kv findings --derive {source} {new}`). {entry['reason']}")
        derived.append(entry)
    return derived, unexplained


def derive_from_reports(reports: list[Path], source: str, new: str) -> tuple[list, list]:
    """`derive` over the reports' results, with the installed known-failures files (MPT and family)."""
    results = [r for report in reports for r in json.loads(Path(report).read_text(encoding="utf-8"))["results"]]
    # the family file only where a family target ran (it is read as the plugin reads it: with the family registry)
    families = any(r.get("target", "").count("/") == 2 for r in results)
    entries = known_entries.load() + (known_entries.load_families() if families else [])
    raw = {}
    for e in entries:
        if e.file not in raw:
            raw[e.file] = json.loads(Path(e.file).read_text(encoding="utf-8"))
    return derive(results, source, new, entries, raw)
