"""Known failures (mpt_kv/plugin/known_failures.py, mpt_kv/findings/entries.py; docs/gate.md
rows 17-19): an entry xfails only the PropertyFailure its pattern names, an entry that matches
nothing fails the run under --strict-known-failures, a malformed file is one usage error."""

from __future__ import annotations

import json
import re
import sys

import pytest

import mpt_kv.plugin
from mpt_kv.plugin import known_failures
from mpt_kv.plugin.state import run_state
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.findings import entries as KF

from plugin_testing import FakeConfig, output, subprocess_runner

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env): pytest in a fresh subprocess (plugin_testing)."""
    return subprocess_runner(pytester, monkeypatch)


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


def test_strict_known_failures_makes_an_entry_that_matched_nothing_an_error(known_file, monkeypatch):
    config = FakeConfig(strict_known_failures=False)
    run = run_state(config)
    run.required = {}
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


def test_an_entry_about_a_builtin_target_not_installed_here_is_not_unmatched(tmp_path, monkeypatch):
    """optimum-habana's cases are not generated where it is not installed: an entry about it (with no
    `when` that would keep it from applying) has no case here to match, as for a target the run leaves
    out; where it is installed, the same entry matching nothing is unmatched (an error under strict)."""
    from mpt_kv.plugin import parametrize

    path = tmp_path / "known.json"
    path.write_text(json.dumps([{**ENTRY, "target": "optimum-habana"}]))

    def config_where(missing):
        monkeypatch.setattr(parametrize, "missing_package", lambda spec: missing if spec == "optimum-habana" else None)
        config = FakeConfig()
        run = run_state(config)
        run.known, run.known_cases, run.known_covered = KF.load(path), True, set()
        return config

    assert known_failures.unmatched(config_where("optimum-habana is not installed")) == []
    assert [e.index for e in known_failures.unmatched(config_where(None))] == [0]


DTYPE_CASES = """
import pytest
from mpt_kv.checks.compare import PropertyFailure

@pytest.mark.property("P3")
@pytest.mark.parametrize("path", ["concat"])
def test_case(target, device, dtype, path):
    if str(dtype) == "torch.bfloat16":  # a finding one precision shows (a bf16 model's keys cached in fp32)
        raise PropertyFailure("P3: layer 0 cached key (1, 1, 1, 4) is a view of mixed_qkv (1, 1, 12)")
"""


def test_an_entry_with_a_dtype_or_device_applies_to_those_cases_only(run, tmp_path):
    """An entry that names a dtype xfails that dtype's case and leaves the other dtype's alone (without
    the field the fp32 case would be XPASS(strict)); a run that leaves its dtype out (--dtype) or never
    generates its device has no case of it to match: not unmatched under --strict-known-failures."""
    path = tmp_path / "known.json"
    path.write_text(json.dumps([{**ENTRY, "dtype": "bfloat16"}, {**ENTRY, "device": "hpu", "dtype": "float32"}]))
    common = ("--only-targets", "--target", "reference", "--strict-known-failures", "--allow-no-cache-check", "-rxX")
    result = run(DTYPE_CASES, *common, MPT_KV_KNOWN_FAILURES=str(path))
    text = output(result)
    assert result.ret == pytest.ExitCode.OK, text
    result.assert_outcomes(passed=1, xfailed=1)
    assert "XFAIL test_gated.py::test_case[cpu-reference-bf16-concat] - known failure of this project (known.json), " \
           "entry 0 (reference P3 concat bfloat16)" in text, text
    assert "1 entries are about built-in targets this run does not run, or dtypes or devices it leaves out (hpu)" \
        in text, text
    fp32 = run(DTYPE_CASES, *common, "--dtype", "fp32", MPT_KV_KNOWN_FAILURES=str(path))
    assert fp32.ret == pytest.ExitCode.OK, output(fp32)
    fp32.assert_outcomes(passed=1)
    assert "2 entries are about built-in targets this run does not run, or dtypes or devices it leaves out " \
           "(bfloat16, hpu)" in output(fp32), output(fp32)


SEVERAL_CASES = """
import pytest
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.errors import Failures

VIEW = PropertyFailure("P3: layer 0 cached key (1, 1, 1, 4) is a view of mixed_qkv (1, 1, 12)")
SHARED = PropertyFailure("P3: layer 0 cached value (1, 1, 1, 4) shares storage with layer 1's")

@pytest.mark.property("P3")
@pytest.mark.parametrize("path", ["concat"])
@pytest.mark.parametrize("what", ["both", "view_only", "with_another"])
def test_case(target, device, path, what):
    raise {"both": Failures([VIEW, SHARED]), "view_only": VIEW,
           "with_another": Failures([VIEW, PropertyFailure("P3: layer 1 cached key pins 64 bytes")])}[what]
