"""`python -m mpt_kv run`: the conformance run on this machine's devices and targets.

Prints what is here (devices, targets, versions), then runs the property tests on every
available device (or the ones asked for) and prints the conformance matrix; the matrix is
also written as JSON (default reports/conformance.json). Extra arguments go to pytest.
"""

from __future__ import annotations

import argparse
import platform

import pytest
import torch

from mpt_kv import devices
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.errors import TargetUnavailable
from mpt_kv.targets import BUILTIN, build

# the conformance suite shipped in the package: properties, memory ceilings, static shapes
CONFORMANCE = "mpt_kv.conformance"


def describe_machine(targets: list[str]) -> list[str]:
    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    for kind in devices.KINDS:
        reason = devices.unavailable_reason(kind)
        lines.append(f"device {kind:<5} {'available' if reason is None else 'unavailable: ' + reason}")
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
    for spec in targets:
        try:
            runner = build(spec, cfg, random_state_dict(cfg), torch.device("cpu"), torch.float32)
            version = getattr(runner, "version", "")
            lines.append(f"target {spec:<15} ok {version}".rstrip())
        except TargetUnavailable as e:
            lines.append(f"target {spec:<15} skipped: {e}")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv run", description=__doc__)
    p.add_argument("--device", action="append", choices=devices.KINDS,
                   help="device kinds to run (default: every available one)")
    p.add_argument("--target", action="append", default=[], help="extra target package.module:factory")
    p.add_argument("--report", default="reports/conformance.json", help="JSON report path")
    args, extra = p.parse_known_args(argv)
    print("\n".join(describe_machine([*BUILTIN, *args.target])))
    kinds = args.device or devices.available_kinds()
    pytest_args = ["--pyargs", CONFORMANCE, "-q", "-rs", "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:cacheprovider", "--mpt-kv-report", args.report,
                   *[f"--device={k}" for k in kinds], *[f"--target={t}" for t in args.target], *extra]
    print("pytest " + " ".join(pytest_args), flush=True)
    return int(pytest.main(pytest_args))
