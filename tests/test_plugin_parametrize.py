"""The device and target parameters (mpt_kv/plugin/parametrize.py; docs/gate.md rows 12-15, 47): a target
named with --target that cannot load stops the run, one that cannot be built fails its cases, an
installed built-in that does not load is an error, never a skip; and what is generated where
(device kinds and built-in targets that can never run here get no case, and one summary line says
why, without letting a run that asks for one of them go green)."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest

from mpt_kv import devices
from mpt_kv.plugin import parametrize
from mpt_kv.plugin.state import run_state

from plugin_testing import BASE, FakeConfig, FAKES, ONE_CASE_PER_DEVICE, output, ROOT, subprocess_runner, HANG_S

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env): pytest in a fresh subprocess (plugin_testing)."""
    return subprocess_runner(pytester, monkeypatch)


# --- 3. targets ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("named", [False, True])
def test_a_family_case_of_a_missing_builtin_skips_unless_named(monkeypatch, named):
    """The one rule of the family and generate modules: a built-in implementation whose package is not installed
    skips its cases with the reason, and fails them where --target names it."""
    monkeypatch.setattr(parametrize, "missing_package", lambda spec: "optimum-habana is not installed")
    config = FakeConfig(target=["optimum-habana"] if named else [])
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match="optimum-habana is not installed") as raised:
        parametrize.require_package(config, "optimum-habana")
    assert raised.type is (pytest.fail.Exception if named else pytest.skip.Exception)
    assert ("is named with --target" in str(raised.value)) == named


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
                          str(pytester.path / "r.json"), "-k", "P0 and fp32 and bad_target", timeout=HANG_S)
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
                                           "P0 and optimum and not P0/", "--device", "cpu", "--dtype", "fp32", timeout=HANG_S)
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


# --- what is generated where: only what can run here, or what the run asks for --------------------------------------

# a conformance-like case (a property marker, a cache path, the plugin's target): its record names its target
TARGET_CASE = """
import pytest

@pytest.mark.property("P1")
@pytest.mark.parametrize("path", ["concat"])
def test_case(target, device, path):
    assert target is not None
"""
NO_ACCELERATOR = pytest.mark.skipif(devices.unavailable_reason("cuda") is None or devices.unavailable_reason("hpu") is None,
                                    reason="this machine has CUDA or HPU: their cases are generated here")


@NO_ACCELERATOR
def test_only_what_can_run_here_is_generated_and_one_line_says_what_was_not(run):
    """Plain `pytest` on a CPU machine: the device cases are the cpu ones only (no cuda or hpu case to
    skip), the targets the built-ins whose package is installed; one summary line says what was left
    out and why."""
    missing = [f"no target {spec} ({why})" for spec in ("optimum-habana", "llm-foundry")
               if (why := parametrize.missing_package(spec))]
    # TARGET_CASE claims P1 and checks no cache (no evidence that one exists): the green-run rule would fail the
    # run (tests/test_green_run.py), which is not what this test is about
    result = run(ONE_CASE_PER_DEVICE + TARGET_CASE, "-k", "not transformers", "-rs", "--allow-no-cache-check")
    text = output(result)
    assert result.ret == pytest.ExitCode.OK, text
    # test_add, test_mul and test_case on cpu with reference; transformers deselected; nothing skipped
    result.assert_outcomes(passed=3, deselected=1)
    (line,) = [line for line in result.outlines if line.startswith("mpt-kv generated no ")]
    assert line.startswith(f"mpt-kv generated no cuda cases (not available here: {devices.unavailable_reason('cuda')}); "
                           f"no hpu cases (not available here: "), line
    assert line.endswith("; " + "; ".join(missing)) if missing else "target" not in line, line


