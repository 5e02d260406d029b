"""The findings' standalone repros in published releases (`python -m mpt_kv sweep --repros SPEC ...`):
the repros (`mpt_kv.findings.repros`, written once into a temporary folder) in each release's env
(`mpt_kv.releases`, the conformance sweep's): the transformers scripts in transformers releases, the
optimum-habana ones in optimum-habana releases (with the transformers that release pins), the
llm-foundry ones in llm-foundry releases, all of a release's scripts in one interpreter
(`mpt_kv.findings.scripts.DRIVER`: runpy, SystemExit caught; this checkout taken off its path: the
scripts never see mpt_kv). The table: finding x release, 1 (the bug holds) / 0 (fixed) / 2 (the
experiment cannot run there: the script's last line below the table), and each finding's first and
last release where it holds and the first tried release after that where it is fixed (repros.md and
repros.json in --out).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from mpt_kv.errors import SweepError
from mpt_kv.findings import repros
from mpt_kv.findings.raw import raw_entries, target_of
from mpt_kv.versions import split_attention
from mpt_kv.findings.grouping import grouped
from mpt_kv.findings.scripts import DRIVER
from mpt_kv.releases import (SOURCE, Release, Row, base_env, last_line, made_line, over_releases, published,
                             release_env, run_env)


HOLDS, FIXED, CANNOT = 1, 0, 2


def ran(row: Row) -> str:
    """A release's line as it finishes: why it did not run, or what its scripts said."""
    counts = {c: sum(1 for code, _ in (row.repros or {}).values() if (code if code in (0, 1) else 2) == c)
              for c in (HOLDS, FIXED, CANNOT)}
    return row.problem or "ran: %d hold, %d fixed, %d cannot run" % tuple(counts.values())


def write_repro_scripts(folder: Path) -> dict[str, list[tuple[str, Path]]]:
    """The repros (`python -m mpt_kv findings --repro`) under folder: package -> [(slug, repro.py)]."""
    made, _ = repros.write(folder, grouped(raw_entries()))
    written: dict[str, list[tuple[str, Path]]] = {}
    for r in made:
        package = split_attention(target_of(r.entries[0])[0])[0]  # transformers[sdpa]'s scripts are transformers'
        written.setdefault(package, []).append((r.slug, folder / r.slug / "repro.py"))
    return written


def output_last_line(output: str) -> str:
    """A script's last line; where that only points at the traceback above ("see the error above",
    "the prefill above raised"), the exception's line with it."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    last = (lines or ["(no output)"])[-1]
    if "above" in last:
        raised = [ln for ln in lines[:-1] if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", ln)]
        if raised:
            last = f"{last.split(' (see')[0].split(': the')[0]}: {raised[-1]}"
    return re.sub(r" \(/[^)]*\)", "", last)[:200]  # no "(/the/env/.../__init__.py)": one note for every release


def note_id(n: int) -> str:
    """The n-th note's letters: a ... z, aa, ab, ..."""
    letters = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        letters = chr(ord("a") + r) + letters
    return letters


def run_repros(venv: Path, scripts: list[tuple[str, Path]], deadline: float) -> dict[str, tuple[int, str]]:
    """slug -> (exit status, last line) of the scripts, run in one interpreter of the release's env."""
    if not scripts:
        return {}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise SweepError("timed out before the repros (the install used the whole --timeout)")
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", DRIVER, str(SOURCE),
                              *(str(path) for _, path in scripts)], capture_output=True, text=True,
                             cwd=scripts[0][1].parent.parent, env=run_env(OMP_NUM_THREADS="1"), timeout=remaining)
    except subprocess.TimeoutExpired as e:
        raise SweepError(f"repros: timed out after {e.timeout:.0f} s (--timeout)") from e
    try:
        report = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SweepError(f"repros: the driver exited {out.returncode} without its report: "
                         f"{last_line(out.stderr or out.stdout)}") from None
    if report["mpt_kv_modules"]:
        raise SweepError(f"repros: the scripts imported {', '.join(report['mpt_kv_modules'])}")
    by_path = report["results"]
    return {slug: (by_path[str(path)]["code"], output_last_line(by_path[str(path)]["output"]))
            for slug, path in scripts}


