"""`python -m mpt_kv run`: the conformance run on this machine's devices and targets.

Prints what is here (devices, targets, versions), then runs the property tests on every
available device (or the ones asked for) and prints the conformance matrix; the matrix is
also written as JSON (default reports/conformance.json). Extra arguments go to pytest.

A device asked for with --device is required (absent: a usage error before any test; no case
of it passed: the run fails), and so is every available one by default. A --target that cannot
be imported or built is an error, not a skip (docs/gate.md).

--coverage OUT measures the run with coverage.py (its xdist workers too) and writes OUT, the summary of
which lines and branches of the upstream attention and cache functions of the implementations it ran
were executed, with the reason for each function never entered (`python -m mpt_kv coverage OUT` prints
its tables; docs/reach.md), and beside it the run's coverage.py data (OUT with .coverage for .json).
Both are removed first: a run that ends early leaves neither.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from mpt_kv import devices
from mpt_kv.outputs import clash_problem, file_problem, path_arg

# the conformance suite shipped in the package: properties, memory ceilings, static shapes
CONFORMANCE = "mpt_kv.conformance"
BEAM_REORDER = "beam search reorders with"  # the machine description's words, which the sweep reads


def describe_machine(targets: list[str], kinds: list[str]) -> list[str]:
    """What is here. Each target is built once on the first device kind of the run; a failure
    is shown with its reason (pytest then reports it per case), never raised from here."""
    import torch

    from mpt_kv.model.config import ModelConfig, random_state_dict  # lazy: torch and the models only where this command needs them
    from mpt_kv.targets import build, factory_error, is_family_declaration, resolve_target  # lazy: torch and the models only where this command needs them

    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    for kind in devices.KINDS:
        reason = devices.unavailable_reason(kind)
        lines.append(f"device {kind:<5} {'available' if reason is None else 'unavailable: ' + reason}")
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
    kind = next((k for k in kinds if devices.unavailable_reason(k) is None), None)
    for spec in targets:
        if kind is None:
            lines.append(f"target {spec:<15} not built: none of the devices asked for is here")
            continue
        try:
            declared = resolve_target(spec) if ":" in spec else None
            if is_family_declaration(declared):  # a model of another family: its cases are the family checks'
                lines.append(f"target {spec:<15} family target: {', '.join(t.name for t in declared.targets())}")
                continue
            runner = build(spec, cfg, random_state_dict(cfg), devices.torch_device(kind), torch.float32)
            version = getattr(runner, "version", "")
            line = f"target {spec:<15} ok {version}".rstrip()
            try:  # a transformers-style runner follows its release's beam-search reorder: which one
                reorder = getattr(runner, "beam_reorder", None)
            except Exception as e:  # noqa: BLE001  an unknown release's route: its ops cases say so
                reorder = f"unknown ({type(e).__name__}: {e})"
            lines.append(line + (f"; {BEAM_REORDER} {reorder}" if reorder else ""))
        except Exception as e:  # a user's factory can raise anything: report it, do not crash here
            e = factory_error(e)  # the factory's own error (sweep parses this line)
            lines.append(f"target {spec:<15} does not build on {kind}: {type(e).__name__}: {e}")
    return lines


def main(argv: list[str]) -> int:
    from mpt_kv.targets import BUILTIN  # lazy: torch and the models only where this command needs them

    p = argparse.ArgumentParser(prog="python -m mpt_kv run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", action="append", choices=devices.KINDS,
                   help="device kinds to run, each required (default: every available one)")
    p.add_argument("--target", action="append", default=[], help="extra target package.module:factory")
    p.add_argument("--report", type=path_arg, default="reports/conformance.json", help="JSON report path")
    p.add_argument("--coverage", type=path_arg, metavar="OUT",
                   help="measure the upstream attention and cache code the run executes (coverage.py): its summary")
    args, extra = p.parse_known_args(argv)
    for option, path in (("--report", args.report), ("--coverage", args.coverage)):
        problem = file_problem(path) if path is not None else None
        if problem:
            p.error(f"{option} {path}: {problem}")
    problem = clash_problem([("--report", args.report), ("--coverage", args.coverage)])
    if problem:
        p.error(problem)
    measurement = None
    if args.coverage is not None:
        try:
            from mpt_kv.upstream.measure import Measurement, data_path
            measurement = Measurement()
        except ImportError as e:
            p.error(f"--coverage needs coverage.py ({e}; pip install coverage, a dev dependency of mpt-kv)")
        for path in (args.coverage, data_path(args.coverage)):  # no summary of an earlier run stands in for this one's
            path.unlink(missing_ok=True)
    # a user's target module is found where `python -m pytest` would find it: the current folder
    # (the installed `mpt-kv` script does not put it on sys.path by itself)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    kinds = args.device or devices.available_kinds()
    import pytest

    pytest_args = ["--pyargs", CONFORMANCE, "-q", "-rs", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:cacheprovider", "--mpt-kv-report", str(args.report),
                   *[f"--device={k}" for k in kinds], *[f"--target={t}" for t in args.target], *extra]
    print("pytest " + " ".join(pytest_args), flush=True)
    # the machine is described once pytest has parsed every argument (an unknown option such as
    # --frobnicate is its usage error at once, before any target is built)
    describe = DescribeMachine([*BUILTIN, *[t for t in args.target if t not in BUILTIN]], kinds)
    if measurement is None:
        return int(pytest.main(pytest_args, plugins=[describe]))
    measurement.start()
    try:
        code = int(pytest.main(pytest_args, plugins=[describe]))
    finally:
        measurement.stop()
    try:
        write_coverage(measurement, Path(args.report), args.coverage)
    finally:
        measurement.close()
    return code


def write_coverage(measurement, report: Path, out: Path) -> None:
    """The run's coverage summary, for the implementations its report says it ran (none if it wrote no report),
    and beside it the run's coverage.py data."""
    from mpt_kv.upstream import measure, tables

    implementations, profile = measure.what_ran(report, since=measurement.started)
    summary = measure.summarize(measurement.coverage, implementations, profile)
    out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    measurement.keep(measure.data_path(out))
    print("\n".join(["", f"upstream attention and cache code executed (python -m mpt_kv coverage {out}: every file and "
                          f"function):", *tables.group_lines([summary])]), flush=True)


class DescribeMachine:
    """A pytest plugin that prints `describe_machine` at the start of the session."""

    def __init__(self, targets: list[str], kinds: list[str]):
        self.targets, self.kinds = targets, kinds

    def pytest_sessionstart(self, session) -> None:
        terminal = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in describe_machine(self.targets, self.kinds):
            if terminal is not None:
                terminal.write_line(line)
            else:
                print(line, flush=True)