@NO_ACCELERATOR
@pytest.mark.parametrize("args, code, expect", [
    # named: generated, so the gate refuses it before any test (exit 4), as -m hpu (tests/test_plugin_gate.py)
    (("--device", "hpu"), pytest.ExitCode.USAGE_ERROR, "ERROR: --device hpu, but hpu is not available here"),
    # selected under the local opt-out: generated, and its cases skip saying why
    (("-m", "hpu", "--allow-missing-device", "-rs"), pytest.ExitCode.OK, "hpu unavailable: habana_frameworks"),
], ids=["device-hpu", "m-hpu-allow-missing-device"])
def test_a_kind_the_run_asks_for_is_generated_even_where_it_cannot_run(run, args, code, expect):
    result = run(ONE_CASE_PER_DEVICE, *args)
    text = output(result)
    assert result.ret == code, text
    assert expect in text, text
    if code == pytest.ExitCode.OK:
        result.assert_outcomes(skipped=2, deselected=2)  # the hpu cases skip; the cpu ones are deselected


ABSENT = {"cuda": {"reason": "no GPU here", "cards": []}, "hpu": {"reason": "no Gaudi here", "cards": []}}


def gen_config(monkeypatch, survey=ABSENT, required=(), cards=None, **options):
    """A config whose device survey (the controller's, under xdist) and requirements are given."""
    if cards is None:
        monkeypatch.delenv(devices.ENV_CARDS, raising=False)
    else:
        monkeypatch.setenv(devices.ENV_CARDS, cards)
    config = FakeConfig(**options)
    run = run_state(config)
    run.survey, run.required = survey, {k: f"--require-device {k}" for k in required}
    return config


@pytest.mark.parametrize("how, expected, left_out", [
    ({}, ["cpu"], {"cuda": "not available here: no GPU here", "hpu": "not available here: no Gaudi here"}),
    ({"survey": {**ABSENT, "hpu": {"reason": None, "cards": ["0"]}}}, ["cpu", "hpu"],
     {"cuda": "not available here: no GPU here"}),
    ({"required": ["hpu"]}, ["cpu", "hpu"], {"cuda": "not available here: no GPU here"}),  # the gate refuses the run
    ({"markexpr": "hpu", "allow_missing_device": True}, ["cpu", "hpu"],  # selected, not required: its cases skip
     {"cuda": "-m 'hpu' selects none of its cases"}),
    ({"markexpr": "not cuda"}, ["cpu"], {"cuda": "-m 'not cuda' selects none of its cases",
                                         "hpu": "not available here: no Gaudi here"}),
    ({"device": ["cuda"]}, ["cuda"], {}),
    ({"cards": '{"hpu": "1"}'}, ["cpu", "hpu"], {"cuda": "not available here: no GPU here"}),  # the worker's card
    ({"cards": '{"hpu": null}'}, ["cpu", "hpu"], {"cuda": "not available here: no GPU here"}),  # none left: it fails
], ids=["absent", "available", "required", "selected-allow-missing", "deselected", "named", "card", "no-card-left"])
def test_what_is_generated_per_kind_and_why(monkeypatch, how, expected, left_out):
    config = gen_config(monkeypatch, **how)
    assert parametrize.generated_kinds(config) == expected
    assert parametrize.absent_kinds(config) == left_out


def test_a_builtin_target_not_installed_is_not_generated_unless_named(monkeypatch):
    monkeypatch.setattr(parametrize, "missing_package",
                        lambda spec: "optimum-habana is not installed" if spec == "optimum-habana" else None)
    config = gen_config(monkeypatch)
    assert parametrize.generated_targets(config) == ["reference", "transformers", "llm-foundry"]
    assert parametrize.absent_targets(config) == {"optimum-habana": "optimum-habana is not installed"}
    named = gen_config(monkeypatch, target=["optimum-habana"])  # named: generated, and it fails (never skips)
    assert parametrize.generated_targets(named) == ["reference", "transformers", "optimum-habana", "llm-foundry"]


class Lines:
    def __init__(self):
        self.lines = []

    def write_line(self, line, **markup):
        self.lines.append(line)


def test_the_summary_line_names_what_was_left_out_where_the_run_had_such_cases(monkeypatch):
    monkeypatch.setattr(parametrize, "missing_package",
                        lambda spec: "optimum-habana is not installed" if spec == "optimum-habana" else None)
    config = gen_config(monkeypatch)
    for results, line in [
        ([], None),  # no device case: nothing to say
        ([{"kinds": ["cpu"], "nodeid": "t"}], "mpt-kv generated no cuda cases (not available here: no GPU here); no hpu "
                                               "cases (not available here: no Gaudi here)"),
        ([{"kinds": ["cpu"], "target": "reference"}], "mpt-kv generated no cuda cases (not available here: no GPU here); "
         "no hpu cases (not available here: no Gaudi here); no target optimum-habana (optimum-habana is not installed)"),
    ]:
        tw = Lines()
        parametrize.summary(tw, config, results)
        assert tw.lines == ([line] if line else []), tw.lines


