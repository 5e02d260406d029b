"""The plugin's bad inputs and its front door (issue 19's plugin rows): each bad value is a
usage error before any test, naming the value and where it came from; a run that checked
nothing fails; the lines the summary prints are true and their commands work.

Option parsing runs on a real pytest config (pytester.parseconfig: no test session, so this
run's own collected results are left alone); the end-of-run rows run a small pytest session in
a subprocess, as tests/test_plugin_gate.py does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mpt_kv.errors import TargetUnavailable
from mpt_kv.plugin import ceilings, options, parametrize, report
from mpt_kv.targets import resolve_target
from plugin_testing import HANG_S

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def config(pytester, monkeypatch):
    """config(ini_lines, *args) -> a parsed pytest config of a fresh project folder."""
    for var in (options.ENV_CEILINGS_DIR, options.ENV_PROFILE):
        monkeypatch.delenv(var, raising=False)

    def _config(ini: str = "", *args):
        pytester.makeini(f"[pytest]\n{ini}\n")
        return pytester.parseconfig(*args)

    return _config


# --- the stored ceilings folder and the targets that require it ----------------------------------------------------

@pytest.mark.parametrize("how", ["option", "env", "ini"])
@pytest.mark.parametrize("value,what", [("/etc/passwd", "is not a folder"), ("no/such/folder", "does not exist")])
def test_a_ceilings_folder_named_explicitly_must_be_a_folder(config, monkeypatch, pytester, how, value, what):
    """Absent, every memory case would rest on the analytic checks alone, silently."""
    if how == "option":
        cfg, source = config("", "--ceilings-dir", value), f"--ceilings-dir {value}"
    elif how == "env":
        monkeypatch.setenv(options.ENV_CEILINGS_DIR, value)
        cfg, source = config(), f"${options.ENV_CEILINGS_DIR}={value}"
    else:
        cfg, source = config(f"mpt_kv_ceilings_dir = {value}"), f"ini option mpt_kv_ceilings_dir = {value}"
    with pytest.raises(pytest.UsageError, match="^" + __import__("re").escape(source) + f": .*{what}"):
        options.check(cfg)


def test_the_default_ceilings_folder_may_be_absent_and_a_new_one_may_be_recorded(config, pytester):
    """A project that never recorded runs the analytic checks (the default folder is absent);
    --update-ceilings may create the folder it names."""
    cfg = config()
    assert not (pytester.path / "mpt_kv_ceilings").exists()
    options.check(cfg)
    assert options.ceilings_dir(cfg) == pytester.path / "mpt_kv_ceilings"
    options.check(config("", "--ceilings-dir", "new_folder", "--update-ceilings"))
    (pytester.path / "kept").mkdir()
    options.check(config("mpt_kv_ceilings_dir = kept"))


@pytest.mark.parametrize("names,ok", [("*", True), ("reference", True), ("mine:build", True),
                                      ("nosuch-target", False), ("refrence", False)])
def test_required_ceilings_must_name_a_target(config, names, ok):
    cfg = config(f"mpt_kv_require_ceilings = {names}\nmpt_kv_targets = mine:build")
    if ok:
        assert options.required_ceilings(cfg) == (names,)
    else:
        with pytest.raises(pytest.UsageError, match=f"ini option mpt_kv_require_ceilings: '{names}' is not a target: "
                                                    "expected '\\*', a target of this run or a built-in one "
                                                    "\\(reference, transformers, optimum-habana, llm-foundry, mine:build\\)"):
            options.check(cfg)


# --- other option values ----------------------------------------------------------------------------------------

def test_an_only_targets_value_that_is_not_a_bool_names_the_option(config):
    with pytest.raises(pytest.UsageError, match="ini option mpt_kv_only_targets: invalid truth value 'maybe'; "
                                                "expected true or false"):
        options.check(config("mpt_kv_only_targets = maybe"))
    # with a target: without one, the run would have none (tests/test_green_run.py)
    assert options.only_targets(config("mpt_kv_only_targets = yes\nmpt_kv_targets = mine:build")) is True


def test_an_unknown_hypothesis_profile_is_one_usage_error_naming_the_known_ones(monkeypatch):
    monkeypatch.setenv(options.ENV_PROFILE, "nope")
    with pytest.raises(pytest.UsageError, match=r"\$MPT_KV_HYPOTHESIS_PROFILE='nope': no such hypothesis profile; "
                                                r"mpt-kv's profiles are dev \(the default\), ci .* and thorough"):
        options.check_hypothesis_profile()
    monkeypatch.setenv(options.ENV_PROFILE, "thorough")
    options.check_hypothesis_profile()


def test_builtin_target_names_are_the_targets_builtins():
    from mpt_kv.targets import BUILTIN

    assert tuple(options.BUILTIN_PACKAGES) == tuple(BUILTIN)


# --- the front door: a target module in the user's own folder ----------------------------------------------------

def test_a_target_module_in_the_current_folder_says_how_to_put_it_on_sys_path(tmp_path, monkeypatch):
    """`pytest --target my_own_target:build` does not put the current folder on sys.path; the error says what does."""
    (tmp_path / "my_own_target.py").write_text("def build(cfg, state_dict, device, dtype):\n    raise NotImplementedError\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(TargetUnavailable, match=r"cannot import my_own_target \(No module named 'my_own_target'\)\. my_own_target.py "
                                                r"is in the current folder, but the `pytest` command does not put that "
                                                r"folder on sys.path: run `python -m pytest \.\.\.`"):
        resolve_target("my_own_target:build")
    with pytest.raises(TargetUnavailable, match="PYTHONPATH") as e:
        resolve_target("notthere.sub:build")
    assert "notthere is not on sys.path" in str(e.value)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_target("my_own_target:build").name == "my_own_target:build"


def test_a_named_target_in_the_current_folder_is_a_usage_error_saying_how_to_fix_it(config, pytester, monkeypatch):
    pytester.makepyfile(mytarget="def build(cfg, state_dict, device, dtype):\n    raise NotImplementedError\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(pytester.path))])
    with pytest.raises(pytest.UsageError, match=r"^--target mytarget:build: target 'mytarget:build': cannot import "
                                                r"mytarget .* run `python -m pytest \.\.\.` from the folder that holds it"):
        parametrize.check_named_targets(config("", "--target", "mytarget:build"))


def test_a_missing_dependency_inside_a_target_module_gets_no_sys_path_hint(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TargetUnavailable) as e:
        resolve_target("needs_dep:build")
    assert "a_dependency_that_is_not_installed" in str(e.value) and "sys.path" not in str(e.value)


def test_the_record_command_is_the_runs_own_under_python_m_pytest():
    class Config:
        invocation_params = type("Params", (), {"args": ("--pyargs", "mpt_kv.conformance", "--target", "my t:build")})

    assert ceilings.record_command(Config()) == ("python -m pytest --pyargs mpt_kv.conformance --target 'my t:build' "
                                                 "-k memory --update-ceilings")
    Config.invocation_params.args = ("-k", "memory/static", "--update-ceilings")
    assert ceilings.record_command(Config()) == "python -m pytest -k memory/static --update-ceilings"


# --- the matrix ------------------------------------------------------------------------------------------------

def test_a_cell_whose_checks_disagree_says_which_check_had_which_outcome():
    def r(check, outcome):
        return {"target": "mine:build", "device": "cpu", "dtype": "float32", "path": "static", "property": "P1",
                "outcome": outcome, "check": check}

    results = [r("P1/static", "passed"), r("P1/static/graphs", "failed"), r("P1/static/head-dim-128", "failed"),
               r("P1/static/long-gen", "error"), r("P1/static/max-seq-len-2048", "passed")]
    lines = report.matrix_lines(results, {}, None)
    assert lines[1].split()[4:] == ["-", "error(1/5)", "-", "-", "-", "-", "-"], lines
    assert "  mine:build cpu float32 static P1 error(1/5): error P1/static/long-gen; failed P1/static/graphs, " \
           "P1/static/head-dim-128; 2 passed" in lines, lines
    assert report.matrix_lines([r("P1/static", "passed"), r("P1/static/graphs", "passed")], {}, None)[1].split()[5] \
        == "passed"


def test_a_run_with_failures_says_how_to_shorten_the_output():
    class Reporter:
        stats = {"failed": [1, 2], "error": [3]}

    class Config:
        def getoption(self, name, default=None):
            return self.tbstyle

    config = Config()
    config.tbstyle = "auto"
    assert report.short_traceback_hint(Reporter(), config) == ("3 failures and errors above: --tb=line prints one line "
                                                               "each (-q --tb=no -rf: only their list)")
    config.tbstyle = "line"
    assert report.short_traceback_hint(Reporter(), config) is None
    Reporter.stats, config.tbstyle = {"passed": [1]}, "auto"
    assert report.short_traceback_hint(Reporter(), config) is None


# --- whole runs ---------------------------------------------------------------------------------------------------

NOTHING_RUNS = """
import mpt_kv
from mpt_kv import Capabilities
from mpt_kv.checks.registry import record
from mpt_kv.targets.reference import build as reference


