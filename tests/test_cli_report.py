"""`python -m mpt_kv report`: one conformance matrix from the JSON reports of several
environments (the main job runs the default env and the optimum-habana env)."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from mpt_kv.cli import report


def result(target, prop, outcome, path="concat", version="", **more):
    r = {"target": target, "device": "cpu", "dtype": "float32", "property": prop, "outcome": outcome, "path": path}
    return {**r, **({"target_version": version} if version else {}), **more}


def write(tmp_path, name, results, **more):
    path = tmp_path / name
    path.write_text(json.dumps({"results": results, "hypothesis_profile": "ci", "absent_devices": {},
                                "environment": {"python": "3.11", "transformers": name}, **more}))
    return path


@pytest.fixture
def two_envs(tmp_path):
    """The default env (optimum-habana not installed: skipped) and the optimum-habana env."""
    cpu = write(tmp_path, "cpu.json", [
        result("reference", "P1", "passed"), result("transformers", "P1", "passed", version="transformers 5.24"),
        result("optimum-habana", "P1", "skipped")])
    oh = write(tmp_path, "oh.json", [
        result("optimum-habana", "P1", "passed", version="optimum-habana 1.21, transformers 4.55"),
        result("optimum-habana", "P1", "xfail", path="static", bucket=4,
               version="optimum-habana 1.21, transformers 4.55")])
    return cpu, oh


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ("reference", "transformers", "optimum-habana")]


def test_one_matrix_with_every_target_from_the_environment_that_ran_it(two_envs, tmp_path, capsys):
    merged = tmp_path / "merged.json"
    assert report.main([*map(str, two_envs), "--json", str(merged)]) == 0
    out = capsys.readouterr().out
    assert out.count("mpt-kv conformance") == 1
    mine = version("mpt-kv")  # the mpt-kv that judged the merge, in the title and the merged report
    assert f" mpt-kv conformance (mpt-kv {mine}) " in out.splitlines()[0], out
    assert json.loads(merged.read_text())["mpt_kv_version"] == mine
    assert rows(out) == [
        ["reference", "cpu", "float32", "concat", "-", "passed", "-", "-", "-", "-", "-"],
        ["optimum-habana", "1.21", "(transformers", "4.55)", "cpu", "float32", "concat", "-", "passed", "-", "-", "-", "-", "-"],
        ["optimum-habana", "1.21", "(transformers", "4.55)", "cpu", "float32", "static+bucket4", "-", "xfail", "-", "-", "-", "-",
         "-"],
        ["transformers", "5.24", "cpu", "float32", "concat", "-", "passed", "-", "-", "-", "-", "-"]], out
    assert "skipped" not in out  # the default env's skip of optimum-habana gave way to its run
    assert len(json.loads(merged.read_text())["results"]) == 4


@pytest.mark.parametrize("outcome", ["failed", "error", "XPASS"])
def test_a_failed_errored_or_unexpectedly_passing_case_fails_the_report(two_envs, tmp_path, outcome, capsys):
    bad = write(tmp_path, "bad.json", [result("mine:build", "P3", outcome)])
    assert report.main([*map(str, two_envs), str(bad)]) == 1
    assert f"mine:build cpu float32 concat - - - {outcome} -" in " ".join(capsys.readouterr().out.split())


def test_reports_without_results_are_not_a_pass(tmp_path, capsys):
    assert report.main([str(write(tmp_path, "empty.json", []))]) == 1
    assert "nothing ran" in capsys.readouterr().err


def exit_code_and_error(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        report.main([str(a) for a in argv])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("content,what", [
    ("[]", "is not an mpt-kv report (no 'results' list)"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "cannot read {path}: UnicodeDecodeError"),
    ("{not json", "cannot read {path}: JSONDecodeError"),
    (json.dumps({"results": [result("reference", "P1", "passed"), {"target": "reference", "outcome": "passed"}]}),
     "{path}: result 1 has no 'property'"),
    (json.dumps({"results": ["P1"]}), "{path}: result 0 has no 'target' or 'property' or 'outcome'"),
    (None, "cannot read {path}: FileNotFoundError"),
])
def test_a_file_that_is_not_a_report_is_an_error_naming_it(tmp_path, capsys, content, what):
    """Exit 2 (as the help says) with one line naming the file: never a KeyError or a
    UnicodeDecodeError traceback."""
    path = tmp_path / "x.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    code, err = exit_code_and_error(capsys, path)
    assert code == 2 and what.format(path=path) in err and "Traceback" not in err, err


@pytest.mark.parametrize("json_arg, why", [("{dir}", "is a folder"), ("", "an empty path")])
def test_a_json_path_that_cannot_be_written_is_refused_before_any_work(two_envs, tmp_path, capsys, monkeypatch,
                                                                      json_arg, why):
    monkeypatch.setattr(report, "load", lambda path: pytest.fail("the work started"))
    code, err = exit_code_and_error(capsys, *two_envs, "--json", json_arg.format(dir=tmp_path))
    assert code == 2 and f"--json {json_arg.format(dir=tmp_path)!r}: " in err and why in err, err


def test_a_report_whose_conformance_cases_all_skipped_fails_unless_every_run_allowed_it(tmp_path, capsys):
    """A target that declares every device unsupported: 'N skipped', and the report must not pass."""
    cases = [result("mine:build", "P1", "unsupported"), result("mine:build", "P0", "skipped")]
    assert report.main([str(write(tmp_path, "none.json", cases))]) == 1
    assert ("2 conformance cases were reported and none ran (1 skipped, 1 unsupported): a run that checked nothing "
            "must not look green") in capsys.readouterr().err
    allowed = write(tmp_path, "allowed.json", cases, allow_missing_device=True)
    assert report.main([str(allowed)]) == 0
    assert report.main([str(allowed), str(write(tmp_path, "none.json", cases))]) == 1  # one run did not allow it


def test_reach_is_concatenated_across_reports(two_envs, tmp_path):
    cpu, oh = two_envs
    for path, reach in ((cpu, [{"check": "P1/static", "knobs": {"n_layers": 2}}]), (oh, [{"check": "P2/static", "knobs": {"n_layers": 1}}])):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "reach": reach}))
    merged = tmp_path / "merged.json"
    assert report.main([str(cpu), str(oh), "--json", str(merged)]) == 0
    assert json.loads(merged.read_text())["reach"] == [{"check": "P1/static", "knobs": {"n_layers": 2}},
                                                       {"check": "P2/static", "knobs": {"n_layers": 1}}]


def test_a_target_run_in_both_envs_is_a_row_per_version_and_each_known_failure_a_line(tmp_path, capsys):
    """transformers' families run in the default env (5.24) and under optimum-habana's transformers
    (4.55): a row each, and every xfail cell's finding named once under the matrix."""
    view = ("known upstream failure, entry 0 (transformers/mpt/alibi family-P3): transformers <4.56 caches the "
            "prefill's K/V as the model hands them")
    cpu = write(tmp_path, "cpu.json", [result("transformers/mpt/alibi", "family-P3", "passed",
                                              version="transformers 5.24")])
    oh = write(tmp_path, "oh.json", [
        result("transformers/mpt/alibi", "family-P3", "xfail", version="transformers 4.55", message=view,
               upstream="transformers 4.55.4 cache_utils.py:99-100"),
        result("transformers/mpt/alibi", "family-memory", "xfail", version="transformers 4.55",
               message=view.replace("family-P3", "family-memory").replace("entry 0", "entry 1"),
               upstream="transformers 4.55.4 cache_utils.py:99-100")])
    assert report.main([str(cpu), str(oh)]) == 0
    out = capsys.readouterr().out
    labels = [line.split(" cpu ")[0] for line in out.splitlines() if line.startswith("transformers/mpt/alibi")]
    assert labels == ["transformers/mpt/alibi (transformers 4.55)", "transformers/mpt/alibi (transformers 5.24)"], out
    found = [line for line in out.splitlines() if line.startswith("  xfail ")]
    assert found == ["  xfail transformers/mpt/alibi (transformers 4.55) family-P3/concat, family-memory/concat "
                     "(2 cases): transformers <4.56 caches the prefill's K/V as the model hands them "
                     "[transformers 4.55.4 cache_utils.py:99-100]"], out
