"""The suite gates merges: it must never pass by accident (docs/gate.md, one test per row).

Runs that must show an exit status run a small pytest session in a subprocess (pytester), so
its exit status, its environment and its devices are its own. HPU is simulated on this CPU-only
machine by the fakes in tests/fakes/ (put on PYTHONPATH of those subprocesses): one maps hpu onto
cpu, one fails every op, and the module list of the fake machine can leave a card out. The
rest are plain function tests of the gate's pieces.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

import mpt_kv.plugin
from mpt_kv import devices
from mpt_kv.plugin import gate, known_failures, options, outcomes, parametrize
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin import ceilings as plugin_ceilings
from mpt_kv.checks import strategies
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.checks.strategies import (HPU_HEAD_COUNTS, HPU_HEAD_DIM, HPU_LAYERS, HPU_MAX_SEQ_LEN, HPU_NEW_TOKENS,
                                      HPU_PROMPT_BUCKET, cases)
from mpt_kv.checks import known_failures as KF

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
BASE = ("-p", "no:cacheprovider")

ONE_CASE_PER_DEVICE = """
import torch

def test_add(device):
    x = torch.ones(2, device=device)
    assert (x + x).sum().item() == 4

def test_mul(device):
    assert (torch.ones(2, device=device) * 3).sum().item() == 6
"""
EVERY_CASE_SKIPS = """
import pytest

def test_case(device):
    pytest.skip("skipped on purpose")
"""


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env) -> RunResult of pytest in a fresh subprocess."""
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "MPT_KV_HYPOTHESIS_PROFILE", "MPT_KV_KNOWN_FAILURES",
                devices.ENV_CARDS, "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "HABANA_VISIBLE_MODULES",
                "MPT_KV_FAKE_HPU", "MPT_KV_FAKE_HPU_MODULES", "MPT_KV_FAKE_HPU_LOG"):
        monkeypatch.delenv(var, raising=False)

    def _run(source, *args, fakes=(), files=None, **env):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *(str(FAKES / f) for f in fakes)]))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pytester.makepyfile(test_gated=source, **(files or {}))
        return pytester.runpytest_subprocess(*BASE, *args, timeout=300)

    return _run


def output(result) -> str:
    return "\n".join(result.outlines + result.errlines)


class FakeConfig:
    """What the gate's functions read of a pytest config."""

    def __init__(self, **options):
        self.options = {"require_device": [], "device": None, "markexpr": "", "allow_missing_device": False,
                        "update_ceilings": False, "mpt_kv_report": None, "ceilings_dir": None, "target": [],
                        **options}

    def getoption(self, name, default=None):
        return self.options.get(name, default)

    def getini(self, name):
        return self.options.get(name, [])  # the project's ini options (mpt_kv_targets, ...): unset

    rootpath, inipath = ROOT, None  # the ceilings folder defaults to <rootdir>/mpt_kv_ceilings

    @property
    def stash(self):  # where the plugin keeps the session's state (mpt_kv.plugin.state)
        self.__dict__.setdefault("_stash", pytest.Stash())
        return self.__dict__["_stash"]


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
                          str(pytester.path / "r.json"), timeout=300)
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
    assert "(2 hpu cases reported)" in gate.gate_failures(config)[0]  # a setup error counts, a keyword-less pass not
    outcomes.collect(run, Reports(kinds=["hpu"]))
    assert gate.gate_failures(config) == []


def test_gate_under_xdist_decides_from_the_workers_reports(run):
    result = run(EVERY_CASE_SKIPS, "-n", "2", "--require-device", "cpu")
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


# --- the simulated HPU: present, broken, a card missing ------------------------------------------------------------

