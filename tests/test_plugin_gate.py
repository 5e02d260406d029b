"""The device gate (mpt_kv/plugin/gate.py; docs/gate.md rows 1-4, 10, 11, 24, 33): selecting a
device kind requires it (marker expressions read with pytest's own parser, --device,
--require-device), a required kind that is absent stops the run before any test, and a run in
which no case of a required kind passed fails. Subprocess runs where the exit status is the point
(tests/plugin_testing.py); the rest are plain function tests of the gate's pieces."""

from __future__ import annotations

import os
import re
import sys

import pytest

from mpt_kv import devices
from mpt_kv.plugin import gate, outcomes
from mpt_kv.plugin.state import run_state

from plugin_testing import EVERY_CASE_SKIPS, FakeConfig, ONE_CASE_PER_DEVICE, output, ROOT, subprocess_runner, HANG_S

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env): pytest in a fresh subprocess (plugin_testing)."""
    return subprocess_runner(pytester, monkeypatch)


# --- 1. selecting a device requires it ------------------------------------------------------------------------------

@pytest.mark.parametrize("option,env,required", [
    ([], "", []), (["hpu"], "", ["hpu"]), ([], "hpu", ["hpu"]), (["cpu"], "hpu, cuda", ["cpu", "cuda", "hpu"])])
def test_required_devices_from_option_and_env(monkeypatch, option, env, required):
    monkeypatch.setenv("MPT_KV_REQUIRE_DEVICE", env)
    assert gate.required_devices(FakeConfig(require_device=option)) == required


def test_required_devices_env_typo_is_an_error(monkeypatch):
    monkeypatch.setenv("MPT_KV_REQUIRE_DEVICE", "gpu")
    with pytest.raises(pytest.UsageError, match=r"MPT_KV_REQUIRE_DEVICE='gpu': unknown kind \['gpu'\]"):
        gate.required_devices(FakeConfig())


@pytest.mark.parametrize("expr,required", [
    ("hpu", ["hpu"]), ("hpu and not slow", ["hpu"]), ("not slow and hpu", ["hpu"]), ("(hpu or cuda) and hpu", ["hpu"]),
    ("hpu and cuda", ["cuda", "hpu"]), ("not (not hpu)", ["hpu"]), ("hpu(card=1)", ["hpu"]),
    ("not hpu", []), ("hpu or cpu", []), ("slow", []), ("", []), ("hpu and", []),  # the last: pytest reports it
])
def test_a_marker_expression_requires_the_kinds_it_cannot_select_without(expr, required):
    assert gate.kinds_required_by_markexpr(expr) == required


@pytest.mark.parametrize("expr,selectable", [
    ("hpu", ["hpu"]), ("not hpu", ["cpu", "cuda"]), ("not hpu and not cuda", ["cpu"]), ("slow", ["cpu", "cuda", "hpu"]),
    ("", ["cpu", "cuda", "hpu"]), ("hpu and cuda", [])])  # a case has one device marker
def test_kinds_a_marker_expression_can_select(expr, selectable):
    """Only these need cards under xdist: `-m 'not hpu' -n 16` on an 8-card Gaudi machine is fine."""
    assert gate.kinds_selectable_by_markexpr(expr) == selectable


def test_selection_implies_requirement_unless_allowed_missing(monkeypatch):
    monkeypatch.delenv("MPT_KV_REQUIRE_DEVICE", raising=False)
    config = FakeConfig(markexpr="hpu and not slow", device=["cuda"], require_device=["cpu"])
    assert gate.device_requirements(config) == {
        "cpu": "--require-device cpu", "cuda": "--device cuda", "hpu": "-m 'hpu and not slow' selects hpu cases"}
    config.options["allow_missing_device"] = True  # the opt-out drops what selection implied, never --require-device
    assert gate.device_requirements(config) == {"cpu": "--require-device cpu"}


@pytest.mark.skipif(devices.unavailable_reason("cuda") is None, reason="this machine has a GPU: the gate would pass")
@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["single", "xdist"])
def test_pytest_m_cuda_without_a_gpu_is_one_clear_usage_error(run, xdist):
    """`tox -e cuda`'s command on a machine without a GPU: exit 4 in one line, as `-m hpu` is."""
    result = run(ONE_CASE_PER_DEVICE, "-m", "cuda", *xdist)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    errors = [line for line in result.errlines if line.startswith("ERROR:")]
    assert len(errors) == 1 and errors[0].startswith("ERROR: -m 'cuda' selects cuda cases, but cuda is not available "
                                                     "here: "), output(result)
    assert "This runner cannot gate cuda changes" in errors[0]
    assert "test_add" not in output(result), "no case may run once the gate refused"


