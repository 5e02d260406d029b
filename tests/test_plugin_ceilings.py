"""Stored memory ceilings in the plugin (mpt_kv/plugin/ceilings.py, docs/gate.md rows 20, 22, 32):
--update-ceilings is refused under CI, a version without stored ceilings says in one line how to
record them, and an analytic failure is never offered for recording."""

from __future__ import annotations

import pytest

from mpt_kv.plugin import gate
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin import ceilings as plugin_ceilings

from plugin_testing import FakeConfig, ROOT


# --- 5. baselines ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_update_ceilings_is_refused_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.UsageError, match="--update-ceilings is refused under CI: recording a baseline is a "
                                                "local step whose diff a reviewer reads"):
        gate.configure(FakeConfig(update_ceilings=True))
    monkeypatch.setenv("CI", "false")
    gate.configure(FakeConfig(update_ceilings=True))


def missing_measurement(**more) -> dict:
    """A memory measurement of a transformers version that has no stored ceilings."""
    from mpt_kv.checks import stored_ceilings as S

    baseline = S.baseline_path("cpu", ROOT / "mpt_kv_ceilings")
    stored = next(iter(S.load_baseline(baseline, "cpu")))
    target, path, dtype, config, shape = stored.split("|")
    return {"target": "transformers", "target_version": "transformers 5.99", "device": "cpu", "dtype": dtype,
            "path": "concat", "bucket": None, "batch": 16, "max_input": 8, "max_new": 8, "problems": 0,
            "cfg": dict(zip(("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"),
                            (int(x[1:]) for x in shape.split("-")))), **more}


def test_a_version_without_stored_ceilings_says_in_one_line_how_to_record_it():
    """A required target's missing entry is a BaselineError ("error"): the line gives the command."""
    from mpt_kv.checks import stored_ceilings as S

    m = missing_measurement(outcome="error")
    config = FakeConfig()
    run_state(config).memory[:] = [m, {**m, "max_new": 24}, {**m, "outcome": "passed"}]
    lines = plugin_ceilings.failure_lines(config)
    assert lines == [f"memory ceilings: none stored for transformers (transformers 5.99) on cpu (2 cases failed for "
                     f"that alone): record them locally, not under CI, with `python -m pytest --pyargs "
                     f"mpt_kv.conformance -k memory --update-ceilings`, review the diff and commit "
                     f"{S.baseline_path('cpu', ROOT / 'mpt_kv_ceilings')}"]


def test_an_analytic_memory_failure_is_never_offered_for_recording():
    """A PropertyFailure of the analytic check (problems recorded) is a bug: the summary says so
    first, and recording it as the baseline is not offered, not even next to a missing entry."""
    bug = missing_measurement(outcome="failed", problems=2)
    config = FakeConfig()
    run_state(config).memory[:] = [bug, {**bug, "max_new": 24}, missing_measurement(outcome="error", max_new=40)]
    lines = plugin_ceilings.failure_lines(config)
    assert lines[0] == ("memory: transformers (transformers 5.99) on cpu: 2 cases failed the analytic memory check "
                        "(the bytes it retains or allocates are not what its KV cache needs: see each failure above); "
                        "that is a bug to fix in the target, not a baseline to record")
    assert len(lines) == 2 and "(1 cases failed for that alone)" in lines[1]