# --- the family cases: the run's devices and dtypes, as the MPT cases (docs/gate.md rows 79-82) ----------------------

FAMILY_ONLY = ("--pyargs", "mpt_kv.conformance.test_families", "--only-targets", "--target", "transformers")


@NO_ACCELERATOR
def test_m_cpu_selects_the_family_cases_in_both_dtypes_with_ids_that_name_them(run):
    """`-m cpu` selected none of the family cases (they were parametrized on "cpu" and float32 with no
    device marker): a cpu gate dropped the zoo. Now the plugin gives them `device` with its marker and
    `dtype`, as it gives the MPT cases, and the id says both; --dtype selects among them."""
    result = run("", *FAMILY_ONLY, "--collect-only", "-q", "-m", "cpu")  # (its gate fails: nothing ran)
    ids = [line for line in result.outlines if "::test_family[" in line]
    assert ids, output(result)
    params = [line.split("[", 1)[1] for line in ids]
    assert all(p.startswith(("cpu-fp32-family-", "cpu-bf16-family-")) for p in params), params[:5]
    assert any(p.startswith("cpu-bf16-") for p in params) and any(p.startswith("cpu-fp32-") for p in params)
    assert "cpu-bf16-family-P1/concat-transformers[sdpa]/gpt2/mha]" in params, params[:5]
    bf16 = run("", *FAMILY_ONLY, "--collect-only", "-q", "-m", "cpu", "--dtype", "bf16")
    assert {line.split("[", 1)[1][:9] for line in bf16.outlines if "::test_family[" in line} == {"cpu-bf16-"}


GPT2_ON_HPU = "family-P1/concat-transformers[sdpa]/gpt2/mha or family-memory/concat-transformers[sdpa]/gpt2/mha"


def test_m_hpu_runs_family_cases_on_the_hpu_in_bf16_and_the_gate_counts_them(run, pytester):
    """`pytest -m hpu` on a Gaudi runner ran no family case (no hpu marker): none of optimum-habana's ports
    ran on the HPU. On the simulated HPU (tests/fakes/hpu) `-m hpu` selects the family cases and runs them
    on the hpu device in bf16; with only family cases selected, the gate's required-device rule is met by
    them (and fails when they all fail: the broken HPU)."""
    report = pytester.path / "report.json"
    result = run("", *FAMILY_ONLY, "-m", "hpu", "--dtype", "bf16", "-k", GPT2_ON_HPU, "--mpt-kv-report", str(report),
                 fakes=["hpu"], MPT_KV_HYPOTHESIS_PROFILE="ci")
    text = output(result)
    assert result.ret == pytest.ExitCode.OK, text
    result.assert_outcomes(passed=2)
    import json

    data = json.loads(report.read_text())
    cases = [(r["device"], r["dtype"], r["kinds"], r["check"], r["outcome"]) for r in data["results"]]
    assert sorted(cases) == [("hpu", "bfloat16", ["hpu"], "family-P1/concat", "passed"),
                             ("hpu", "bfloat16", ["hpu"], "family-memory/concat", "passed")], cases
    # the family reach records carry the device and dtype they ran on
    knobs = [r["knobs"] for r in data["reach"] if r["check"].startswith("family-")]
    assert knobs and {(k.get("device"), k.get("dtype")) for k in knobs if "family" in k} == {("hpu", "bfloat16")}
    broken = run("", *FAMILY_ONLY, "-m", "hpu", "--dtype", "bf16", "-k", GPT2_ON_HPU, fakes=["hpu"],
                 MPT_KV_FAKE_HPU="broken", MPT_KV_HYPOTHESIS_PROFILE="ci")
    assert broken.ret == pytest.ExitCode.TESTS_FAILED, output(broken)
    assert "no hpu case passed: 2 of the 2 hpu cases failed" in output(broken), output(broken)
