"""`python -m mpt_kv COMMAND ...` (also installed as `mpt-kv`).

  run         the conformance run on this machine's devices and targets, with its report
  memory      the analytic memory model (and the seed PR's table)
  bench       throughput and memory table per (batch, max input, max new) config
  killmatrix  run every known-bad variant against the properties; non-zero if one survives
  report      one conformance matrix from the JSON reports of several runs (environments)
  sweep       the conformance run (--repros: the findings' repros) under each release, one table
  findings    the family findings and their cost at real configs (docs/findings.md)
  reach       the ranges each check's cases reached (docs/reach.md)
  coverage    the lines and branches of the upstream attention and cache code a run executed (docs/reach.md)
  calibrate   the tolerances' calibration: run (cpu, cuda), report, quantized, compiled (docs/calibration.md)
  checks      the index of checks: the README's table, every check id
  devicecheck the device check: the seed table, the suite and graph capture on a GPU, one command
  gateprofile the per-PR gate profile: what it selects, --check (stale?), --update (recompute)
  gatebench   the gate profile's and the whole run's cost, paired with transformers' own MPT test file
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": "mpt_kv.cli.run",
    "memory": "mpt_kv.cli.memory",
    "bench": "mpt_kv.cli.bench",
    "killmatrix": "mpt_kv.cli.killmatrix",
    "report": "mpt_kv.cli.report",
    "sweep": "mpt_kv.cli.sweep",
    "findings": "mpt_kv.cli.findings",
    "reach": "mpt_kv.cli.reach",
    "coverage": "mpt_kv.cli.coverage",
    "calibrate": "mpt_kv.cli.calibrate",
    "checks": "mpt_kv.cli.checks",
    "devicecheck": "mpt_kv.cli.devicecheck",
    "gateprofile": "mpt_kv.cli.gateprofile",
    "gatebench": "mpt_kv.cli.gatebench",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}: expected one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


