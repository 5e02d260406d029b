"""`python -m mpt_kv gatebench`: what one target's gate profile and whole run cost, as whole processes,
paired with transformers' own MPT test file when a transformers test tree is given.

    python -m mpt_kv gatebench --target transformers --runs 3
    python -m mpt_kv gatebench --target transformers --transformers-tests ~/src/transformers --runs 5

Each command is a fresh pytest process (process start and imports included, as a CI job pays them):

  gate   pytest --pyargs mpt_kv.conformance --target T --only-targets --device cpu --mpt-kv-profile gate
  full   the same without the profile (the whole run: every check, both dtypes, T's families)
  peer   pytest tests/models/mpt/test_modeling_mpt.py, from the given transformers checkout (the
         tree is not ours to ship, and transformers' sdist has no tests/models): given only with
         --transformers-tests. It runs as its developers run it: without mpt-kv's plugin (installed in
         the same environment, it would load into their run) and with pytest-xdist loaded, if installed, but
         no workers (transformers' conftest.py registers an xdist hook: `-p no:xdist` stops its run)

After `--warmup` unrecorded rounds, `--runs` rounds run the commands in turn (gate, full, peer, gate,
...) so that a machine's drift reaches all of them; each figure is the median over the rounds: wall
seconds, CPU seconds (user + system of the process and its children) and the peak resident memory of
its largest process; the ratios are taken round by round (gate/peer, full/peer, gate/full), of wall and
of CPU seconds (on a machine shared with other work the CPU ratio is the steadier one), their median
printed, with the load average around each run. All under CI=true (the ci hypothesis profile, as a CI
job), HF_HUB_OFFLINE=1 (no command waits on the network: the peer's tests that need the Hub skip, as
nothing of mpt-kv's needs it) and one pytest process, with the commands' exit statuses and pytest's
summary line (passed, skipped, ...): a run that failed is reported, not timed as a pass.
Writes gatebench.json to --out. A benchmark, not a test: it never judges.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mpt_kv.outputs import clash_problem, dir_problem, path_arg

PEER_FILE = Path("tests") / "models" / "mpt" / "test_modeling_mpt.py"


def commands(target: str, tree: Path | None, python: str = sys.executable) -> dict[str, tuple[list[str], Path | None]]:
    """name -> (argv, working folder; None: the current one)."""
    base = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    conformance = [*base, "--pyargs", "mpt_kv.conformance", "--target", target, "--only-targets", "--device", "cpu",
                   "--no-mpt-kv-matrix"]
    out = {"gate": (conformance + ["--mpt-kv-profile", "gate"], None), "full": (conformance, None)}
    if tree is not None:
        out["peer"] = ([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:mpt_kv.plugin",
                        str(PEER_FILE)], tree)
    return out


def summary_line(output: str) -> str:
    """pytest's last line (`== 14 passed, 4 skipped in 9.1s ==`) without its rule and time; '' if none."""
    lines = [line.strip("= ") for line in output.splitlines() if line.startswith("=") or " passed" in line
             or " failed" in line or " error" in line]
    return re.sub(r" in [0-9.]+s( \([0-9:]+\))?$", "", lines[-1]) if lines else ""


