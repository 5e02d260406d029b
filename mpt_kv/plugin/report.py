"""The conformance matrix and the JSON report: one row per target (with its versions), device,
dtype and cache path, one column per property; the lines under it (declared capabilities,
ceilings not stored, cells whose checks disagree, notes); `--mpt-kv-report FILE` writes the run as
JSON, last, so a file that cannot be written still leaves the matrix and the verdict on screen.
`python -m mpt_kv report A.json B.json` (mpt_kv/cli/report.py) prints and merges such files
with the same functions.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict

from mpt_kv.outputs import write_text
from mpt_kv import devices, recipes, versions
from mpt_kv.checks import index, profiles
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin.ceilings import record_command
from mpt_kv.plugin.gate import kind_reason
from mpt_kv.checks import reach
from mpt_kv.plugin.options import reference_model

PROPERTY_NAMES = index.TITLES  # the matrix's columns, in the index's order, and their legend
ALWAYS = index.ALWAYS  # shown in every run; the others where the run has them
# a cell whose checks disagree shows its worst word: the first of these
SEVERITY = ("error", "failed", "XPASS", "xfail", "unsupported", "skipped", "passed")
MAX_LINES = 20  # of each kind of line under the matrix


def path_cell(r: dict) -> str:
    return r.get("path", "-") + ("" if r.get("bucket") is None else f"+bucket{r['bucket']}")


def target_label(r: dict) -> str:
    """'transformers 5.24', 'optimum-habana 1.21 (transformers 4.55)', 'reference', 'pkg.mod:build'."""
    target, versions = r.get("target", "?"), r.get("target_version", "")
    if not versions:
        return target
    first, _, rest = versions.partition(", ")
    if first.split(" ")[0] == target:
        return first + (f" ({rest})" if rest else "")
    return f"{target} ({versions})"


def _rank(outcome: str) -> int:
    return SEVERITY.index(outcome) if outcome in SEVERITY else -1  # an unknown word: worst


def cell(outcomes: list[str]) -> str:
    """One word if a cell's checks agree; else its worst word and how many of its checks had it:
    `failed(2/5)` (the line under the matrix names which)."""
    if len(set(outcomes)) == 1:
        return outcomes[0]
    worst = min(outcomes, key=_rank)
    return f"{worst}({outcomes.count(worst)}/{len(outcomes)})"


def _which(r: dict) -> str:
    return r.get("check") or r.get("nodeid", "?").rsplit("::", 1)[-1]


def mixed_cell_lines(key: tuple, prop: str, results: list[dict]) -> str:
    """`transformers 5.24 cpu float32 static P1 failed(2/5): failed P1/static/graphs, P1/static/head-dim-128; 3 passed`."""
    by_word = defaultdict(list)
    for r in results:
        by_word[r["outcome"]].append(_which(r))
    parts = [f"{n} passed" if word == "passed" else f"{word} {', '.join(ids)}"
             for word, ids, n in sorted(((w, i, len(i)) for w, i in by_word.items()), key=lambda x: _rank(x[0]))]
    return f"  {' '.join(key)} {prop} {cell([r['outcome'] for r in results])}: {'; '.join(parts)}"


def matrix_lines(results: list[dict], absent: dict[str, str], profile: str | None) -> list[str]:
    """The conformance matrix: one row per target (with its version), device, dtype and cache path;
    one column per property. A device absent here gets one line, not a row per target."""
    cells, notes = defaultdict(lambda: defaultdict(list)), []
    for r in results:
        if r.get("device") in absent:
            continue
        key = (target_label(r), r.get("device", "?"), r.get("dtype", "-"), path_cell(r))
        cells[key][r["property"]].append(r)
        notes += r.get("notes", [])
    lines = []
    for kind, reason in absent.items():
        n = sum(1 for r in results if r.get("device") == kind)
        lines.append(f"{kind}: {n} cases skipped, not available here: {reason}")
    if not cells:
        return lines
    # the gate's properties always; the cache operations' and other families' where this run has them
    # (a property the table does not know, e.g. a project's own, still gets a column, at the end)
    seen = {p for key in cells for p in cells[key]}
    columns = [p for p in PROPERTY_NAMES if p in ALWAYS or p in seen] + sorted(seen - set(PROPERTY_NAMES))
    heads = ["target", "device", "dtype", "path", *columns]
    order = sorted(cells, key=lambda k: (k[0] != "reference", k))  # the oracle first
    table = [[*key, *(cell([r["outcome"] for r in cells[key][p]]) if p in cells[key] else "-" for p in columns)]
             for key in order]
    widths = [max(len(str(row[i])) for row in [heads, *table]) for i in range(len(heads))]
    for row in [heads, *table]:
        lines.append(" ".join(f"{c:<{w}}" for c, w in zip(row, widths)).rstrip())
    lines.append("  " + "; ".join(f"{k} {PROPERTY_NAMES.get(k, k)}" for k in columns)
                 + (f"; hypothesis profile {profile}" if profile else "")
                 + ". failed: a property does not hold; error: the target or its adapter raised something else; "
                   "unsupported: the target declares it does not implement what the case needs; failed(2/5): 2 of "
                   "the cell's 5 checks failed, the worst word of a cell whose checks disagree. Reasons: pytest -rs")
    # the flags of each recipe path of the run (mpt_kv/recipes.py: optimum-habana's text-generation command lines)
    for path in sorted({key[3] for key in cells if recipes.SEPARATOR in str(key[3])}):
        recipe = recipes.recipe_of(path)
        if recipe is not None:
            lines.append(f"  path {path}: the recipe {recipe.name}, {recipe.describe()}")
    mixed = [mixed_cell_lines(key, p, cells[key][p]) for key in order for p in columns
             if p in cells[key] and len({r["outcome"] for r in cells[key][p]}) > 1]
    lines += mixed[:MAX_LINES] + ([f"  ... and {len(mixed) - MAX_LINES} more cells whose checks disagree"]
                                  if len(mixed) > MAX_LINES else [])
    lines += known_failure_lines(results, absent)
    for n in list(dict.fromkeys(notes))[:MAX_LINES]:
        lines.append(f"  note: {n}")
    return lines


# "known upstream failure, entry 22 (transformers/falcon/new-arch-gqa family-memory): <its reason>"
# (mpt_kv/plugin/known_failures.py apply): the reason is what a line under the matrix shows
KNOWN_ENTRY = re.compile(r"^known (?:upstream failure|failure of this project \([^)]*\)), (entry \d+) \(([^)]*)\): ")
REASON_CHARS = 160


def known_failure_lines(results: list[dict], absent: dict[str, str]) -> list[str]:
    """One line per finding the run's xfail cells met, under the matrix: the target with its version,
    the checks and paths that saw it, how many cases, the reason's start and the upstream line (entries
    of several checks with the same reason are one finding)."""
    found: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        if r.get("outcome") == "xfail" and r.get("device") not in absent:
            reason = KNOWN_ENTRY.sub("", r.get("message") or "?")
            found[(target_label(r), reason, r.get("upstream", ""))].append(r)
    lines = []
    for (label, reason, upstream), cases in found.items():
        reason = reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS - 3] + "..."
        checks = ", ".join(dict.fromkeys(r["property"] + (f"/{path_cell(r)}" if r.get("path") else "") for r in cases))
        lines.append(f"  xfail {label} {checks} ({len(cases)} case{'s' if len(cases) > 1 else ''}): {reason}"
                     + (f" [{upstream}]" if upstream else ""))
    return ["  known failures, by what the xfail cells found:", *lines] if lines else []


def header() -> str:
    """The matrix's title line, naming the mpt-kv that judged the run (a CI log says which)."""
    return f"mpt-kv conformance (mpt-kv {versions.mpt_kv()})"