def card_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fake_hpu_one_card_per_worker_pinned_before_torch_and_a_missing_card_fails(run, pytester):
    """`pytest -m hpu -n 2` on a machine with cards 0 and 1 listed, card 1 gone: gw0's cases run
    on its card and pass; gw1's fail naming the card (they do not skip) and gw1 is not restarted.
    Each worker already saw its own card when `import torch` loaded the HPU backend (autoload)."""
    log = pytester.path / "cards.jsonl"
    result = run(ONE_CASE_PER_DEVICE + ONE_CASE_PER_DEVICE.replace("def test_", "def test_again_"), "-m", "hpu",
                 "-n", "2", "-rA", fakes=["hpu"], HABANA_VISIBLE_MODULES="0,1", MPT_KV_FAKE_HPU_MODULES="0",
                 MPT_KV_FAKE_HPU_LOG=str(log))
    text = output(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    passed = {line.split("::")[1] for line in result.outlines if line.startswith("PASSED")}
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("ERROR")}
    assert passed and failed and len(passed | failed) == 4, text
    assert "xdist worker gw1 was given hpu card 1 (HABANA_VISIBLE_MODULES=1) but hpu is not available in it" in text
    assert "xdist cards: gw0: hpu 0; gw1: hpu 1" + "\n" in text + "\n", text  # nobody restarted
    seen = {r["worker"]: r["visible"] for r in card_log(log) if r["worker"]}
    assert seen == {"gw0": "0", "gw1": "1"}, seen


def test_broken_hpu_fails_every_case_and_the_gate(run):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", fakes=["hpu"], MPT_KV_FAKE_HPU="broken")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
    result.assert_outcomes(failed=2, deselected=4)
    assert "RuntimeError: synStatus 26" in output(result)
    assert "no hpu case passed (2 hpu cases reported)" in output(result)


def test_more_workers_than_cards_is_a_usage_error(run):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", "-n", "3", fakes=["hpu"], MPT_KV_FAKE_HPU_MODULES="0,1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "ERROR: -n 3: more xdist workers than hpu cards (2: HABANA_VISIBLE_MODULES 0,1)" in output(result)


CRASHES_ONCE = """
import os
import pytest
import torch

@pytest.mark.parametrize("i", range(4))
def test_case(device, i):
    if i == 0 and not os.path.exists("crashed"):
        open("crashed", "w").close()
        os._exit(1)  # the worker dies; xdist starts another one under a new name
    assert torch.ones(2, device=device).sum().item() == 2
"""


@pytest.mark.slow  # three workers start: ~15 s
def test_a_crashed_workers_replacement_takes_a_card_that_exists(run, pytester):
    log = pytester.path / "cards.jsonl"
    result = run(CRASHES_ONCE, "-m", "hpu", "-n", "2", fakes=["hpu"], MPT_KV_FAKE_HPU_MODULES="0,1",
                 MPT_KV_FAKE_HPU_LOG=str(log))
    result.assert_outcomes(failed=1, passed=3)  # the crash is a failure of the case that crashed
    assert re.search(r"gw2: hpu (\d) \(given back by gw\1\)", output(result)), output(result)
    seen = {r["worker"]: r["visible"] for r in card_log(log) if r["worker"]}
    assert set(seen) == {"gw0", "gw1", "gw2"} and set(seen.values()) == {"0", "1"}, seen


def test_card_pool_hands_out_each_card_once_and_takes_it_back():
    pool = devices.CardPool({"hpu": ["4", "5"]})
    assert pool.take("gw0") == {"hpu": "4"} and pool.take("gw1") == {"hpu": "5"}
    assert pool.take("gw2") == {"hpu": None}  # none left: that worker fails its hpu cases
    pool.give_back("gw1")
    assert pool.take("gw3") == {"hpu": "5"}
    assert pool.log[-1] == "gw3: hpu 5 (given back by gw1)"


def test_pin_env_and_a_pin_that_would_come_too_late(monkeypatch):
    env = devices.pin_env({"hpu": "3", "cuda": "1"})
    assert env == {"HABANA_VISIBLE_MODULES": "3", "CUDA_VISIBLE_DEVICES": "1",
                   devices.ENV_CARDS: '{"hpu": "3", "cuda": "1"}'}
    monkeypatch.setenv(devices.ENV_CARDS, json.dumps({"hpu": "3"}))
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0")
    assert "torch" in sys.modules  # this process imported it: too late to change the card
    with pytest.raises(devices.DeviceUnavailable, match="HABANA_VISIBLE_MODULES is '0', not its card '3', and torch "
                                                        "is already imported"):
        devices.check_pinned()
    monkeypatch.delitem(sys.modules, "torch")  # as in a worker before anything imported it
    devices.check_pinned()
    assert os.environ["HABANA_VISIBLE_MODULES"] == "3"


