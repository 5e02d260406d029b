"""A known-failures pattern names a failure, not any failure (mpt_kv.findings.patterns.
compile_pattern, the one rule of the MPT, families and project files): it requires a literal text
of MIN_LITERAL characters and matches no generic failure line of the suite. Plus: the shipped
files and the docs' snippets meet it and match what the checks really print, and
--strict-known-failures does not call a built-in target that --only-targets left out a typo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mpt_kv.findings import entries as known
from mpt_kv.findings import patterns
from plugin_testing import HANG_S

ROOT = Path(__file__).resolve().parents[1]
VIEWS = "mpt_kv.catalogue.variants:kv_views_of_mixed_qkv"
MPT_ENTRY = {"target": VIEWS, "property": "P3", "path": "concat", "reason": "test: k, v cached as views",
             "pattern": r"are views of layer \d+'s mixed_qkv"}
FAMILY_ENTRY = {k: v for k, v in json.loads(known.FAMILY_FILE.read_text())[0].items()}

# patterns that name no failure: each must be refused (the MPT file, the families' file)
GENERIC = [".", "e", r"\w", "[a-z]", "P3", "error", "failed", "raised RuntimeError", "(a|.)", "mixed_qkv",
           "AssertionError", "Traceback", "(is a view of mixed_qkv|.)", "the target's decode raised",
           r"differ at \d+ of \d+ elements", "NaN/inf appeared", "raised KeyError", "P3 cache aliasing after step",
           "the implementation's prefill raised RuntimeError"]


def write(tmp_path, entries) -> Path:
    path = tmp_path / "known.json"
    path.write_text(json.dumps(entries))
    return path


@pytest.mark.parametrize("pattern", GENERIC)
def test_an_mpt_pattern_that_names_no_failure_is_an_error_naming_the_entry(tmp_path, pattern):
    path = write(tmp_path, [MPT_ENTRY, {**MPT_ENTRY, "pattern": pattern}])
    with pytest.raises(known.KnownFailuresError) as e:
        known.load(path)
    assert str(e.value).startswith(f"known failures file {path}: entry 1 ({VIEWS} P3): 'pattern' {pattern!r} "), e.value


@pytest.mark.parametrize("pattern", GENERIC)
def test_a_family_pattern_that_names_no_failure_is_an_error_naming_the_entry(tmp_path, pattern):
    path = write(tmp_path, [FAMILY_ENTRY, {**FAMILY_ENTRY, "pattern": pattern}])
    with pytest.raises(ValueError) as e:
        known.load_families(path)
    assert str(e.value).startswith(f"family known failures {path}: entry 1: 'pattern' {pattern!r} "), e.value


@pytest.mark.parametrize("pattern,run", [
    (".", 0), ("e", 1), (r"\w", 0), ("[a-z]", 0), ("P3", 2), ("(a|.)", 0), ("mixed_qkv", 9), ("x(ab)?y", 1),
    ("(key|value) \\(", 5), ("ab(cd|efg)hi", 6), ("a{3}bc", 5), ("(?s)abc.*defgh", 5), ("a[.]b", 3),
    (r"raised KeyError: 'input_shape'", 30), (r"(?:x|yy)+z", 2)])
def test_literal_run_is_the_literal_text_every_match_contains(pattern, run):
    assert patterns.literal_run(pattern) == run, f"literal_run({pattern!r}) = {patterns.literal_run(pattern)}, expected {run}"


@pytest.mark.parametrize("file", [known.FILE, ROOT / "examples" / "downstream" / "mpt_kv_known_failures.json"],
                         ids=["targets", "downstream"])
def test_the_shipped_mpt_files_meet_the_rule(file):
    assert known.load(file)


def test_the_shipped_family_file_meets_the_rule():
    assert len(known.load_families()) == len(json.loads(known.FAMILY_FILE.read_text()))


# --- the corpus is what the suite prints -------------------------------------------------------------------

def crash_of_run_op():
    from mpt_kv.checks.programs import Fed, Op, run_op

    class Session:
        def decode(self, tokens):
            raise RuntimeError("boom")

    ctx = types.SimpleNamespace(ctx=lambda **more: more)
    run_op(Session(), Op("decode"), torch.zeros(1, 1, dtype=torch.long), 0, "ops-P1", ctx, Fed())


def crash_of_family_call():
    from mpt_kv.checks.family_driver import call

    def prefill():
        raise KeyError("boom")

    call(types.SimpleNamespace(check="family-P1", ctx=lambda **more: more), "prefill", 0, "prefill", prefill)


def assert_close_of(actual, expected):
    from mpt_kv.checks.compare import Tolerance, assert_close

    return lambda: assert_close(actual, expected, Tolerance(1e-5, 1e-5, ("float32", "logits")), "x", {"step": 0})


@pytest.mark.parametrize("produce", [
    crash_of_run_op, crash_of_family_call, assert_close_of(torch.tensor([1.0, 0.0]), torch.zeros(2)),
    assert_close_of(torch.zeros(2), torch.zeros(3)), assert_close_of(torch.tensor([float("nan"), 0.0]), torch.zeros(2))],
    ids=["run_op crash", "family call crash", "assert_close", "assert_close shape", "assert_close NaN"])
def test_generic_failure_lines_are_what_the_suite_prints(produce):
    from mpt_kv.checks.compare import PropertyFailure

    with pytest.raises(PropertyFailure) as e:
        produce()
    assert str(e.value) in patterns.generic_failures(), f"the suite prints {str(e.value)!r}, not in the corpus"


# --- the docs' snippets -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def p3_message() -> str:
    """What P3 prints for a target that caches views of its fused buffer."""
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.checks.registry import CHECKS
    from mpt_kv.targets import resolve

    with pytest.raises(PropertyFailure) as e:
        CHECKS["P3/concat"](resolve(VIEWS), "cpu", torch.float32)
    return str(e.value)


def doc_entries():
    """Every entry of a ```json block of docs/*.md that has a "pattern"."""
    found = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```json\n(.*?)```", doc.read_text(), re.S):
            data = json.loads(block)
            found += [(doc.name, e) for e in (data if isinstance(data, list) else [data]) if "pattern" in e]
    return found


def test_every_pattern_of_the_docs_is_in_a_json_snippet_the_test_reads():
    written = sum(doc.read_text().count('"pattern":') for doc in (ROOT / "docs").glob("*.md"))
    assert written == len(doc_entries()) > 0, f"{written} '\"pattern\":' in docs/*.md, {len(doc_entries())} read"


@pytest.fixture(scope="module")
def family_p3_message() -> str:
    """What family-P3 prints for a window kept as a slice of the concatenation: examples/own_family's
    planted bug (docs/targets.md, "Known failures of a family target"), on transformers 5.x (its adapter's)."""
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.checks.registry import CHECKS
    from mpt_kv.versions import transformers_major

    if transformers_major() < 5:
        pytest.skip("examples/own_family's adapter reads transformers 5.x's config (the cpu env runs this)")
    sys.path.insert(0, str(ROOT / "examples" / "own_family" / "src"))
    os.environ["OWNGQA_WINDOW_SLICE"] = "1"
    try:
        from owngqa.mpt_kv_target import build

        with pytest.raises(PropertyFailure) as e:
            CHECKS["family-P3/concat"](build, "cpu", torch.float32)
    finally:
        del os.environ["OWNGQA_WINDOW_SLICE"]
        sys.path.remove(str(ROOT / "examples" / "own_family" / "src"))
    return str(e.value)


@pytest.mark.parametrize("doc,entry", doc_entries(), ids=lambda x: x if isinstance(x, str) else x["target"])
def test_a_docs_pattern_meets_the_rule_and_matches_what_p3_prints(doc, entry, request):
    printed = {"P3": "p3_message", "family-P3": "family_p3_message"}
    assert entry["property"] in printed, f"{doc}: an example of {entry['property']}: add what it prints to this test"
    message = request.getfixturevalue(printed[entry["property"]])
    pattern = patterns.compile_pattern(entry["pattern"], lambda what: AssertionError(f"{doc}: {what}"))
    assert pattern.search(message), f"{doc}: /{entry['pattern']}/ does not match what {entry['property']} prints: {message}"


# --- end to end: the plugin ------------------------------------------------------------------------------

def pytest_run(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MPT_KV_", "PYTEST_")) and k != "CI"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                           "mpt_kv.conformance", "-m", "cpu", "--dtype", "fp32", "--only-targets", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
                          env={**clean, "PYTHONPATH": str(ROOT), "MPT_KV_HYPOTHESIS_PROFILE": "ci", **env})


def test_a_match_anything_entry_for_a_target_with_views_is_a_usage_error_not_a_green_run(tmp_path):
    """Was (main 032dcca): the 4 P3 cases of the views variant xfailed through '.', exit 0."""
    path = write(tmp_path, [{**MPT_ENTRY, "pattern": "."}])
    done = pytest_run(tmp_path, "--target", VIEWS, "-k", "P3/concat and not ops-", MPT_KV_KNOWN_FAILURES=str(path))
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert f"known failures file {path}: entry 0 ({VIEWS} P3): 'pattern' '.' requires a literal text" in out, out


CORRECT = "mpt_kv.catalogue.designs:stacked_kv"
ONE_CASE = "P3/static and not bucket and not max-seq and not batch-8 and not ops-"


def test_strict_known_failures_passes_a_correct_run_of_only_its_targets(tmp_path):
    """Was (issue 30): mpt-kv's own entries for its transformers target 'matched no case', exit 1."""
    done = pytest_run(tmp_path, "--target", CORRECT, "--strict-known-failures", "-k", ONE_CASE)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "1 passed" in out, out
    assert "matched no case" not in out and "entries are about built-in targets this run does not run" in out, out


def test_strict_known_failures_still_fails_an_entry_with_a_typo_for_a_target_that_runs(tmp_path):
    path = write(tmp_path, [{**MPT_ENTRY, "target": CORRECT, "check": "P3/concat/bucket-12"}])
    done = pytest_run(tmp_path, "--target", CORRECT, "--strict-known-failures", "-k", ONE_CASE,
                      MPT_KV_KNOWN_FAILURES=str(path))
    out = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert f"entry 0 ({CORRECT} P3/concat/bucket-12 concat) in {path} matched no case of this run: a typo, or its " \
           f"property, path or check is gone (its target '{CORRECT}' runs)" in out, out


# --- parametrize_with_checks: expected_failed_checks takes no pattern --------------------------------------

def test_expected_failed_checks_xfails_a_finding_never_a_crash_the_check_wraps():
    """{check id: reason} names no message: the strict xfail takes a check's finding only, not
    "the target's decode raised RuntimeError: ..." (was: raises=PropertyFailure, which is both)."""
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.checks.registry import parametrize_with_checks

    mark = parametrize_with_checks(["reference"], checks=["P3/concat"], expected_failed_checks={"P3/concat": "why"})
    (xfail,) = [m for m in mark.args[1][0].marks if m.name == "xfail"]
    with pytest.raises(PropertyFailure) as crash:
        crash_of_run_op()
    finding = PropertyFailure("P3 cache aliasing after step prefill: layer 0 key (1, 1, 65, 4) is a view of ...")
    assert isinstance(finding, xfail.kwargs["raises"]), "a finding must satisfy the expected failure"
    assert not isinstance(crash.value, xfail.kwargs["raises"]), f"a crash satisfied it: {crash.value}"
    assert not isinstance(RuntimeError("boom"), xfail.kwargs["raises"])


def test_shipped_entries_are_upstreams_and_a_projects_are_its_own(tmp_path):
    from mpt_kv.findings.known import words_for
    from mpt_kv.findings import entries as known_failures

    shipped = known_failures.load()[0]
    assert words_for(shipped) == ("known upstream failure",
                                  f"upstream fixed it, remove or narrow the entry in {known_failures.FILE}")
    own = tmp_path / "mpt_kv_known_failures.json"
    own.write_text((known_failures.FILE.parent.parent.parent / "examples" / "downstream" /
                    "mpt_kv_known_failures.json").read_text())
    assert words_for(known_failures.load(own)[0]) == (
        "known failure of this project (mpt_kv_known_failures.json)", f"it is fixed, remove or narrow the entry in {own}")


# --- a case with several known failures: each of its independent failures explained by one entry ---------------

def test_each_independent_failure_of_a_case_needs_an_entry_of_its_own(tmp_path):
    """family-ops runs two programs; each one's failure is its own finding. The case is known only when every
    one of them is explained, by any of the case's applying entries (a beam entry must not hide an assisted
    crash)."""
    from mpt_kv.errors import Failures, PropertyFailure

    case = {"target": "transformers/gpt2/mha", "property": "family-ops", "when": {"transformers": ">=4.0"},
            "upstream": "transformers/generation/utils.py:1"}
    beam = {**case, "path": "concat", "reason": "r", "pattern": "reorder raised AttributeError: no _reorder_cache"}
    crop = {**case, "path": "concat", "reason": "r", "pattern": "crop raised AttributeError: 'tuple' has no crop"}
    anywhere = {**case, "reason": "r", "pattern": "prefill raised RuntimeError: a port-wide failure"}
    entries = known.load_families(write(tmp_path, [beam, crop, anywhere]))
    both = Failures([PropertyFailure("family-ops beam step 1: the implementation's reorder raised AttributeError: "
                                     "no _reorder_cache"),
                     PropertyFailure("family-ops assisted step 1: the implementation's crop raised AttributeError: "
                                     "'tuple' has no crop")])
    applying = known.matching("transformers/gpt2/mha", "family-ops", "concat", entries)
    assert [e.pattern.pattern for e in applying] == [beam["pattern"], crop["pattern"], anywhere["pattern"]]
    assert known.explaining(applying, both) == applying[:2]
    assert known.explaining(applying[:1] + applying[2:], both) is None  # no entry explains the crop
    assert known.explaining(applying, Failures([both.exceptions[0], RuntimeError("an adapter's own bug")])) is None
    assert [e.pattern.pattern for e in known.matching("transformers/gpt2/mha", "family-ops", "static", entries)] == [
        anywhere["pattern"]]


def test_an_entry_whose_failure_is_gone_fails_the_case_even_when_another_entry_explains_it(tmp_path):
    """Several entries on one case must not let a stale one linger: the beam crash fixed upstream while the
    assisted crash stays is XPASS for the beam entry (as a pass is for a case's one entry)."""
    from mpt_kv.errors import Failures, PropertyFailure

    case = {"target": "transformers/gpt2/mha", "property": "family-ops", "path": "concat",
            "when": {"transformers": ">=4.0"}, "upstream": "transformers/generation/utils.py:1", "reason": "r"}
    beam = {**case, "pattern": "reorder raised AttributeError: no _reorder_cache"}
    crop = {**case, "pattern": "crop raised AttributeError: 'tuple' has no crop"}
    entries = known.load_families(write(tmp_path, [beam, crop]))
    assisted = PropertyFailure("family-ops assisted step 1: the implementation's crop raised AttributeError: 'tuple' "
                               "has no crop")
    both = Failures([PropertyFailure("family-ops beam step 1: the implementation's reorder raised AttributeError: "
                                     "no _reorder_cache"), assisted])
    assert known.known_verdict(entries, both) == ("known", entries)
    assert known.known_verdict(entries, assisted) == ("stale", entries[:1])  # the beam crash is gone
    assert known.known_verdict(entries, None) == ("pass", entries)
    assert known.known_verdict(entries, PropertyFailure("family-ops assisted prefill logits differ")) == ("unknown", [])
