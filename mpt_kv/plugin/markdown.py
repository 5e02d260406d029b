"""A run as a short Markdown summary for a CI job summary or a pull-request comment
(`--mpt-kv-markdown FILE`, `python -m mpt_kv report ... --markdown FILE`): the verdict first, then
only the cells that broke or changed against a stored run (target, check, what broke, the command
that reruns it), the known failures as one collapsed line each, and the full matrix collapsed
below. A reviewer reads the top; the rest is one click away."""

from __future__ import annotations

import re

from mpt_kv import versions
from mpt_kv.checks import profiles
from mpt_kv.outputs import write_text
from mpt_kv.plugin.report import absent_devices, matrix_lines, with_versions
from mpt_kv.plugin.state import run_state

BROKE = ("failed", "error", "XPASS")  # the outcomes a reviewer must act on
MAX_ROWS = 50  # of the "what broke" table; the rest is counted
MESSAGE_CHARS = 300


def cell_text(text: str) -> str:
    """One line that a Markdown table cell holds: no newline, no bare |, no run-away length, no
    exception class path in front of the message."""
    text = re.sub(r"^(?:[\w.]+\.)?PropertyFailure: ", "", " ".join(str(text).split())).replace("|", "\\|")
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS - 3] + "..."


def case_id(r: dict) -> str:
    """The case's parameter id (`cpu-reference-fp32-P3/concat`), which `-k "[...]"` selects alone."""
    found = re.search(r"\[(.*)\]$", r.get("nodeid", ""))
    return found.group(1) if found else r.get("nodeid", "?")


def rerun_command(r: dict) -> str:
    target = r.get("target", "?")
    return (f"python -m pytest --pyargs mpt_kv.conformance --target {target} --only-targets "
            f"-k \"[{case_id(r)}]\"")


def upstream_link(text: str) -> str:
    """The upstream file:line a known failure's reason names, if any (`... modeling_mpt.py:103 ...`)."""
    found = re.search(r"[\w./-]+\.py:\d+(?:-\d+)?", text or "")
    return f" (`{found.group(0)}`)" if found else ""


def changed(results: list[dict], previous: list[dict] | None) -> list[tuple[dict, str]]:
    """(case, its outcome in the stored run) for every case whose outcome differs from it."""
    if not previous:
        return []
    before = {r.get("nodeid"): r.get("outcome") for r in previous if "property" in r}
    return [(r, before[r.get("nodeid")]) for r in results
            if r.get("nodeid") in before and before[r.get("nodeid")] != r.get("outcome")]


def judged_by(runs: dict[str, str] | None = None) -> str:
    """'Judged by mpt-kv 0.1.0.': this mpt-kv, whose rules gave the verdict; `runs` ({report: the
    mpt-kv version that wrote it}, for merged reports) named too where one differs from it."""
    mine = versions.mpt_kv()
    other = {name: v for name, v in (runs or {}).items() if v != mine}
    return f"Judged by mpt-kv {mine}." + (
        " The runs: " + ", ".join(f"{name} by mpt-kv {v}" for name, v in runs.items()) + "." if other else "")


def render(results: list[dict], verdict: list[str], absent: dict | None = None, profile: str | None = None,
           previous: list[dict] | None = None, runs: dict[str, str] | None = None) -> str:
    """The summary of a run's conformance records (`results` of the JSON report); `verdict`: the gate's
    reasons for failing it (empty: none); `previous`: a stored run's records to compare with; `runs`:
    for merged reports, the mpt-kv version of each (judged_by)."""
    cases = [r for r in results if "property" in r]
    counts: dict[str, int] = {}
    for r in cases:
        counts[r.get("outcome", "?")] = counts.get(r.get("outcome", "?"), 0) + 1
    broke = [r for r in cases if r.get("outcome") in BROKE]
    ok = not broke and not verdict
    out = [f"## mpt-kv: {'passed' if ok else 'FAILED'}", "",
           ", ".join(f"{n} {word}" for word, n in sorted(counts.items())) or "no conformance case ran", "",
           judged_by(runs), ""]
    out += [f"- **gate:** {cell_text(line)}" for line in verdict]
    if verdict:
        out.append("")
    moved = changed(cases, previous)
    rows = [(r, "") for r in broke] + [(r, was) for r, was in moved if r.get("outcome") not in BROKE]
    if rows:
        out += ["### What broke" + (" or changed" if moved else ""), "",
                "| target | check | device, dtype | outcome | what it says | rerun |", "|---|---|---|---|---|---|"]
        for r, was in rows[:MAX_ROWS]:
            outcome = r.get("outcome", "?") + (f" (was {was})" if was else "")
            out.append(f"| {cell_text(r.get('target', '?'))} | {cell_text(r.get('check') or r.get('property'))} | "
                       f"{r.get('device', '?')}, {r.get('dtype', '?')} | {outcome} | "
                       f"{cell_text(r.get('message') or '-')} | `{cell_text(rerun_command(r))}` |")
        if len(rows) > MAX_ROWS:
            out.append(f"\n... and {len(rows) - MAX_ROWS} more (the JSON report has every case)")
        out.append("")
    known = [r for r in cases if r.get("outcome") == "xfail"]
    if known:
        out += [f"<details><summary>{len(known)} known failures (strict xfails, each naming its finding)</summary>", ""]
        for r in known:
            message = r.get("message") or ""
            out.append(f"- {cell_text(r.get('target', '?'))} {cell_text(r.get('check') or r.get('property'))} "
                       f"({r.get('device', '?')}, {r.get('dtype', '?')}): {cell_text(message)}{upstream_link(message)}")
        out += ["", "</details>", ""]
    lines = matrix_lines(cases, absent or {}, profile)
    if lines:
        out += ["<details><summary>the full matrix</summary>", "", "```text", *lines, "```", "", "</details>", ""]
    return "\n".join(out)


def write(config, path, results: list[dict], verdict: list[str]) -> str | None:
    """The run's Markdown summary (`--mpt-kv-markdown FILE`); returns why it could not be written."""
    results = with_versions([r for r in results if "property" in r])
    try:
        write_text(path, render(results, verdict, absent_devices(config, results), profiles.current()))
    except OSError as e:
        return f"--mpt-kv-markdown {path}: the summary could not be written: {e}"
    return None