@pytest.mark.parametrize("mode,passed", [("cpu", True), ("broken", False)])
def test_pytest_m_cuda_on_a_gpu_runs_exactly_its_cases(run, mode, passed):
    """The same command on a (simulated: tests/fakes/cuda) GPU runs the cuda cases only; a GPU that fails
    every op fails them and the gate."""
    result = run(ONE_CASE_PER_DEVICE, "-m", "cuda", fakes=["cuda"], MPT_KV_FAKE_CUDA=mode)
    if passed:
        assert result.ret == pytest.ExitCode.OK, output(result)
        result.assert_outcomes(passed=2, deselected=2)
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
        result.assert_outcomes(failed=2, deselected=2)
        assert "no cuda case passed: 2 of the 2 cuda cases failed (test_gated.py::test_add[cuda], " in output(result)


@pytest.mark.skipif(devices.unavailable_reason("hpu") is None, reason="this machine has an HPU: the gate would pass")
@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["single", "xdist"])
def test_pytest_m_hpu_without_hpu_is_one_clear_usage_error(run, xdist):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", *xdist)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    errors = [line for line in result.errlines if line.startswith("ERROR:")]
    assert len(errors) == 1 and errors[0].startswith("ERROR: -m 'hpu' selects hpu cases, but hpu is not available "
                                                     "here: habana_frameworks"), output(result)
    assert "This runner cannot gate hpu changes" in errors[0]
    assert "test_add" not in output(result), "no case may run once the gate refused"
    assert "created:" not in output(result), "the xdist controller refuses before it starts a worker"


@pytest.mark.skipif(devices.unavailable_reason("hpu") is None, reason="this machine has an HPU")
def test_run_cli_device_hpu_without_hpu_is_a_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    result = pytester.run(sys.executable, "-m", "mpt_kv", "run", "--device", "hpu", "--report",
                          str(pytester.path / "r.json"), timeout=HANG_S)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "ERROR: --device hpu, but hpu is not available here" in output(result)


def test_required_device_whose_cases_all_skipped_fails(run):
    """cpu is present, so only the end-of-run gate can catch this: nothing of it passed. A test
    in a folder named cpu passes, and it is no cpu case (the old gate read pytest keywords)."""
    result = run(EVERY_CASE_SKIPS, "--require-device", "cpu", "--device", "cpu",
                 files={"cpu/test_in_a_folder_named_cpu": "def test_x():\n    pass\n"})
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
    result.assert_outcomes(passed=1, skipped=1)
    assert "--require-device cpu: no cpu case passed (1 cpu cases reported)" in output(result)


class Reports:
    """Reports as pytest_runtest_logreport receives them (the gate reads nothing else)."""

    def __init__(self, when="call", outcome="passed", kinds=()):
        self.when, self.outcome, self.nodeid = when, outcome, "t.py::t"
        self.user_properties = [("mpt_kv_kinds", list(kinds))]
        self.passed, self.skipped = outcome == "passed", outcome == "skipped"


def test_the_end_of_run_gate_counts_only_passed_device_cases():
    config = FakeConfig()
    run = run_state(config)
    run.required = {"hpu": "-m 'hpu' selects hpu cases"}
    assert gate.gate_failures(config) == ["-m 'hpu' selects hpu cases: no hpu case passed (0 hpu cases reported). "
                                            "A gate that ran nothing must not look green."]  # selects nothing
    for report in (Reports(outcome="skipped", kinds=["hpu"]), Reports("setup", "failed", ["hpu"]), Reports()):
        outcomes.collect(run, report)
    # a setup error counts (as a failure: the gate says which), a keyword-less pass not
    assert "no hpu case passed: 1 of the 2 hpu cases failed (t.py::t)" in gate.gate_failures(config)[0]
    outcomes.collect(run, Reports(kinds=["hpu"]))
    assert gate.gate_failures(config) == []


def test_a_required_kind_whose_cases_failed_says_what_failed_not_that_nothing_ran():
    """Issue 38: a narrowed run whose P3 cases fail on a views bug checked the cache and found it broken;
    "a gate that ran nothing" would send a reviewer looking for a skip."""
    config = FakeConfig()
    run = run_state(config)
    run.required = {"cpu": "-m 'cpu' selects cpu cases"}
    run.results += [{"target": "t", "property": "P3", "path": "concat", "outcome": "failed", "kinds": ["cpu"]},
                    {"target": "t", "property": "ops-P3", "path": "concat", "outcome": "failed", "kinds": ["cpu"]},
                    {"target": "t", "property": "P1", "path": "concat", "outcome": "skipped", "kinds": ["cpu"]}]
    assert gate.gate_failures(config) == [
        "-m 'cpu' selects cpu cases: no cpu case passed: 2 of the 3 cpu cases failed (P3, ops-P3 failed 2 on concat); "
        "their failures above say what is wrong."]