def project_lines(extras: dict, config=None) -> list[str]:
    """What targets declared unsupported, and which memory cases had no stored ceiling (one line each)."""

    lines = []
    for target, unsupported in sorted(extras.get("capabilities", {}).items()):
        what = "; ".join(f"{f} ({why})" + (": not drawn, its other cases run" if f == "clip_qkv" else "")
                         for f, why in sorted(unsupported.items()))
        lines.append(f"  {target} declares unsupported: {what}")
    for u in extras.get("unrecorded", {}).values():
        command = f"`{record_command(config)}`" if config is not None else "python -m pytest ... --update-ceilings"
        lines.append(f"  memory: {u['target']} on {u['device']} has no stored ceilings in {u['file']} ({u['cases']} "
                     f"cases checked against the analytic model only); record them: {command}, then commit the file")
    return lines


def absent_devices(config, results: list[dict]) -> dict[str, str]:
    """Device kinds with cases in `results` that are not available here, with the reason (as the
    gate's survey sees them: under xdist, the controller's)."""

    kinds = {r.get("device") for r in results}
    return {k: kind_reason(config, k) for k in devices.KINDS if k in kinds and kind_reason(config, k)}


def environment() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "optimum-habana", "llm-foundry", "mpt-kv"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def with_versions(results: list[dict]) -> list[dict]:
    """Each result with its target's implementing package versions (built-in targets)."""
    labels = {t: versions.target_version(t) for t in {r.get("target", "") for r in results}}
    return [{**r, "target_version": labels[r.get("target", "")]} if labels[r.get("target", "")] else r
            for r in results]


