"""The Markdown summary of a run (mpt_kv/plugin/markdown.py), for a CI job summary or a PR comment:
the verdict first, every failed cell with what it says and the command that reruns it, known
failures collapsed, the matrix collapsed below."""

from __future__ import annotations

from importlib.metadata import version

from mpt_kv.plugin.markdown import judged_by, render
from plugin_testing import HANG_S

MPT_KV = version("mpt-kv")  # this checkout's, as installed (pip install -e)

NODE = "test_properties.py::test_property[cpu-{t}-fp32-{c}]"


def case(target, check, outcome, message=None, dtype="float32"):
    r = {"target": target, "device": "cpu", "dtype": dtype, "property": check.split("/")[0], "check": check,
         "path": "concat", "outcome": outcome, "nodeid": NODE.format(t=target, c=check)}
    return {**r, "message": message} if message else r


RESULTS = [
    case("reference", "P1/concat", "passed"),
    case("mypkg:build", "P3/concat", "failed", "mpt_kv.checks.compare.PropertyFailure: P3 cache aliasing after step "
         "prefill: layer 0 key (2, 2, 5, 8) and layer 0 value (2, 2, 5, 8) are views of layer 0's mixed_qkv | x"),
    case("mypkg:build", "memory/concat", "error", "TypeError: forward() got an unexpected keyword 'token_idx'"),
    case("transformers", "P0/alibi-bias-max-16", "xfail", "known failure: MptModel.forward builds ALiBi without "
         "alibi_bias_max (transformers models/mpt/modeling_mpt.py:320)"),
]


def test_the_verdict_comes_first_then_each_failure_with_its_message_and_rerun_command():
    md = render(RESULTS, [])
    lines = md.splitlines()
    assert lines[0] == "## mpt-kv: FAILED" and lines[2] == "1 error, 1 failed, 1 passed, 1 xfail"
    assert lines[4] == f"Judged by mpt-kv {MPT_KV}."  # a CI log says which mpt-kv judged the run
    (p3,) = [line for line in lines if "| P3/concat |" in line]
    assert "layer 0 key (2, 2, 5, 8) and layer 0 value (2, 2, 5, 8) are views of layer 0's mixed_qkv \\| x" in p3
    assert "PropertyFailure" not in p3  # the message, not the exception's class path
    assert ('`python -m pytest --pyargs mpt_kv.conformance --target mypkg:build --only-targets '
            '-k "[cpu-mypkg:build-fp32-P3/concat]"`') in p3
    (memory,) = [line for line in lines if "| memory/concat |" in line]
    assert "| error |" in memory and "unexpected keyword 'token_idx'" in memory
    assert not [line for line in lines if line.startswith("| reference")]  # a pass is not listed
    known = md[md.index("1 known failures"):md.index("</details>")]
    assert "transformers P0/alibi-bias-max-16 (cpu, float32)" in known and "(`models/mpt/modeling_mpt.py:320`)" in known
    assert md.index("<summary>the full matrix</summary>") > md.index("### What broke")


def test_a_gate_failure_fails_a_run_without_failed_cells_and_a_change_is_listed():
    passing = [case("mypkg:build", "P1/concat", "passed"), case("mypkg:build", "P2/static", "xfail", "known")]
    assert render(passing, []).startswith("## mpt-kv: passed")
    md = render(passing, ["target mypkg:build: no cache property passed"])
    assert md.startswith("## mpt-kv: FAILED") and "- **gate:** target mypkg:build: no cache property passed" in md
    stored = [case("mypkg:build", "P1/concat", "passed"), case("mypkg:build", "P2/static", "passed")]
    md = render(passing, [], previous=stored)
    (row,) = [line for line in md.splitlines() if "| P2/static |" in line]
    assert "| xfail (was passed) |" in row and "### What broke or changed" in md


def test_merged_reports_written_by_another_mpt_kv_say_so():
    """`report --markdown` judges with this mpt-kv; a run written by another version is named, with its file."""
    assert judged_by({"cpu.json": MPT_KV, "oh.json": MPT_KV}) == f"Judged by mpt-kv {MPT_KV}."
    assert judged_by({"cpu.json": MPT_KV, "old.json": "0.0.9"}) == \
        f"Judged by mpt-kv {MPT_KV}. The runs: cpu.json by mpt-kv {MPT_KV}, old.json by mpt-kv 0.0.9."


def test_the_plugin_and_report_write_the_summary_with_every_failure(tmp_path):
    """A run of a target that caches views of mixed_qkv: `--mpt-kv-markdown` names each failed case with
    its message and rerun command, and `python -m mpt_kv report --markdown` of its JSON says the same."""
    import json
    import os
    import subprocess
    import sys

    target = "mpt_kv.catalogue.variants:kv_views_of_mixed_qkv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPT_KV_", "PYTEST_")) and k != "CI"}
    env["MPT_KV_HYPOTHESIS_PROFILE"] = "ci"  # the run is not about profiles
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance", "--target", target,
                          "--only-targets", "-m", "cpu", "--dtype", "fp32", "-k", "(P3/concat or P1/concat) and not "
                          "P3/concat/ and not P1/concat/ and not ops-", "-q",
                          "-p", "no:cacheprovider", "--mpt-kv-report", "r.json", "--mpt-kv-markdown", "reports/summary.md"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S, env=env)
    assert run.returncode == 1, run.stdout[-2000:]
    assert f" mpt-kv conformance (mpt-kv {MPT_KV}) " in run.stdout, run.stdout[-2000:]  # the matrix's title
    assert json.loads((tmp_path / "r.json").read_text())["mpt_kv_version"] == MPT_KV
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert sorted(r["check"] for r in results) == ["P1/concat", "P3/concat"], results  # the drawn cases alone
    failed = [r for r in results if r["outcome"] == "failed"]
    assert failed
    merged = subprocess.run([sys.executable, "-m", "mpt_kv", "report", "r.json", "--markdown", "merged/merged.md"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S)
    assert merged.returncode == 1, merged.stderr
    for name in ("reports/summary.md", "merged/merged.md"):  # their folders made, as --junitxml makes its own
        md = (tmp_path / name).read_text()
        assert md.startswith("## mpt-kv: FAILED") and f"\nJudged by mpt-kv {MPT_KV}.\n" in md, md[:200]
        for r in failed:
            (row,) = [line for line in md.splitlines() if f"-k \"[{r['nodeid'].split('[')[1]}\"" in line]
            assert "views of layer 0's mixed_qkv" in row or "mixed_qkv" in row, row
