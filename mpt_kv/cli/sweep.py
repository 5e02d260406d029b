"""`python -m mpt_kv sweep SPEC [SPEC ...]`: the conformance run over published releases of
optimum-habana, transformers and/or llm-foundry, one environment per release, merged into one table
(release x check: property/path), with the first and last release of each finding.

SPEC: `optimum-habana==1.12.1`, `transformers==4.55.4`, or a range (`optimum-habana>=1.7,<=1.21.2`):
every release `pip index versions` lists in it (with --per-minor: the newest patch of each minor).

For each release:
  pins   optimum-habana X: the transformers its own metadata requires (Requires-Dist of its wheel,
         fetched with `pip download --no-deps`): the newest release in that range, or its lower
         bound where the range is open-ended (1.7.x asks for >=4.32.0: the version it was written
         for; the newest transformers came years later). transformers X: X. Always torch==2.13.0
         (the CPU build) and the test tools pinned by constraints/hpu.txt.
  env    <envs>/<package>-<version>/: a venv layered on one shared base venv (torch and the test
         tools, installed once) by a .pth file, mpt-kv from this checkout by another; reused while
         its lock.json (python, the requested pins, the base) matches, else rebuilt (both:
         `mpt_kv.releases`, which both sweeps use).
  run    `python -m mpt_kv run --target optimum-habana|transformers --only-targets` in that env,
         CI=true, with --dtype and -k as given, under the per-release time limit (--timeout:
         install and run together). The transformers target reorders a beam cache as that
         release's own beam search does (`mpt_kv.targets.hf_generation`); the table lists the route
         each release took, from its run's description of the target.

Stored ceilings: they are keyed by target version, so another release has no entry. The runs
start in the release's env folder, where no ini file names `mpt_kv_require_ceilings` and no
`mpt_kv_ceilings/` exists, and without $MPT_KV_CEILINGS_DIR: the memory cases check the
analytic properties only (retained bytes = the KV cache exactly, bounded decode transients, no
leak), which is what differs between releases. The gate's own runs are unchanged.

--repros: instead of the conformance run, the findings' standalone repros (`mpt_kv.findings.sweep`;
`mpt_kv.findings.repros`, written once into a temporary folder) in each release's env: the
transformers scripts in transformers releases, the optimum-habana ones in optimum-habana releases
(with the transformers that release pins), all of a release's scripts in one interpreter (runpy,
SystemExit caught; this checkout taken off its path: the scripts never see mpt_kv). The table:
finding x release, 1 (the bug holds) / 0 (fixed) / 2 (the experiment cannot run there: the
script's last line below the table), and each finding's first and last release where it holds
and the first tried release after that where it is fixed (repros.md and repros.json in --out).

A release whose pins cannot be read or whose install fails, times out or writes no report says
why in its row; the exit status is 1 if any release did (0 when every release ran, whatever the
checks found: the table is the result).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mpt_kv.checks import index
from mpt_kv.cli.run import BEAM_REORDER
from mpt_kv.errors import SweepError
from mpt_kv.outputs import clash_problem, dir_problem, mark_output, path_arg
from mpt_kv.releases import (PACKAGES, Release, Row, base_env, expand, last_line, made_line, over_releases,
                             published, release_env, run_env)

# the checks the table needs, without the long variants (max-seq-len-2048, long generations, ...)
DEFAULT_K = "not max-seq-len and not long-generation and not bucket-128 and not head-dim and not graphs"

ORDER = ["error", "failed", "XPASS", "xfail", "unsupported", "passed", "skipped"]  # a cell shows its worst

FINDINGS = ("error", "failed", "XPASS")


def parse_spec(text: str) -> tuple[str, SpecifierSet]:
    try:
        req = Requirement(text)
    except InvalidRequirement as e:  # argparse would say only "invalid parse_spec value"
        raise argparse.ArgumentTypeError(f"{text!r} is not a requirement ({str(e).splitlines()[0]}): give "
                                         f"{' or '.join(f'{p}==X' for p in PACKAGES)}, or a range (>=A,<=B)") from None
    if req.name not in PACKAGES:
        raise argparse.ArgumentTypeError(f"{text!r}: the sweep knows {', '.join(PACKAGES)}, not {req.name!r}")
    if not str(req.specifier):
        raise argparse.ArgumentTypeError(f"{text!r}: give a release or a range ({req.name}==X, {req.name}>=A,<=B)")
    return req.name, req.specifier


def run_release(release: Release, envs: Path, out: Path, base, timeout: float, run_args: list[str],
                listing=published) -> Row:
    start = time.monotonic()
    deadline = start + timeout
    row = Row(release, report=out / f"{release.slug}.json", log=out / f"{release.slug}.log")
    row.report.unlink(missing_ok=True)
    try:
        venv, row.pins = release_env(release, envs, base, deadline, listing)
    except SweepError as e:
        row.problem = f"install: {e}"
    except subprocess.TimeoutExpired as e:
        row.problem = f"install: timed out after {e.timeout:.0f} s"
    if row.problem is None:
        row.problem = run_conformance(release, venv, row, deadline, run_args)
    row.seconds = time.monotonic() - start
    return row


def run_conformance(release: Release, venv: Path, row: Row, deadline: float, run_args: list[str]) -> str | None:
    """The run in the release's env; None when it wrote its report, else why not."""
    cmd = [str(venv / "bin" / "python"), "-m", "mpt_kv", "run", "--target", PACKAGES[release.package],
           "--only-targets", "--report", str(row.report), "--no-mpt-kv-matrix", "-p", "mpt_kv.plugin",
           "-rfE", *run_args]
    # CI=true: the small derandomized hypothesis profile, the same cases in every release; not the caller's
    # ceilings folder (nor its pytest options, path or xdist worker: releases.run_env)
    env = run_env(CI="true")
    env.pop("MPT_KV_CEILINGS_DIR", None)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return "timed out before the run (the install used the whole --timeout)"
    with open(row.log, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=venv.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"run: timed out after {remaining:.0f} s (--timeout)"
    if not row.report.is_file():
        return f"run: exit {proc.returncode}, no report written: {last_line(row.log.read_text())}"
    return target_build_problem(row.log.read_text(), PACKAGES[release.package])


def target_build_problem(log_text: str, target: str) -> str | None:
    """Why the target did not build, from the run's first lines (then every case errors with it)."""
    built = re.search(rf"^target {re.escape(target)}\s+does not build on \w+: (.*)$", log_text, re.M)
    return f"the target does not build: {built.group(1)[:300]}" if built else None


def reorder_route_of(row: Row) -> str | None:
    """How the release's beam search reorders the cache, as its run described its target (the
    transformers target follows its release's own route: `mpt_kv.targets.hf_generation`)."""
    if row.log is None or not row.log.is_file():
        return None
    target = PACKAGES[row.release.package]
    found = re.search(rf"^target {re.escape(target)}\s+ok [^\n]*?; {BEAM_REORDER} (.*)$", row.log.read_text(), re.M)
    return found.group(1).strip() if found else None


def column_of(result: dict) -> str:
    """A result's column: its check id, memory configs folded into their path."""
    check = result.get("check") or "/".join(x for x in (result.get("property"), result.get("path")) if x)
    if result.get("property") == "memory":
        return "/".join(check.split("/")[:2])
    return check


def failure_lines(log_text: str) -> dict[str, str]:
    """nodeid -> the one-line message pytest's -rfE summary gives for it."""
    out = {}
    for line in log_text.splitlines():
        m = re.match(r"^(?:FAILED|ERROR) (\S+) - (.*)$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def one_line(message: str) -> str:
    """The finding's summary: the exception's message without its class path and case context."""
    message = re.sub(r"^[\w.]+(Error|Failure|Exception|Unavailable): ", "", message)
    message = re.sub(r" \[target=.*$", "", message)
    return message[:220] + ("..." if len(message) > 220 else "")


def cells_of(row: Row) -> dict[str, tuple[str, str]]:
    """column -> (worst outcome, summary of its first failing result)."""
    data = json.loads(row.report.read_text())
    messages = failure_lines(row.log.read_text()) if row.log and row.log.is_file() else {}
    cells: dict[str, tuple[str, str]] = {}
    for r in data.get("results", []):
        if "property" not in r:
            continue
        col, outcome = column_of(r), r.get("outcome", "error")
        outcome = outcome if outcome in ORDER else "error"
        summary = one_line(messages.get(r.get("nodeid", ""), "")) if outcome in FINDINGS else ""
        if outcome in FINDINGS and not summary:
            summary = f"{outcome}: see {row.log.name if row.log else 'the log'} ({r.get('nodeid', '?')})"
        prev = cells.get(col)
        if prev is None or ORDER.index(outcome) < ORDER.index(prev[0]):
            cells[col] = (outcome, summary)
    return cells


def column_order(col: str) -> tuple:
    """The index's order of properties (the conformance matrix's), then the path."""
    prop, _, path = col.partition("/")
    return (index.NAMES.index(prop) if prop in index.NAMES else len(index.NAMES), prop, path)


@dataclasses.dataclass
class Finding:
    ident: str
    column: str
    outcome: str
    summary: str
    releases: list[Release]


def signature(summary: str) -> str:
    """What makes two releases' failures one finding: the message with its numbers left out (the
    same bug names other sizes and shapes in another release's run)."""
    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", summary)


def finding_key(package: str, column: str, outcome: str, summary: str) -> tuple:
    return package, column, outcome, signature(summary)


def findings_of(rows: list[Row], cells: dict) -> list[Finding]:
    """A finding: a column with the same bad outcome and message; its releases in order (first and last)."""
    found: dict[tuple, Finding] = {}
    for row in rows:
        for col, (outcome, summary) in sorted(cells.get(row.release, {}).items(), key=lambda kv: column_order(kv[0])):
            if outcome not in FINDINGS:
                continue
            key = finding_key(row.release.package, col, outcome, summary)
            if key not in found:
                found[key] = Finding("", col, outcome, summary, [])
            found[key].releases.append(row.release)
    out = sorted(found.values(), key=lambda f: (f.releases[0], column_order(f.column)))
    for i, f in enumerate(out, 1):
        f.ident = f"F{i}"
    return out


WORD = {"passed": "pass", "failed": "FAIL", "error": "error", "XPASS": "XPASS", "xfail": "xfail",
        "unsupported": "unsupported", "skipped": "skipped"}


def table_lines(rows: list[Row]) -> list[str]:
    """The markdown table: one row per release, one column per check; then the findings."""
    rows = sorted(rows, key=lambda r: r.release)
    cells = {r.release: cells_of(r) for r in rows if r.problem is None}
    findings = findings_of(rows, cells)
    ident = {finding_key(f.releases[0].package, f.column, f.outcome, f.summary): f.ident for f in findings}
    columns = sorted({c for cs in cells.values() for c in cs}, key=column_order)
    lines = []
    for package in sorted({r.release.package for r in rows}):
        lines += [f"### {package} (target `{PACKAGES[package]}`)", "",
                  "| release | pins | " + " | ".join(columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for row in (r for r in rows if r.release.package == package):
            if row.problem is not None:
                lines.append(f"| {row.release.version} | {row.pins or '-'} | " + f"**not run**: {row.problem}".replace("|", "/")
                             + " |" * len(columns))
                continue
            cs = cells[row.release]
            out = []
            for col in columns:
                outcome, summary = cs.get(col, ("", ""))
                word = WORD.get(outcome, "-")
                if outcome in FINDINGS:
                    word += f" {ident[finding_key(package, col, outcome, summary)]}"
                out.append(word)
            lines.append(f"| {row.release.version} | {row.pins} | " + " | ".join(out) + " |")
        lines.append("")
        routes = [(row.release.version, reorder_route_of(row)) for row in rows if row.release.package == package]
        if any(route for _, route in routes):
            lines += [f"Beam search's cache reorder in each {package} release (read from the release's own "
                      "generation code; its ops checks reorder that way):", "", "| release | reorders with |",
                      "|---|---|"]
            lines += [f"| {version} | {route or '-'} |" for version, route in routes]
            lines.append("")
    if findings:
        lines += ["### Findings", "", "| id | check | outcome | first | last | releases | summary (first release) |",
                  "|---|---|---|---|---|---|---|"]
        for f in findings:
            lines.append(f"| {f.ident} | {f.column} | {f.outcome} | {f.releases[0]} | {f.releases[-1]} | "
                         f"{len(f.releases)} | {f.summary.replace('|', '/')} |")
        lines.append("")
    return lines


def default_envs() -> Path:
    return Path(os.environ.get("MPT_KV_SWEEP_ENVS") or Path.home() / ".cache" / "mpt-kv" / "sweep-envs")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="*", type=parse_spec, metavar="SPEC",
                   help="optimum-habana==X, transformers==X, or a range (optimum-habana>=1.7,<=1.21.2)")
    p.add_argument("--per-minor", action="store_true", help="in a range, only the newest patch of each minor")
    p.add_argument("-p", "--parallel", type=int, default=1, help="releases at once (at most the cores; default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per release, install and run (default 1800)")
    p.add_argument("--envs", type=path_arg, default=default_envs(),
                   help="the environments' cache (default $MPT_KV_SWEEP_ENVS or ~/.cache/mpt-kv/sweep-envs)")
    p.add_argument("--out", type=path_arg, default=Path("reports/sweep"), help="reports, logs and table.md (default reports/sweep)")
    p.add_argument("--dtype", action="append", choices=["fp32", "bf16"], help="dtypes to run (default fp32)")
    p.add_argument("-k", dest="keyword", default=None, help=f"pytest -k of the runs (default: {DEFAULT_K!r})")
    p.add_argument("--render", action="store_true",
                   help="run nothing: make the table again from --out's rows.json, reports and logs")
    p.add_argument("--repros", action="store_true",
                   help="run the findings' standalone repros in each release instead of the conformance run: "
                        "finding x release, 1 holds / 0 fixed / 2 cannot run (repros.md in --out)")
    args = p.parse_args(argv)
    if args.repros and (args.render or args.dtype or args.keyword is not None):
        given = [o for o, v in (("--render", args.render), ("--dtype", args.dtype), ("-k", args.keyword is not None))
                 if v]
        p.error(f"--repros runs the findings' repros, not the conformance cases: not with {', '.join(given)}")
    if args.keyword is None:
        args.keyword = DEFAULT_K
    if args.render:
        return render(args.out)
    if not args.specs:
        p.error("name the releases: optimum-habana==X, transformers==X or a range")
    cores = os.cpu_count() or 1
    if not 1 <= args.parallel <= cores:
        p.error(f"-p {args.parallel}: between 1 and the {cores} cores")
    if not math.isfinite(args.timeout) or args.timeout <= 0:  # nan <= 0 is False: nan would pass a bare <= 0
        p.error(f"--timeout {args.timeout}: give a positive number of seconds, a finite one")
    for option, folder, command in (("--out", args.out, "sweep"), ("--envs", args.envs, None)):  # before any work
        problem = dir_problem(folder, command)
        if problem:
            p.error(f"{option} {folder}: {problem}")
    problem = clash_problem([("--envs", args.envs), ("--out", args.out)])
    if problem:
        p.error(problem)
    releases = expand(args.specs, args.per_minor)
    if args.repros:
        args.envs.mkdir(parents=True, exist_ok=True)
        args.out.mkdir(parents=True, exist_ok=True)
        mark_output(args.out, "sweep")
        try:  # lazy: the repro sweep writes the repros here, with torch and transformers (the conformance
            # sweep runs everything in the releases' envs)
            from mpt_kv.findings.sweep import main_repros
        except ImportError as e:
            raise SystemExit(f"mpt-kv sweep --repros: writing the repros needs torch and transformers here: {e}")
        return main_repros(args, argv, releases)
    run_args = [f"--dtype={d}" for d in (args.dtype or ["fp32"])] + (["-k", args.keyword] if args.keyword else [])
    args.envs.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    mark_output(args.out, "sweep")
    started = time.monotonic()
    print(f"mpt-kv sweep: {len(releases)} releases, -p {args.parallel}, --timeout {args.timeout:.0f} s, "
          f"envs {args.envs}", flush=True)
    try:
        base = base_env(args.envs.resolve(), args.timeout)
    except SweepError as e:
        raise SystemExit(f"mpt-kv sweep: {e}")
    rows = over_releases(releases, args.parallel, lambda r: run_release(r, args.envs.resolve(), args.out.resolve(), base,
                                                                        args.timeout, run_args),
                         lambda row: row.problem or "ran")
    made = made_line(argv, started, args.parallel)
    (args.out / "rows.json").write_text(json.dumps({"made": made, "rows": [
        {"package": r.release.package, "version": str(r.release.version), "pins": r.pins, "problem": r.problem,
         "seconds": round(r.seconds, 1)} for r in rows]}, indent=1))
    return write_table(args.out, made, rows)


def write_table(out: Path, made: str, rows: list[Row]) -> int:
    lines = [made, "", *table_lines(rows)]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"table: {out / 'table.md'}")
    return 1 if any(r.problem for r in rows) else 0


ROW_FIELDS = ("package", "version", "pins", "problem", "seconds")  # what main writes of each row to rows.json


def render_error(message: str):
    """--render's input (--out's rows.json) missing or not a sweep's: a usage error (exit 2), one line."""
    print(f"mpt-kv sweep --render: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_rows(path: Path, data) -> None:
    """rows.json as main writes it: "made" and "rows", each row with ROW_FIELDS and a package the
    sweep knows; else one line naming the row and what it lacks (not a KeyError traceback)."""
    if not isinstance(data, dict) or "made" not in data or not isinstance(data.get("rows"), list):
        render_error(f"{path} has no 'made' and 'rows' list: not a sweep's rows.json")
    for i, r in enumerate(data["rows"]):
        missing = [k for k in ROW_FIELDS if not isinstance(r, dict) or k not in r]
        if missing:
            render_error(f"{path}: row {i} has no {', '.join(map(repr, missing))} (every row has {', '.join(ROW_FIELDS)})")
        if r["package"] not in PACKAGES:
            render_error(f"{path}: row {i} package {r['package']!r}: expected one of {', '.join(PACKAGES)}")


def render(out: Path) -> int:
    """The table again from a finished sweep's folder (rows.json, the reports and the logs)."""
    try:
        data = json.loads((out / "rows.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        render_error(f"cannot read {out / 'rows.json'}: {e}")
    check_rows(out / "rows.json", data)
    rows = []
    for r in data["rows"]:
        row = Row(Release(r["package"], Version(r["version"])), pins=r["pins"], problem=r["problem"],
                  seconds=r["seconds"])
        row.report, row.log = out / f"{row.release.slug}.json", out / f"{row.release.slug}.log"
        if row.problem is None and not row.report.is_file():
            row.problem = f"no report in {out}"
        if row.problem is None:
            row.problem = target_build_problem(row.log.read_text(), PACKAGES[row.release.package])
        rows.append(row)
    return write_table(out, data["made"], rows)
