"""`python -m mpt_kv report`: one conformance matrix from the JSON reports of several
environments (the main job runs the default env and the optimum-habana env)."""

from __future__ import annotations

import json

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


def test_a_file_that_is_not_a_report_is_an_error_naming_it(tmp_path):
    (tmp_path / "x.json").write_text("[]")
    with pytest.raises(SystemExit, match=r"x.json is not an mpt-kv report"):
        report.main([str(tmp_path / "x.json")])