def run_release_repros(release: Release, envs: Path, base, timeout: float,
                       scripts: dict[str, list[tuple[str, Path]]], listing=published) -> Row:
    """The release's env (built or reused, as the conformance sweep's), then its package's repros."""
    start = time.monotonic()
    deadline = start + timeout
    row = Row(release)
    try:
        venv, row.pins = release_env(release, envs, base, deadline, listing)
        row.repros = run_repros(venv, scripts.get(release.package, []), deadline)
    except SweepError as e:
        row.problem = str(e) if str(e).startswith("repros:") else f"install: {e}"
    except subprocess.TimeoutExpired as e:
        row.problem = f"install: timed out after {e.timeout:.0f} s"
    row.seconds = time.monotonic() - start
    return row


def holds_range(codes: list[tuple[Release, int]]) -> tuple[Release | None, Release | None, Release | None]:
    """(first, last) release where the bug holds (status 1) among releases in order, and the first
    release after the last that ran it without the bug (0: fixed there); None where there is none.
    A 2 (cannot run) is neither."""
    held = [r for r, code in codes if code == HOLDS]
    if not held:
        return None, None, None
    after = [r for r, code in codes if code == FIXED and r > held[-1]]
    return held[0], held[-1], (after[0] if after else None)


def repro_table_lines(rows: list[Row]) -> list[str]:
    """Per package: finding x release (1 holds, 0 fixed, 2 cannot run, with a note), then each
    finding's first and last release where it holds and the first fixed after it."""
    rows = sorted(rows, key=lambda r: r.release)
    lines = []
    for package in sorted({r.release.package for r in rows}):
        mine = [r for r in rows if r.release.package == package]
        ran = [r for r in mine if r.problem is None]
        slugs = list(dict.fromkeys(s for r in ran for s in r.repros))
        notes: dict[str, str] = {}  # a 2's last line -> its note's letter
        lines += [f"### {package}", "",
                  "| finding | " + " | ".join(str(r.release.version) for r in mine)
                  + " | holds first | holds last | fixed in |",
                  "|---|" + "---|" * (len(mine) + 3)]
        for slug in slugs:
            cells, codes = [], []
            for r in mine:
                if r.problem is not None or slug not in r.repros:
                    cells.append("-")
                    continue
                code, last = r.repros[slug]
                code = code if code in (HOLDS, FIXED) else CANNOT
                codes.append((r.release, code))
                if code == CANNOT:
                    letter = notes.setdefault(last, note_id(len(notes)))
                    cells.append(f"2{letter}")
                else:
                    cells.append(str(code))
            first, last, fixed = holds_range(codes)
            ends = [str(x.version) if x else "-" for x in (first, last, fixed)]
            lines.append(f"| {slug} | " + " | ".join(cells) + " | " + " | ".join(ends) + " |")
        lines.append("")
        if notes:
            lines += ["Cannot run (2), the script's last line:", ""]
            lines += [f"- 2{letter}: {text}" for text, letter in notes.items()]
            lines.append("")
        for r in mine:
            lines.append(f"- {r.release}: " + (f"**not run**: {r.problem}" if r.problem else f"{r.pins}")
                         + f" ({r.seconds:.0f} s)")
        lines.append("")
    return lines


def main_repros(args, argv: list[str], releases: list[Release]) -> int:
    """`python -m mpt_kv sweep --repros`: every release's env, its package's repros in it, the table
    (repros.md and repros.json in --out); exit 1 where a release did not run."""
    started = time.monotonic()
    print(f"mpt-kv sweep --repros: {len(releases)} releases, -p {args.parallel}, --timeout {args.timeout:.0f} s, "
          f"envs {args.envs}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mpt-kv-repros-") as folder:
        try:
            scripts = write_repro_scripts(Path(folder))
        except ImportError as e:
            raise SystemExit(f"mpt-kv sweep --repros: writing the repros needs torch and transformers here: {e}")
        try:
            base = base_env(args.envs.resolve(), args.timeout)
        except SweepError as e:
            raise SystemExit(f"mpt-kv sweep: {e}")
        rows = over_releases(releases, args.parallel,
                             lambda r: run_release_repros(r, args.envs.resolve(), base, args.timeout, scripts), ran)
    made = made_line(argv, started, args.parallel)
    (args.out / "repros.json").write_text(json.dumps({"made": made, "rows": [
        {"package": r.release.package, "version": str(r.release.version), "pins": r.pins, "problem": r.problem,
         "seconds": round(r.seconds, 1), "repros": r.repros} for r in sorted(rows, key=lambda r: r.release)]},
        indent=1))
    lines = [made, "", *repro_table_lines(rows)]
    (args.out / "repros.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"table: {args.out / 'repros.md'}")
    return 1 if any(r.problem for r in rows) else 0