# --- the opt-outs are for exploring: refused under CI, as --update-ceilings is -----------------------------------

@pytest.mark.parametrize("flag, args", [
    ("--allow-missing-device", ("-m", "hpu")),  # was: exit 0, every hpu case skipped
    ("--allow-no-cache-check", ("-m", "cpu")),  # was: exit 0 having checked no cache
])
def test_the_opt_outs_are_refused_under_ci(run, flag, args):
    result = run(ONE_CASE_PER_DEVICE, *args, flag, CI="true")
    text = output(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    assert f"ERROR: {flag} is refused under CI (CI=true): it lets " in text, text
    assert "It is for exploring locally: run without CI=true" in text, text
    local = run(ONE_CASE_PER_DEVICE, *args, flag, CI="false")  # locally it is what it was
    assert local.ret == pytest.ExitCode.OK, output(local)


@pytest.mark.parametrize("name", ["allow_missing_device", "allow_no_cache_check"])
def test_every_opt_out_is_refused_under_ci_before_any_test(monkeypatch, name):
    monkeypatch.setenv("CI", "yes")
    with pytest.raises(pytest.UsageError, match="is refused under CI"):
        gate.configure(FakeConfig(**{name: True}))


def test_gate_under_xdist_decides_from_the_workers_reports(run):
    # one case (cpu), so one worker: its reports are all the controller decides from; --device cpu: no
    # accelerator to survey for cards (tests/test_plugin_cards.py does that)
    result = run(EVERY_CASE_SKIPS, "-n", "1", "--require-device", "cpu", "--device", "cpu")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
    assert "no cpu case passed" in output(result)


class FakeItem:
    def __init__(self, params=None, markers=()):
        self.callspec = type("CallSpec", (), {"params": params})() if params is not None else None
        self.markers = [getattr(pytest.mark, m).mark for m in markers]

    def iter_markers(self):
        return iter(self.markers)


@pytest.mark.parametrize("item,kinds", [
    (FakeItem({"device": "hpu"}, ["hpu"]), ["hpu"]), (FakeItem(None, ["cuda", "slow"]), ["cuda"]),
    (FakeItem({"device": "cpu", "target": "hpu"}), ["cpu"]), (FakeItem(None, ["slow"]), [])])
def test_a_device_case_is_known_by_its_parameter_or_marker(item, kinds):
    assert outcomes.item_kinds(item) == kinds


# --- pytest's private marker-expression API, behind gate.compile_markexpr ---------------------------------------

def locked_pytest_versions() -> dict[str, str]:
    """{lock: pytest version} of every lock in constraints/ that pins pytest."""
    pins = {}
    for lock in ("cpu", "ohabana", "hpu", "latest"):
        for line in (ROOT / "constraints" / f"{lock}.txt").read_text().splitlines():
            if line.strip().lower().startswith("pytest=="):
                pins[lock] = line.split("==", 1)[1].split("#")[0].strip()
    return pins


def test_the_private_marker_expression_api_works_on_the_locked_pytest():
    """The gate reads -m with pytest's private `_pytest.mark.expression`: an upgrade that moves it
    fails here first, with the wrapper's message naming pytest's version. The locks that pin
    pytest pin one version; `tox -e latest` (pytest unpinned) runs the wrapper on the newest."""
    pins = locked_pytest_versions()
    assert {"cpu", "ohabana", "hpu"} <= set(pins) and len(set(pins.values())) == 1, pins
    if "latest" not in pins and not os.environ.get("TOX_ENV_NAME", "").startswith("latest"):
        assert pytest.__version__ in pins.values(), f"pytest {pytest.__version__} is installed, the locks pin {pins}"
    matches = gate.compile_markexpr("hpu(card=1) and not slow")
    assert matches(lambda name, **kwargs: name == "hpu" and kwargs == {"card": 1}) is True
    assert matches(lambda name, **kwargs: name in ("hpu", "slow")) is False
    assert gate.compile_markexpr("hpu and") is None  # pytest reports a malformed expression itself


def test_a_moved_private_marker_expression_api_is_one_clear_error(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "_pytest.mark.expression", types.ModuleType("_pytest.mark.expression"))
    with pytest.raises(pytest.UsageError, match=re.escape(f"pytest's private _pytest.mark.expression (Expression."
                                                          f"compile, evaluate), which pytest {pytest.__version__} does "
                                                          "not provide as mpt-kv expects (ImportError")):
        gate.kinds_required_by_markexpr("hpu")