"""


def test_several_entries_of_a_case_xfail_it_only_when_each_names_one_of_its_failures(run, tmp_path):
    """The plugin's side of `known_verdict`: two independent failures, two entries: xfail; one of the two gone:
    XPASS naming the entry that did not happen; a failure neither names: the case fails."""
    path = tmp_path / "known.json"
    path.write_text(json.dumps([ENTRY, {**ENTRY, "pattern": "shares storage with layer 1", "reason": "test: shared"}]))
    result = run(SEVERAL_CASES, "--only-targets", "--target", "reference", "--device", "cpu", "--dtype", "fp32",
                 "-rxX", "--allow-no-cache-check", MPT_KV_KNOWN_FAILURES=str(path))
    text = output(result)
    result.assert_outcomes(xfailed=1, failed=2)
    assert "XFAIL test_gated.py::test_case[cpu-reference-both-concat] - known failure of this project " \
           "(known.json), entry 0" in text and "| known failure of this project (known.json), entry 1" in text, text
    assert "[XPASS(strict)] the case failed, but not as these entries say (its other failures are known): known " \
           "failure of this project (known.json) entry 1 (reference P3 concat) did not happen" in text, text
    assert "this failure (or one of its independent failures) is not such a one, so the case fails" in text, text


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
    (json.dumps([{**ENTRY, "dtypes": ["bf16"]}]), "entry 0 (reference P3): unknown field(s) ['dtypes']"),
    (json.dumps([{**ENTRY, "dtype": "bf16"}]), "entry 0 (reference P3): 'dtype' 'bf16': expected one of ('float32', "
                                               "'bfloat16')"),
    (json.dumps([{**ENTRY, "device": "gpu"}]), "entry 0 (reference P3): 'device' 'gpu': expected one of ('cpu', "
                                               "'cuda', 'hpu')"),
    (json.dumps([{k: v for k, v in ENTRY.items() if k != "pattern"}]), "entry 0 (reference P3): missing field(s) "
                                                                       "['pattern']"),
    (json.dumps([{**ENTRY, "when": {"transformers": "<<4.56"}}]), "'when' transformers: '<<4.56' is not a version "
                                                                  "specifier"),
    (json.dumps([{**ENTRY, "pattern": "a(b"}]), "'pattern' 'a(b' is not a regular expression"),
    (json.dumps([{**ENTRY, "pattern": ".*"}]), "matches the empty string"),
    (json.dumps([{**ENTRY, "property": "P9"}]), "unknown property 'P9'"),
    # a family property: an entry about one of the project's family targets (mpt_kv.FamilyModel), whose target
    # names the case "<spec>/<family>/<variant>" (was, before a project's file could hold one: "unknown property")
    (json.dumps([{**ENTRY, "property": "family-P3"}]), "entry 0 (reference family-P3): a family entry's target is "
                                                       "'<spec>/<family>/<variant>'"),
    (json.dumps([{**ENTRY, "target": "mypkg:build/mistral/gqa", "property": "family-P3", "bucket": True}]),
     "unknown field(s) ['bucket']"),
    (json.dumps([{**ENTRY, "target": "mypkg:build/mistral/gqa", "property": "family-P3", "path": "static+bucket"}]),
     "unknown path 'static+bucket'"),
    (json.dumps([{**ENTRY, "path": "paged"}]), "unknown path 'paged'"),
    (json.dumps([{**ENTRY, "bucket": "yes"}]), "'bucket' must be a bool"),
    (json.dumps([ENTRY, "P3"]), "entry 1: expected an object, got str"),
    # issue 38: was accepted without a word
    (json.dumps([{**ENTRY, "repro": "transformers-mpt-kv-views-typo"}]),
     "entry 0 (reference P3): 'repro' 'transformers-mpt-kv-views-typo' names no repro of `python -m mpt_kv findings "
     "--repro DIR` (closest: transformers-mpt-alibi-kv-views"),
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
    entry = KF.mpt_entry(ENTRY, 0, "f.json")
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


# --- an expected failure's traceback (known_failures.brief_traceback) ----------------------------------------------
# pytest would format every frame of an xfail's traceback from source, which nobody reads; any other
# failure keeps its whole traceback.

DEEP = """
import pytest

def deep(n, exc):
    if n == 0:
        raise exc("the message")
    deep(n - 1, exc)

@pytest.mark.xfail(raises=ValueError, strict=True, reason="known")
def test_expected():
    deep(5, ValueError)

@pytest.mark.xfail(raises=ValueError, strict=True, reason="known")
def test_another_failure():
    deep(5, KeyError)

def test_plain_failure():
    deep(5, ValueError)
"""


def test_only_an_expected_failure_has_a_one_line_traceback(pytester):
    pytester.makepyfile(DEEP)
    reports = {r.nodeid.split("::")[-1]: r for r in pytester.inline_run("-p", "no:cacheprovider").getreports(
        "pytest_runtest_logreport") if r.when == "call"}
    expected = reports["test_expected"]
    assert hasattr(expected, "wasxfail") and str(expected.longrepr) == "ValueError: the message"
    for name in ("test_another_failure", "test_plain_failure"):  # not the expected failure: the whole traceback
        text = str(reports[name].longrepr)
        assert reports[name].failed and text.count("in deep") >= 5, (name, text)
