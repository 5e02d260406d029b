"""Hypothesis profiles and the drawn shapes (mpt_kv/checks/strategies.py): derandomized in CI, a
failure prints its reproducer, the profile selection, and on HPU only bucketed shapes."""

from __future__ import annotations

import re

import pytest

from hypothesis import find, given, settings
from hypothesis import strategies as st

from mpt_kv.plugin import options
from mpt_kv.checks import profiles
from mpt_kv.checks.strategies import (HPU_HEAD_COUNTS, HPU_HEAD_DIM, HPU_LAYERS, HPU_MAX_SEQ_LEN, HPU_NEW_TOKENS,
                                      HPU_PROMPT_BUCKET, cases)

from plugin_testing import output, subprocess_runner

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env): pytest in a fresh subprocess (plugin_testing)."""
    return subprocess_runner(pytester, monkeypatch)


# --- hypothesis: derandomized in CI, and a failure prints its reproducer ----------------------
HYPOTHESIS_CASES = """
from hypothesis import given, settings, strategies as st

def test_ci_profile_is_loaded():
    assert settings.default.derandomize and settings.default.print_blob

@given(st.integers(0, 1000))
def test_fails_from_ten(x):
    assert x < 10
"""


def test_ci_failure_prints_a_reproducer(run):
    result = run(HYPOTHESIS_CASES, CI="true")
    result.assert_outcomes(passed=1, failed=1)
    text = output(result)
    assert "x=10" in text, text                                                 # the shrunk example
    assert re.search(r"@reproduce_failure\('[\d.]+', b'[^']+'\)", text), text  # print_blob=True


def test_ci_profile_draws_the_same_examples_every_run():
    def draws():
        seen = []

        @settings(settings.get_profile("ci"), database=None)
        @given(st.integers(0, 2**30))
        def record(x):
            seen.append(x)

        record()
        return seen

    first = draws()
    assert len(first) > 1 and first == draws(), "the ci profile drew different examples (not derandomized)"


@pytest.mark.parametrize("env,profile", [({"CI": "true"}, "ci"), ({"CI": "1"}, "ci"), ({"CI": "false"}, "dev"),
                                         ({}, "dev"), ({"CI": "true", "MPT_KV_HYPOTHESIS_PROFILE": "thorough"}, "thorough")])
def test_profile_selection(monkeypatch, env, profile):
    this_run = profiles.current()
    for var in ("CI", "MPT_KV_HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        assert profiles.load_profile() == profile
        assert profiles.current() == profile
        assert settings.default.derandomize == (profile == "ci")
        assert settings.default.print_blob
    finally:
        profiles.use_profile(this_run)  # this run's own profile back, and its draws


# every new shape compiles a graph on HPU: few shapes, the prompt padded to its bucket
HPU_SHAPES = {(batch, HPU_PROMPT_BUCKET, HPU_NEW_TOKENS, n_heads, HPU_HEAD_DIM, HPU_LAYERS)
              for batch in (1, 2) for n_heads in HPU_HEAD_COUNTS}


def graph_shape(case):
    c = case.cfg
    return case.batch, case.prompt_len, case.new_tokens, c.n_heads, c.head_dim, c.n_layers


@settings(max_examples=40, derandomize=True)
@given(cases("hpu"))
def test_hpu_strategy_draws_only_bucketed_shapes(case):
    assert graph_shape(case) in HPU_SHAPES, f"hpu drew {graph_shape(case)}, not one of {sorted(HPU_SHAPES)}"
    assert case.cfg.max_seq_len == HPU_MAX_SEQ_LEN


def test_cpu_strategy_draws_other_shapes():
    """The hpu restriction is not vacuous: cpu draws shapes outside it."""
    case = find(cases("cpu"), lambda c: graph_shape(c) not in HPU_SHAPES, settings=settings(derandomize=True))
    assert graph_shape(case) not in HPU_SHAPES


def test_dtype_choices_are_the_models_dtypes():
    from mpt_kv.model.config import DTYPES

    assert options.DTYPE_NAMES == tuple(sorted(DTYPES))
