"""`python -m mpt_kv run`: the conformance run on this machine's devices and targets.

Prints what is here (devices, targets, versions), then runs the property tests on every
available device (or the ones asked for) and prints the conformance matrix; the matrix is
also written as JSON (default reports/conformance.json). Extra arguments go to pytest.

A device asked for with --device is required (absent: a usage error before any test; no case
of it passed: the run fails), and so is every available one by default. A --target that cannot
be imported or built is an error, not a skip (docs/gate.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from mpt_kv import devices
from mpt_kv.outputs import file_problem

# the conformance suite shipped in the package: properties, memory ceilings, static shapes
CONFORMANCE = "mpt_kv.conformance"
BEAM_REORDER = "beam search reorders with"  # the machine description's words, which the sweep reads


def describe_machine(targets: list[str], kinds: list[str]) -> list[str]:
    """What is here. Each target is built once on the first device kind of the run; a failure
    is shown with its reason (pytest then reports it per case), never raised from here."""
    import torch

    from mpt_kv.model.config import ModelConfig, random_state_dict  # lazy: torch and the models only where this command needs them
    from mpt_kv.targets import build, factory_error  # lazy: torch and the models only where this command needs them

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
    p.add_argument("--report", default="reports/conformance.json", help="JSON report path")
    args, extra = p.parse_known_args(argv)
    problem = file_problem(args.report)
    if problem:
        p.error(f"--report {args.report}: {problem}")
    # a user's target module is found where `python -m pytest` would find it: the current folder
    # (the installed `mpt-kv` script does not put it on sys.path by itself)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    kinds = args.device or devices.available_kinds()
    import pytest

    pytest_args = ["--pyargs", CONFORMANCE, "-q", "-rs", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:cacheprovider", "--mpt-kv-report", args.report,
                   *[f"--device={k}" for k in kinds], *[f"--target={t}" for t in args.target], *extra]
    print("pytest " + " ".join(pytest_args), flush=True)
    # the machine is described once pytest has parsed every argument (an unknown option such as
    # --frobnicate is its usage error at once, before any target is built)
    describe = DescribeMachine([*BUILTIN, *[t for t in args.target if t not in BUILTIN]], kinds)
    return int(pytest.main(pytest_args, plugins=[describe]))


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
