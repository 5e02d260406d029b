"""What each check cost a run (issue: a project chooses its checks by their cost): the plugin
records each case's seconds in the JSON report and prints one table per run, the dearest first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from mpt_kv.plugin.report import cost_lines
from plugin_testing import HANG_S


def test_cost_lines_sum_cases_and_seconds_per_check_dearest_first():
    results = [{"property": "P1", "seconds": 2.0}, {"property": "P1", "seconds": 1.0},
               {"property": "memory", "seconds": 5.0}, {"property": "P0", "seconds": 1.0},
               {"nodeid": "tests/test_x.py::test_own"}]  # not a conformance case: not counted
    head, memory, p1, p0, total = cost_lines(results)
    assert head.split() == ["check", "cases", "seconds", "share"]
    assert memory.split() == ["memory", "1", "5.0", "56%"]
    assert p1.split() == ["P1", "2", "3.0", "33%"]
    assert p0.split() == ["P0", "1", "1.0", "11%"]
    assert total.split()[:3] == ["all", "4", "9.0"]
    assert cost_lines([{"property": "P1"}]) == []  # a report from before the seconds were recorded


def test_a_run_records_each_cases_seconds_and_prints_the_cost(tmp_path):
    """One drawn P0 case and one P1 case (cost_lines' sums are the test above's)."""
    report = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPT_KV_", "PYTEST_")) and k != "CI"}
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance", "--target", "reference",
                          "--only-targets", "-m", "cpu", "-k", "fp32 and (P0 or P1/static) and not P0/ and not P1/static/ "
                          "and not bucket and not ops-", "-q", "-p", "no:cacheprovider", "--mpt-kv-report", str(report)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S,
                         env={**env, "MPT_KV_HYPOTHESIS_PROFILE": "ci"})
    assert "mpt-kv cost per check" in run.stdout, run.stdout[-3000:]
    cases = json.loads(report.read_text())["results"]
    assert [r["check"] for r in cases] == ["P0", "P1/static"], cases
    assert all(r["outcome"] == "passed" and r["seconds"] > 0 for r in cases), cases
    (table,) = [line.split() for line in run.stdout.splitlines() if line.startswith("all ")]
    assert table[:2] == ["all", "2"], run.stdout[-3000:]