def build(cfg, state_dict, device, dtype):
    runner = reference(cfg, state_dict, device, dtype)
    runner.capabilities = Capabilities({k: "declared for the test" for k in ("cpu", "cuda", "hpu")})
    return runner


@mpt_kv.parametrize_with_checks([build], checks=[mpt_kv.CHECKS["P0"], mpt_kv.CHECKS["P1/concat"]])
def test_mine(check, target, device, dtype):
    record("mpt_kv_reach", {"check": check.id, "knobs": {"n_layers": 2}})  # what a check reached goes into the report
    check(target, device, dtype)
"""
BREAKS_THE_REPORT = """
import os
import mpt_kv


@mpt_kv.parametrize_with_checks(["reference"], checks=[mpt_kv.CHECKS["P0"]])
def test_breaks_the_report(check, target, device, dtype):
    os.mkdir(os.environ["BREAK_REPORT"])  # the report path becomes a folder: writing it fails at the end
"""


@pytest.fixture
def run(pytester, monkeypatch):
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("MPT_KV_HYPOTHESIS_PROFILE", "ci")  # the runs are not about profiles

    def _run(source, *args, device=("--device", "cpu"), **env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pytester.makepyfile(test_mine=source)
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *device, "--dtype", "fp32", *args,
                                               timeout=HANG_S)
        return result, "\n".join(result.outlines + result.errlines)

    return _run


def test_a_run_whose_conformance_cases_all_skipped_fails_and_so_does_its_report(run, pytester):
    """A target declaring every device unsupported, no device required: was "6 skipped", exit 0 (4 of
    them cuda and hpu cases, which are no longer generated where they cannot run)."""
    path = pytester.path / "r.json"
    result, text = run(NOTHING_RUNS, "--mpt-kv-report", str(path), device=())
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    assert "2 conformance cases were reported and none ran (2 unsupported): a run that checked nothing " \
           "must not look green" in text, text
    # the kinds that cannot run here are not generated (they were the "4 skipped"), and the summary says so
    assert "mpt-kv generated no cuda cases (not available here: " in text and "target optimum-habana" not in text, text
    from mpt_kv.cli import report as report_cli

    assert report_cli.main([str(path)]) == 1
    assert json.loads(path.read_text())["reach"] == [{"check": "P0", "knobs": {"n_layers": 2}}, {"check": "P1/concat", "knobs": {"n_layers": 2}}]


def test_only_conformance_cases_are_judged_and_the_opt_out_is_allowed():
    from mpt_kv.plugin.gate import nothing_ran

    skipped = [{"property": "P0", "outcome": "skipped"}, {"property": "P1", "outcome": "unsupported"}]
    assert nothing_ran(skipped) is not None
    assert nothing_ran(skipped, allowed=True) is None  # --allow-missing-device
    assert nothing_ran([*skipped, {"property": "P1", "outcome": "failed"}]) is None  # one ran (and fails the run)
    assert nothing_ran([{"outcome": "skipped", "nodeid": "tests/test_x.py::t"}]) is None  # the suite's own tests


def test_a_report_that_cannot_be_written_at_the_end_keeps_the_matrix_and_fails_in_one_line(run, pytester):
    broken = pytester.path / "later_a_folder.json"
    result, text = run(BREAKS_THE_REPORT, "--mpt-kv-report", str(broken), BREAK_REPORT=str(broken))
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    assert f"--mpt-kv-report {broken}: the report could not be written: [Errno 21] Is a directory" in text, text
    assert "mpt-kv conformance" in text and "1 passed" in text and "Traceback" not in text, text
    assert os.path.isdir(broken)


@pytest.mark.parametrize("form", ["space", "equals"])
def test_a_ceilings_folder_elsewhere_moves_no_node_id(tmp_path, form):
    """Issue 38: pytest reads the value of `--ceilings-dir DIR` as a test path before mpt-kv's options are known:
    the rootdir became DIR's and FAILED lines read `../../../tmp/DIR::test_memory_ceilings[...]` (the project's
    ini file lost too). options.keep_rootdir puts them back, on the locked pytest."""
    import subprocess

    ceilings_folder = tmp_path / "ceilings"
    ceilings_folder.mkdir()
    named = ["--ceilings-dir", str(ceilings_folder)] if form == "space" else [f"--ceilings-dir={ceilings_folder}"]
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance.test_memory", "-p", "no:cacheprovider",
         "--target", "mpt_kv.catalogue.variants:kv_views_of_mixed_qkv", "--only-targets", "-m", "cpu", "-rf",
         "-k", "fp32 and B4-in32 and concat", *named],
        cwd=ROOT, env={**env, "MPT_KV_HYPOTHESIS_PROFILE": "ci"}, capture_output=True, text=True, timeout=HANG_S)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text  # the views bug fails memory
    assert f"rootdir: {ROOT}" in text and "configfile: pyproject.toml" in text, text
    assert "FAILED mpt_kv/conformance/test_memory.py::test_memory_ceilings[cpu-mpt_kv.catalogue.variants:" \
           "kv_views_of_mixed_qkv-fp32-memory/concat/B4-in32-new8]" in text, text