def test_gaudi_modules_come_from_hl_smi_when_not_listed(tmp_path, monkeypatch):
    """Without HABANA_VISIBLE_MODULES the cards are the module IDs hl-smi lists (Intel Gaudi's
    documented way to map cards), not 0..n-1: a container may hold modules 4-7 only."""
    hl_smi = tmp_path / "hl-smi"
    hl_smi.write_text("#!/bin/sh\nprintf '6\\n4\\n7\\n5\\n'\n")
    hl_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    assert devices._hpu_modules() == ["4", "5", "6", "7"]
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "2,3")
    assert devices._hpu_modules() == ["2", "3"]


def test_the_plugin_does_not_import_torch_at_import(pytester):
    """An xdist worker loads the plugin before its card is pinned (PyTorch >= 2.5 initialises
    device backends at `import torch`)."""
    result = pytester.run(sys.executable, "-c", "import sys, mpt_kv.plugin, mpt_kv.devices; "
                                                "print('torch' in sys.modules)")
    assert result.outlines[-1] == "False", output(result)


# --- 3. targets ---------------------------------------------------------------------------------------------------

def test_named_targets_that_cannot_load_stop_the_run(tmp_path, monkeypatch):
    (tmp_path / "broken_dep.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {"examples.no_such_module:build": "cannot import examples.no_such_module",
             "examples.sdpa_mpt:no_such_factory": "has no 'no_such_factory'",
             "not-a-spec": "neither built in",
             "broken_dep:build": "No module named 'a_dependency_that_is_not_installed'"}
    for spec, reason in cases.items():
        with pytest.raises(pytest.UsageError, match=re.escape(f"--target {spec}: ") + f".*{re.escape(reason)}"):
            parametrize.check_named_targets(FakeConfig(target=[spec]))


@pytest.mark.skipif(parametrize.missing_package("optimum-habana") is None, reason="optimum-habana is installed here")
def test_a_named_builtin_whose_package_is_absent_stops_the_run():
    with pytest.raises(pytest.UsageError, match="--target optimum-habana: optimum-habana is not installed"):
        parametrize.check_named_targets(FakeConfig(target=["optimum-habana"]))


BAD_FACTORY = "def build(cfg, state_dict, device, dtype):\n    raise TypeError(\"build() got an unexpected keyword 'cache_idx'\")\n"


