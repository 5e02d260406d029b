"""The suite gates merges: it must never pass by accident.

Each gate case runs a small pytest session in a subprocess (pytester), so its exit status,
its hypothesis profile and its environment are its own. The device gate is exercised on this
CPU-only machine two ways: an absent required device (hpu) must stop the run, and a required
device that is present (cpu) must still fail the run when none of its cases passed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from mpt_kv import devices, plugin
from mpt_kv.checks import strategies
from mpt_kv.checks.strategies import HPU_NEW_TOKENS, HPU_PROMPT_BUCKET, cases

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
BASE = ("-p", "mpt_kv.plugin", "-p", "no:cacheprovider")

ONE_CASE_PER_DEVICE = """
def test_case(device):
    assert device.type in ("cpu", "cuda", "hpu")
"""
EVERY_CASE_SKIPS = """
import pytest

def test_case(device):
    pytest.skip("skipped on purpose")
"""


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, **env) -> RunResult of `pytest -p mpt_kv.plugin` in a fresh subprocess."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "MPT_KV_HYPOTHESIS_PROFILE", "PYTEST_XDIST_WORKER",
                "PYTEST_ADDOPTS", "HABANA_VISIBLE_MODULES"):
        monkeypatch.delenv(var, raising=False)

    def _run(source, *args, **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pytester.makepyfile(test_gated=source)
        return pytester.runpytest_subprocess(*BASE, *args)

    return _run


def output(result) -> str:
    return "\n".join(result.outlines + result.errlines)


# --- the device gate --------------------------------------------------------------------------
class FakeConfig:
    def __init__(self, option):
        self.option = option

    def getoption(self, name):
        assert name == "require_device"
        return self.option


@pytest.mark.parametrize("option,env,required", [
    ([], "", []), (["hpu"], "", ["hpu"]), ([], "hpu", ["hpu"]), (["cpu"], "hpu, cuda", ["cpu", "cuda", "hpu"])])
def test_required_devices_from_option_and_env(monkeypatch, option, env, required):
    monkeypatch.setenv("MPT_KV_REQUIRE_DEVICE", env)
    assert plugin.required_devices(FakeConfig(option)) == required


def test_required_devices_env_typo_is_an_error(monkeypatch):
    monkeypatch.setenv("MPT_KV_REQUIRE_DEVICE", "gpu")
    with pytest.raises(pytest.UsageError, match=r"MPT_KV_REQUIRE_DEVICE='gpu': unknown kind \['gpu'\]"):
        plugin.required_devices(FakeConfig([]))


@pytest.mark.skipif(devices.unavailable_reason("hpu") is None, reason="this machine has an HPU: the gate would pass")
@pytest.mark.parametrize("how", ["option", "env"])
def test_required_hpu_absent_stops_the_run(run, how):
    if how == "option":
        result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", "--require-device", "hpu")
    else:
        result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", MPT_KV_REQUIRE_DEVICE="hpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "--require-device hpu: hpu is not available here" in output(result)
    assert "This runner cannot gate hpu changes" in output(result)
    assert "test_case" not in output(result), "no case may run once the gate refused"


def test_marker_selects_hpu_cases(run):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK, output(result)
    assert "test_gated.py::test_case[hpu]" in result.outlines
    assert not any(re.search(r"\[(cpu|cuda)\]", line) for line in result.outlines), output(result)


@pytest.mark.parametrize("args,source,ran", [
    pytest.param(("-k", "no_such_case"), ONE_CASE_PER_DEVICE, 0, id="selects-nothing"),
    pytest.param(("--device", "cpu"), EVERY_CASE_SKIPS, 1, id="every-case-skipped"),
])
def test_required_device_that_ran_nothing_fails(run, args, source, ran):
    """cpu is present, so only the end-of-run gate can catch this: nothing of it passed."""
    result = run(source, "--require-device", "cpu", *args)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
    assert f"--require-device cpu: no cpu case passed ({ran} cpu cases reported)" in output(result)


def test_required_device_that_passed_is_green(run):
    result = run(ONE_CASE_PER_DEVICE, "-v", MPT_KV_REQUIRE_DEVICE="cpu")  # absent kinds skip alongside
    assert result.ret == pytest.ExitCode.OK, output(result)
    result.stdout.fnmatch_lines(["*test_gated.py::test_case?cpu? PASSED*"])
    assert "device gate" not in output(result)


# --- the gate under pytest-xdist: the controller decides from the workers' reports -----------
@pytest.mark.parametrize("source,ret", [(ONE_CASE_PER_DEVICE, pytest.ExitCode.OK),
                                        (EVERY_CASE_SKIPS, pytest.ExitCode.TESTS_FAILED)],
                         ids=["passes", "every-case-skipped"])
def test_gate_under_xdist(run, source, ret):
    result = run(source, "-n", "2", "--require-device", "cpu")
    assert result.ret == ret, output(result)
    assert ("no cpu case passed" in output(result)) == (ret != pytest.ExitCode.OK), output(result)


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
def test_profile_selection(monkeypatch, request, env, profile):
    for var in ("CI", "MPT_KV_HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        assert strategies.load_profile() == profile
        assert settings.default.derandomize == (profile == "ci")
        assert settings.default.print_blob
    finally:
        settings.load_profile(request.config._mpt_kv_profile)  # this run's own profile back


# every new shape compiles a graph on HPU: few shapes, the prompt padded to its bucket
HPU_SHAPES = {(batch, HPU_PROMPT_BUCKET, HPU_NEW_TOKENS, n_heads, 8, 2) for batch in (1, 2) for n_heads in (2, 3)}


def graph_shape(case):
    c = case.cfg
    return case.batch, case.prompt_len, case.new_tokens, c.n_heads, c.head_dim, c.n_layers


@settings(max_examples=40, derandomize=True)
@given(cases("hpu"))
def test_hpu_strategy_draws_only_bucketed_shapes(case):
    assert graph_shape(case) in HPU_SHAPES, f"hpu drew {graph_shape(case)}, not one of {sorted(HPU_SHAPES)}"
    assert case.cfg.max_seq_len == 32


def test_cpu_strategy_draws_other_shapes():
    """The hpu restriction is not vacuous: cpu draws shapes outside it."""
    case = find(cases("cpu"), lambda c: graph_shape(c) not in HPU_SHAPES, settings=settings(derandomize=True))
    assert graph_shape(case) not in HPU_SHAPES


# --- one card per xdist worker -----------------------------------------------------------------
@pytest.mark.parametrize("worker,card", [("gw0", "0"), ("gw1", "1"), ("gw7", "7"), ("gw12", "12")])
def test_each_xdist_worker_gets_its_own_hpu_card(monkeypatch, worker, card):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    devices.pin_worker_to_card()
    assert devices.worker_index() == int(card)
    assert devices.os.environ["HABANA_VISIBLE_MODULES"] == card


def test_explicit_card_choice_is_kept(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "5")
    devices.pin_worker_to_card()
    assert devices.os.environ["HABANA_VISIBLE_MODULES"] == "5"


def test_no_pinning_outside_xdist(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    devices.pin_worker_to_card()
    assert "HABANA_VISIBLE_MODULES" not in devices.os.environ
    assert devices.worker_index() == 0


@pytest.mark.parametrize("worker,n_cards,index", [("gw0", 2, 0), ("gw1", 2, 1), ("gw2", 2, 0), ("gw5", 4, 1)])
def test_each_xdist_worker_gets_its_own_cuda_card(monkeypatch, worker, n_cards, index):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setattr(devices, "_probe", lambda kind: None)  # pretend the GPUs are there
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: n_cards)
    assert devices.torch_device("cuda") == devices.torch.device("cuda", index)