def measure(argv: list[str], cwd: Path | None) -> dict:
    """One whole process: wall and CPU seconds, the peak RSS of its largest process (MiB), its exit status,
    pytest's summary line and the 1-minute load average before and after it."""
    env = {**os.environ, "CI": "true", "HF_HUB_OFFLINE": "1"}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        output.seek(0)
        text = output.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "peak_mib": round(usage.ru_maxrss / 1024, 1), "exit": proc.returncode, "summary": summary_line(text),
            "load": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def paired(cmds: dict[str, tuple[list[str], Path | None]], runs: int, warmup: int, progress=None) -> dict:
    """Every command `warmup` + `runs` times, in turn; {"runs": {name: [measure, ...]}, "medians": ...,
    "ratios": {"a/b": median of the round-by-round wall ratios}}."""
    recorded: dict[str, list[dict]] = {name: [] for name in cmds}
    for round_ in range(warmup + runs):
        for name, (argv, cwd) in cmds.items():
            m = measure(argv, cwd)
            if progress:
                progress(f"gatebench: {'warm-up' if round_ < warmup else f'run {round_ - warmup + 1}/{runs}'} {name}: "
                         f"{m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} s CPU, {m['peak_mib']:.0f} MiB, exit {m['exit']}, "
                         f"load {m['load'][0]:.1f}-{m['load'][1]:.1f} ({m['summary']})")
            if round_ >= warmup:
                recorded[name].append(m)
    medians = {name: {k: statistics.median(m[k] for m in ms) for k in ("wall_s", "cpu_s", "peak_mib")}
               for name, ms in recorded.items()}
    ratios = {}
    for a, b in (("gate", "peer"), ("full", "peer"), ("gate", "full")):
        if a in recorded and b in recorded:
            for key, suffix in (("wall_s", ""), ("cpu_s", " cpu")):
                pairs = [x[key] / y[key] for x, y in zip(recorded[a], recorded[b])]
                ratios[f"{a}/{b}{suffix}"] = {"median": round(statistics.median(pairs), 3),
                                              "min": round(min(pairs), 3), "max": round(max(pairs), 3)}
    return {"runs": recorded, "medians": medians, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpt_kv gatebench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="transformers", help="the target (default transformers)")
    parser.add_argument("--transformers-tests", metavar="DIR", type=path_arg, default=None,
                        help=f"a transformers checkout (or test tree) holding {PEER_FILE}: its file is timed beside")
    parser.add_argument("--runs", type=int, default=3, help="recorded rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded rounds first (default 1)")
    parser.add_argument("--skip-full", action="store_true", help="time the gate (and the peer) only")
    parser.add_argument("--out", type=path_arg, default=Path("gatebench"), help="folder for gatebench.json")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error(f"--runs {args.runs} --warmup {args.warmup}: give 1 or more runs and 0 or more warm-ups")
    tree = args.transformers_tests
    if tree is not None and not (tree / PEER_FILE).is_file():
        parser.error(f"--transformers-tests {tree}: no {PEER_FILE} there (give the root of a transformers checkout; "
                     "its sdist has no tests/models)")
    problem = dir_problem(str(args.out))
    if problem:
        parser.error(f"--out {args.out}: {problem}")
    problem = clash_problem([("--out", args.out)], [("--transformers-tests", tree)])
    if problem:
        parser.error(problem)
    from mpt_kv.plugin.parametrize import named_target_problem  # lazy: the targets import torch
    from mpt_kv.targets import resolve_target

    problem = named_target_problem(args.target, resolve_target)
    if problem:  # the runs would fail at once, each round: a usage error now
        parser.error(f"--target {args.target}: {problem}")
    cmds = commands(args.target, tree.resolve() if tree else None)
    if args.skip_full:
        del cmds["full"]
    result = paired(cmds, args.runs, args.warmup, progress=lambda s: print(s, file=sys.stderr, flush=True))
    result["commands"] = {name: {"argv": argv[1:], "cwd": str(cwd) if cwd else None} for name, (argv, cwd) in cmds.items()}
    for name, m in result["medians"].items():
        exits = sorted({r["exit"] for r in result["runs"][name]})
        summaries = sorted({r["summary"] for r in result["runs"][name]})
        loads = [x for r in result["runs"][name] for x in r["load"]]
        print(f"{name:5s} median {m['wall_s']:7.2f} s wall  {m['cpu_s']:7.2f} s CPU  {m['peak_mib']:7.0f} MiB peak"
              f"  exit {','.join(map(str, exits))}  load {min(loads):.1f}-{max(loads):.1f}  ({'; '.join(summaries)})")
    for pair, r in result["ratios"].items():
        kind = "CPU seconds" if pair.endswith(" cpu") else "wall"
        print(f"{pair.removesuffix(' cpu')}: median {r['median']:.2f} (min {r['min']:.2f}, max {r['max']:.2f}), "
              f"paired {kind} over {args.runs} rounds")
    if tree is None:
        print("peer: not measured (give --transformers-tests DIR, a transformers checkout)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gatebench.json").write_text(json.dumps(result, indent=1) + "\n")
    failed = [name for name, ms in result["runs"].items() if any(m["exit"] != 0 for m in ms)]
    if failed:
        print(f"a command did not pass: {', '.join(failed)} (its figures are of a failing run)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