def test_run_cli_with_a_target_that_fails_to_build_reports_it_and_fails(pytester, monkeypatch):
    """`python -m mpt_kv run --target X` used to crash before pytest started (the machine
    description built each target and caught only TargetUnavailable)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    pytester.makepyfile(bad_target=BAD_FACTORY)
    result = pytester.run(sys.executable, "-m", "mpt_kv", "run", "--target", "bad_target:build", "--report",
                          str(pytester.path / "r.json"), "-k", "P0 and fp32 and bad_target", timeout=300)
    text = output(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    assert "target bad_target:build does not build on cpu: TypeError: build() got an unexpected keyword" in text
    assert "target bad_target:build cannot be built here (named with --target: an error, not a skip): TypeError" in text


@pytest.mark.skipif(parametrize.missing_package("optimum-habana") is None, reason="the real optimum-habana is installed here")
def test_an_installed_builtin_that_fails_to_load_is_an_error_not_a_skip(pytester, monkeypatch):
    """optimum-habana "installed" (tests/fakes/optimum_habana_broken) but its MPT module fails
    on an import of its own: not named, yet its cases fail; only an absent package skips."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(FAKES / "optimum_habana_broken")]))
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    result = pytester.runpytest_subprocess(*BASE, "--pyargs", "mpt_kv.conformance.test_properties", "-k",
                                           "P0 and optimum and not P0/", "--device", "cpu", "--dtype", "fp32", timeout=300)
    text = output(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == 1 and not outcomes.get("skipped") and not outcomes.get("passed"), outcomes
    assert "target optimum-habana cannot be built here: TargetUnavailable: optimum-habana is installed but " \
           "optimum.habana.transformers.models.mpt.modeling_mpt fails to import on CPU" in text, text


@pytest.mark.skipif(parametrize.missing_package("optimum-habana") is None, reason="the real optimum-habana is installed here")
def test_gaudi_loader_reports_an_import_error_as_it_is(pytester, monkeypatch):
    """An installed optimum-habana whose MPT module fails on an import of its own: on CPU, and
    where habana_frameworks imports (then it is imported normally, and the genuine ImportError
    is reported as such, never as "needs HPU")."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(FAKES / "optimum_habana_broken")]))
    script = textwrap.dedent(f"""
        import importlib, sys
        from mpt_kv.targets.gaudi import load_gaudi_mpt_module

        def attempt():
            try:
                load_gaudi_mpt_module()
            except Exception as e:
                print(e)
            for name in [n for n in sys.modules if n.startswith("optimum")]:
                del sys.modules[name]

        attempt()
        sys.path.append({str(FAKES / "hpu")!r})  # now habana_frameworks imports
        importlib.invalidate_caches()
        attempt()
    """)
    result = pytester.run(sys.executable, "-c", script)
    on_cpu, with_hpu = result.outlines[-2:]
    for line in (on_cpu, with_hpu):
        assert "ImportError: cannot import name 'NoSuchNameInTransformers'" in line and "without HPU" not in line
    assert "fails to import on CPU" in on_cpu, on_cpu
    assert "optimum-habana is installed and habana_frameworks imports, but" in with_hpu, with_hpu


# --- 4. known failures -------------------------------------------------------------------------------------------

KNOWN_CASES = """
import pytest
from mpt_kv.checks.compare import PropertyFailure

@pytest.mark.property("P3")
@pytest.mark.parametrize("path", ["concat"])
@pytest.mark.parametrize("what", ["known", "other_message", "runtime_error", "passes"])
def test_case(target, device, path, what):
    if what == "known":
        raise PropertyFailure("P3: layer 0 cached key (1, 1, 1, 4) is a view of mixed_qkv (1, 1, 12)")
    if what == "other_message":
        raise PropertyFailure("P3: layer 0 cached key (1, 1, 1, 4) shares storage with layer 1")
    if what == "runtime_error":
        raise RuntimeError("synStatus 26 [Device not found]: the device was lost")
"""
ENTRY = {"target": "reference", "property": "P3", "path": "concat", "pattern": r"is a view of mixed_qkv",
         "reason": "test: views of mixed_qkv"}
TYPO = {"target": "refrence", "property": "P3", "pattern": "a typo entry, never matched", "reason": "test: a typo in the target"}


@pytest.fixture
def known_file(tmp_path):
    path = tmp_path / "known.json"
    path.write_text(json.dumps([ENTRY, TYPO]))
    return path


def test_a_known_failure_xfails_only_the_failure_its_pattern_names(run, known_file):
    result = run(KNOWN_CASES, "--only-targets", "--target", "reference", "--device", "cpu", "-rxX",
                 "--strict-known-failures", MPT_KV_KNOWN_FAILURES=str(known_file))
    text = output(result)
    result.assert_outcomes(xfailed=1, failed=3)
    # a project's own file: its entries are the project's known failures, not called upstream's
    assert ("XFAIL test_gated.py::test_case[cpu-reference-known-concat] - known failure of this project "
            "(known.json), entry 0") in text
    assert "[XPASS(strict)] known failure of this project (known.json) entry 0 (reference P3 concat) did not happen" \
        in text and "-- if it is fixed, remove or narrow the entry" in text
    assert text.count("entry 0 (reference P3 concat) in") == 2, text  # other_message and runtime_error
    assert "expects a PropertyFailure whose message matches /is a view of mixed_qkv/" in text
    assert "RuntimeError: synStatus 26" in text
    assert "entry 1 (refrence P3) in" in text and "matched no case of this run: its target 'refrence' is no target " \
        "of this run (" in text and "a typo, or the target is gone (--strict-known-failures: an error)" in text


def test_strict_known_failures_makes_an_entry_that_matched_nothing_an_error(known_file):
    config = FakeConfig(strict_known_failures=False)
    run = run_state(config)
    run.required, run.profile = {}, "dev"
    run.known, run.known_cases = KF.load(known_file), True
    run.known_covered = {run.known[0].key}  # entry 1 (the typo) covered no collected case
    session = type("Session", (), {"config": config, "exitstatus": pytest.ExitCode.OK})()
    mpt_kv.plugin.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.OK  # listed only
    config.options["strict_known_failures"] = True
    mpt_kv.plugin.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    # the same from the project's ini (mpt_kv_strict_known_failures = true), for a CI line without the flag
    config.options["strict_known_failures"], session.exitstatus = False, pytest.ExitCode.OK
    config.options["mpt_kv_strict_known_failures"] = True
    mpt_kv.plugin.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    run.known_cases = False  # no conformance case collected at all: nothing to judge
    assert known_failures.unmatched(config) == []


def test_a_malformed_known_failures_file_is_a_usage_error_not_an_internal_error(run, tmp_path):
    path = tmp_path / "known.json"
    path.write_text(json.dumps([{**ENTRY, "pattern": "view of (mixed_qkv"}]))
    result = run(KNOWN_CASES, MPT_KV_KNOWN_FAILURES=str(path))
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert f"ERROR: known failures file {path}: entry 0 (reference P3): 'pattern' 'view of (mixed_qkv' is not a " \
           "regular expression: missing ), unterminated subpattern" in output(result)
    assert "INTERNALERROR" not in output(result)


@pytest.mark.parametrize("content,what", [
    ("[{", "not valid JSON"),
    ('{"target": "x"}', "expected a JSON list of entries, got dict"),
    (json.dumps([{**ENTRY, "dtype": "bf16"}]), "entry 0 (reference P3): unknown field(s) ['dtype']"),
    (json.dumps([{k: v for k, v in ENTRY.items() if k != "pattern"}]), "entry 0 (reference P3): missing field(s) "
                                                                       "['pattern']"),
    (json.dumps([{**ENTRY, "when": {"transformers": "<<4.56"}}]), "'when' transformers: '<<4.56' is not a version "
                                                                  "specifier"),
    (json.dumps([{**ENTRY, "pattern": "a(b"}]), "'pattern' 'a(b' is not a regular expression"),
    (json.dumps([{**ENTRY, "pattern": ".*"}]), "matches the empty string"),
    (json.dumps([{**ENTRY, "property": "P9"}]), "unknown property 'P9'"),
    (json.dumps([{**ENTRY, "property": "family-P3"}]), "unknown property 'family-P3'"),  # the families' file's
    (json.dumps([{**ENTRY, "path": "paged"}]), "unknown path 'paged'"),
    (json.dumps([{**ENTRY, "bucket": "yes"}]), "'bucket' must be a bool"),
    (json.dumps([ENTRY, "P3"]), "entry 1: expected an object, got str"),
])
def test_malformed_known_failures_name_the_file_the_entry_and_the_problem(tmp_path, content, what):
    path = tmp_path / "known.json"
    path.write_text(content)
    with pytest.raises(KF.KnownFailuresError, match=re.escape(f"known failures file {path}: ") + ".*" + re.escape(what)):
        KF.load(path)


def test_the_configured_gate_turns_a_malformed_file_into_a_usage_error(tmp_path, monkeypatch):
    path = tmp_path / "known.json"
    path.write_text("[{")
    monkeypatch.setenv("MPT_KV_KNOWN_FAILURES", str(path))
    with pytest.raises(pytest.UsageError, match="not valid JSON"):
        known_failures.configure(FakeConfig())


def test_entry_explains_only_its_property_failure():
    entry = KF._entry(ENTRY, 0, "f.json")
    known = PropertyFailure("layer 0 cached key (1, 4) is a view of mixed_qkv (1, 12)")
    assert entry.explains(known)
    assert not entry.explains(PropertyFailure("layer 0 cached key shares storage with layer 1"))
    assert not entry.explains(RuntimeError("is a view of mixed_qkv"))  # the message alone is not enough
    assert not entry.explains(AttributeError("module has no attribute 'GaudiMptAttention'"))
    group = pytest.importorskip("exceptiongroup").ExceptionGroup if sys.version_info < (3, 11) else ExceptionGroup
    assert entry.explains(group("two", [known, PropertyFailure("value (1, 4) is a view of mixed_qkv")]))
    assert not entry.explains(group("two", [known, RuntimeError("device lost")]))


def test_packaged_known_failures_load_and_name_their_failures():
    """Each pattern is checked against the real failure where it applies: the ohabana env
    (transformers 4.55.4, optimum-habana 1.21.2) runs them as strict known failures."""
    entries = KF.load()
    assert [(e.target, e.property) for e in entries][:3] == [("transformers", "P3"), ("transformers", "memory"),
                                                             ("optimum-habana", "P1")]  # others are appended after
    assert all(e.pattern.pattern for e in entries)


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
    from mpt_kv.checks import ceilings as C

    baseline = C.baseline_path("cpu", ROOT / "mpt_kv_ceilings")
    stored = next(iter(C.load_baseline(baseline, "cpu")))
    target, path, dtype, config, shape = stored.split("|")
    return {"target": "transformers", "target_version": "transformers 5.99", "device": "cpu", "dtype": dtype,
            "path": "concat", "bucket": None, "batch": 16, "max_input": 8, "max_new": 8, "problems": 0,
            "cfg": dict(zip(("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"),
                            (int(x[1:]) for x in shape.split("-")))), **more}


def test_a_version_without_stored_ceilings_says_in_one_line_how_to_record_it():
    """A required target's missing entry is a BaselineError ("error"): the line gives the command."""
    from mpt_kv.checks import ceilings as C

    m = missing_measurement(outcome="error")
    config = FakeConfig()
    run_state(config).memory[:] = [m, {**m, "max_new": 24}, {**m, "outcome": "passed"}]
    lines = plugin_ceilings.failure_lines(config)
    assert lines == [f"memory ceilings: none stored for transformers (transformers 5.99) on cpu (2 cases failed for "
                     f"that alone): record them locally, not under CI, with `python -m pytest --pyargs "
                     f"mpt_kv.conformance -k memory --update-ceilings`, review the diff and commit "
                     f"{C.baseline_path('cpu', ROOT / 'mpt_kv_ceilings')}"]


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


# --- 6. pinned environments ----------------------------------------------------------------------------------------

@pytest.fixture
def constraints_diff():
    """constraints/diff.py, the lock tool (a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("constraints_diff", ROOT / "constraints" / "diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_locked_versions_are_the_ones_the_ceilings_are_keyed_by(constraints_diff):
    from mpt_kv.checks import ceilings as C

    keys = {k.split("|")[0] for k in C.load_baseline(C.baseline_path("cpu"), "cpu")}
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    cpu = constraints_diff.read_lock(ROOT / "constraints" / "cpu.txt")
    oh = constraints_diff.read_lock(ROOT / "constraints" / "ohabana.txt")
    assert f"transformers (transformers {minor(cpu['transformers'])})" in keys
    assert f"transformers (transformers {minor(oh['transformers'])})" in keys
    assert f"optimum-habana (optimum-habana {minor(oh['optimum-habana'])}, transformers {minor(oh['transformers'])})" \
        in keys
    assert cpu["torch"] == oh["torch"] == "2.13.0"


def test_the_latest_env_pins_only_torch(constraints_diff):
    assert constraints_diff.read_lock(ROOT / "constraints" / "latest.txt") == {"torch": "2.13.0"}


def test_the_hpu_lock_never_installs_the_images_own_packages(constraints_diff):
    hpu = constraints_diff.read_lock(ROOT / "constraints" / "hpu.txt")
    assert not {"torch", "transformers", "habana-frameworks", "optimum-habana"} & set(hpu)
    assert {"pytest", "hypothesis", "pytest-xdist"} <= set(hpu)


def test_tox_envs_install_from_the_locks_and_latest_is_not_default():
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert [e.strip() for e in tox["tox"]["env_list"].split(",")] == ["cpu", "ohabana"]
    for env, name in (("testenv", "cpu"), ("testenv:ohabana", "ohabana"), ("testenv:hpu", "hpu")):
        assert f"PIP_CONSTRAINT = {{tox_root}}{{/}}constraints{{/}}{name}.txt" in tox[env]["set_env"]
    assert "--strict-known-failures" in tox["testenv"]["commands"]
    assert "--target optimum-habana" in tox["testenv:ohabana"]["commands"]
    assert "torch" not in tox["testenv:hpu"]["deps"]
    assert "constraints{/}latest.txt" in tox["testenv:latest"]["set_env"]  # only torch: the rest at its newest
    assert "diff.py" in tox["testenv:latest"]["commands_pre"]


def test_lock_diff_lists_what_changed(tmp_path, constraints_diff, capsys):
    path = tmp_path / "lock.txt"
    path.write_text("# header\npytest==0.0.1\nno-such-package==1.0\n")
    assert constraints_diff.main([str(path)]) == 0
    assert constraints_diff.main([str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert f"  pytest: 0.0.1 (locked) -> {constraints_diff.installed()['pytest']} (installed)" in out


# --- 7. the CLIs: bad input before any work ----------------------------------------------------------------------

def test_bench_refuses_a_config_that_cannot_fit_before_allocating(monkeypatch, capsys):
    from mpt_kv.cli import bench

    monkeypatch.setattr(devices, "available_memory", lambda kind: (8 << 30, "a test's 8 GiB"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "mpt-7b", "--batch-size", "1", "--max-input-tokens", "16", "--max-new-tokens", "16",
                    "--target", "reference", "--path", "static", "--dtype", "bf16", "--out", "/tmp/unused"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    need = bench.memory_needed(bench.model_config("mpt-7b"), bench.BenchConfig(1, 16, 16), 1, ["static"], 2)
    assert need > 12.4 * (1 << 30)  # mpt-7b's bf16 weights alone (6.65e9 parameters)
    assert (f"needs about {need * bench.FIT_MARGIN / (1 << 30):.1f} GiB on cpu (analytic estimate "
            f"{need / (1 << 30):.2f} GiB x 1.3 margin), but only 8.0 GiB is free (a test's 8 GiB)") in err


def test_bench_memory_estimate_counts_every_loaded_target_and_the_concat_copy():
    from mpt_kv.cli import bench
    from mpt_kv.memory import analytic

    cfg, bc = bench.model_config("small"), bench.BenchConfig(4, 128, 128)
    one = bench.memory_needed(cfg, bc, 1, ["static"], 4)
    assert bench.memory_needed(cfg, bc, 3, ["static"], 4) - one == 2 * analytic.weights_bytes(bench.shape_of(cfg), 4)
    assert bench.memory_needed(cfg, bc, 1, ["concat", "static"], 4) - one == \
        analytic.kv_cache_bytes(bench.shape_of(cfg), 4, 256, 4)


@pytest.mark.parametrize("cli,args,message", [
    ("bench", ["--out", "{file}/sub"], "--out {file}/sub: {file}/sub cannot be created: {file} is not a folder"),
    ("killmatrix", ["--markdown", "{file}/x.md"], "--markdown {file}/x.md: {file} exists and is not a folder"),
    ("killmatrix", ["--json", "{dir}"], "--json {dir}: {dir} is a folder, expected a file name"),
    ("run", ["--report", "{file}/r.json"], "--report {file}/r.json: {file} exists and is not a folder"),
])
def test_every_output_path_is_checked_before_the_work_starts(tmp_path, capsys, monkeypatch, cli, args, message):
    import importlib

    file = tmp_path / "a_file"
    file.write_text("")
    fill = lambda s: s.format(file=file, dir=tmp_path)  # noqa: E731
    main = importlib.import_module(f"mpt_kv.cli.{cli}").main
    monkeypatch.setattr("mpt_kv.catalogue.killmatrix.run_matrix", lambda *a: pytest.fail("the work started"))
    with pytest.raises(SystemExit) as e:
        main([fill(a) for a in args])
    assert e.value.code == 2
    assert fill(message) in capsys.readouterr().err


def test_the_plugin_checks_its_report_path_before_collecting(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(pytest.UsageError, match=re.escape(f"--mpt-kv-report {file}/r.json: {file} exists and is not "
                                                          "a folder")):
        gate.configure(FakeConfig(mpt_kv_report=f"{file}/r.json"))


@pytest.mark.skipif(devices.unavailable_reason("cuda") is None, reason="this machine has CUDA")
def test_killmatrix_on_a_device_that_is_absent_is_a_usage_error(capsys, monkeypatch):
    from mpt_kv.cli import killmatrix

    monkeypatch.setattr(killmatrix, "run_matrix", lambda *a: pytest.fail("the work started"))
    with pytest.raises(SystemExit) as e:
        killmatrix.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda is not available here: torch.cuda.is_available() is False" in capsys.readouterr().err


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
        settings.load_profile(run_state(request.config).profile)  # this run's own profile back


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