def clear_stale_report(config) -> None:
    """A report left by an earlier run must not stand in for this one if it stops early."""
    path = config.getoption("mpt_kv_report")
    if path and getattr(config, "workerinput", None) is None and os.path.exists(path):
        os.remove(path)


def write_report(config, path, results: list[dict], memory: list[dict], extras: dict) -> str | None:
    """The run as JSON: the mpt-kv version that judged it, results, memory measurements, absent
    devices, capabilities, reach, environment. Returns why it could not be written (None: written)."""
    results = with_versions([r for r in results if "property" in r])
    data = {"mpt_kv_version": versions.mpt_kv(),  # which mpt-kv judged this run (docs/releasing.md)
            "results": results, "memory": memory, "absent_devices": absent_devices(config, results),
            "hypothesis_profile": profiles.current(), "environment": environment(),
            "written": time.strftime("%Y-%m-%d %H:%M:%S"),
            "allow_missing_device": bool(config.getoption("allow_missing_device")),
            "allow_no_cache_check": bool(config.getoption("allow_no_cache_check")),
            "capabilities": extras["capabilities"], "unrecorded": list(extras["unrecorded"].values()),
            "reach": extras["reach"], "reach_summary": reach_summary(extras["reach"])}
    try:
        write_text(path, json.dumps(data, indent=1, default=str))
    except OSError as e:
        return f"--mpt-kv-report {path}: the report could not be written: {e}"
    return None



def reach_summary(records: list[dict]) -> dict:
    """What the checks reached, per knob and check (mpt_kv.checks.reach.summarize): in the JSON report."""
    if not records:
        return {}

    return reach.summarize(records)


def cost_lines(results: list[dict]) -> list[str]:
    """What each check cost this run (cases, seconds of their call phase, share of the total), the
    dearest first: what a project weighs when it chooses which checks its CI runs."""
    timed = [r for r in results if "property" in r and isinstance(r.get("seconds"), (int, float))]
    if not timed:
        return []
    per: dict[str, list[float]] = {}
    for r in timed:
        per.setdefault(r["property"], []).append(r["seconds"])
    total = sum(sum(v) for v in per.values()) or 1.0
    width = max(len(p) for p in per)
    lines = [f"{'check':<{width}}  {'cases':>5}  {'seconds':>8}  {'share':>5}"]
    for prop, secs in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{prop:<{width}}  {len(secs):>5}  {sum(secs):>8.1f}  {sum(secs) / total:>5.0%}")
    lines.append(f"{'all':<{width}}  {len(timed):>5}  {total:>8.1f}  (the call phase of each case; under -n the "
                 "workers' seconds add up)")
    return lines


def summary(tw, config, results: list[dict], extras: dict) -> None:
    """The matrix and the lines under it (unless --no-mpt-kv-matrix)."""
    if config.getoption("no_mpt_kv_matrix"):
        return
    results = with_versions([r for r in results if "property" in r])
    lines = matrix_lines(results, absent_devices(config, results), profiles.current())
    if lines:
        tw.write_sep("=", header())
    for line in lines + project_lines(extras, config):
        tw.write_line(line)
    cost = cost_lines(results)
    if cost:
        tw.write_sep("=", "mpt-kv cost per check")
        for line in cost:
            tw.write_line(line)
    if extras.get("reach"):

        tw.write_sep("=", "mpt-kv reach")
        try:
            lines = reach.report_lines(extras["reach"], reference_model(config))  # MPT's, then the families'
        except ValueError as e:  # a project's own check recording a malformed knob: say so, keep the summary
            lines = [f"reach: {e}"]
        for line in lines:
            tw.write_line(line)


def short_traceback_hint(terminalreporter, config) -> str | None:
    """For a run with failures: how to see one line per failure instead of every traceback."""
    n = sum(len(terminalreporter.stats.get(k, [])) for k in ("failed", "error"))
    if not n or config.getoption("tbstyle", "auto") in ("line", "no"):
        return None
    return f"{n} failures and errors above: --tb=line prints one line each (-q --tb=no -rf: only their list)"
