"""`python -m mpt_kv devicecheck` (mpt_kv/cli/devicecheck.py): its dry run on CPU from mpt-kv's wheel, its
graph step on the fake GPU (tests/fakes/cuda), time limits and budget, usage errors before any work,
which targets it picks up, the summary beside the seed PR's figures, and transformers 4.55.4 from a
carried folder."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from mpt_kv import versions
from mpt_kv.cli import devicecheck as D

from plugin_testing import FAKES, ROOT

TINY = ["--device", "cpu", "--model", "tiny", "--config", "1,4,2"]
# the suite steps narrowed to the drawn P1 cases of the static path (a cache check: the gate needs one per target)
NARROW = ["-k", "P1/static and fp32 and not bucket-128 and not max-seq-len and not long and not head-dim"]


def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def statuses(out) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary(out)["steps"]}


def test_the_dry_run_on_cpu_from_the_wheel(wheel_venv, tmp_path):
    """The whole command from mpt-kv's wheel, outside the repository: every step runs and passes, the
    ones that do not apply here say why, and the summary holds each target's cases and the bench rows."""
    out = tmp_path / "dry"
    run = subprocess.run([str(wheel_venv.python), "-m", "mpt_kv", "devicecheck", "--out", str(out), *TINY, *NARROW],
                         cwd=tmp_path, env=wheel_venv.env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = statuses(out)
    assert {k: v for k, v in got.items() if not v.startswith("not installed")} == {
        "graphs": "passed", "bench": "passed", "suite-reference": "passed", "suite-transformers": "passed"}, got
    assert got["bench-legacy"].startswith("not installed: no --legacy-transformers DIR"), got
    data = summary(out)
    steps = {s["name"]: s for s in data["steps"]}
    assert steps["graphs"]["results"][0] == "reference: 1 passed", steps["graphs"]
    assert re.fullmatch(r"reference: \d+ passed", steps["suite-reference"]["results"][0]), steps["suite-reference"]
    labels = {r["label"] for r in data["bench"]}
    assert labels == {"reference/concat", "reference/static", "transformers/concat", "transformers/static",
                      "kv_views_of_mixed_qkv (variant)/concat"} - (
        {"transformers/static"} if versions.transformers_major() < 5 else set()), labels
    md = (out / "summary.md").read_text()
    assert "PASSED in" in md and "| graphs | passed |" in md and "## The seed table on this device" in md
    assert (out / "graphs.log").read_text().startswith("$ ")  # each step's command heads its log


def test_on_the_fake_gpu_the_graph_step_replays_cuda_graphs(tmp_path):
    """--device cuda on the simulated GPU: the static decode step is compiled and replayed from a CUDA graph
    (the check's cuda half), in a `-m cuda` run that the gate requires."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES / "cuda"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "mpt_kv", "devicecheck", "--out", str(out), "--device", "cuda",
                          "--model", "tiny", "--step", "graphs"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert statuses(out)["graphs"] == "passed"
    assert summary(out)["environment"]["gpu"].startswith("fake CUDA")
    report = json.loads((out / "graphs" / "report.json").read_text())
    reference = [r for r in report["results"] if r["target"] == "reference"]
    assert [r["device"] for r in reference] == ["cuda"] and reference[0]["outcome"] == "passed"
    assert any("captured as one CUDA graph" in n for n in reference[0]["notes"]), reference


def test_a_step_past_its_limit_is_killed_and_reported(tmp_path, capsys):
    out = tmp_path / "slow"
    assert D.main(["--out", str(out), *TINY, "--step", "graphs", "--timeout", "graphs=2"]) == 1
    got = statuses(out)
    assert got["graphs"] == "timed out after 2 s", got
    assert "| graphs | timed out after 2 s |" in capsys.readouterr().out


def test_a_spent_budget_leaves_the_rest_not_run_and_fails(tmp_path):
    out = tmp_path / "budget"
    assert D.main(["--out", str(out), *TINY, "--step", "bench", "--budget", "1"]) == 1
    assert statuses(out)["bench"] == "not run: the 1 s budget was spent"
    # its own earlier output: a rerun writes there again (a folder of other files is refused: below)
    assert D.main(["--out", str(out), *TINY, "--step", "bench", "--budget", "1"]) == 1


def test_a_folder_of_other_files_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        D.main(["--out", str(tmp_path), *TINY])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args,message", [
    (["--device", "cuda"], r"--device cuda is not available here: torch\.cuda\.is_available\(\) is False"),
    (["--device", "cpu", "--model", "gpt-9"], r"--model 'gpt-9': expected one of tiny, small, mpt-7b, mpt-30b"),
    (["--device", "cpu", "--timeout", "warp=3"], r"--timeout 'warp=3': expected STEP=SECONDS, STEP one of graphs, "
                                                 r"bench, suite, bench-legacy"),
    (["--device", "cpu", "--legacy-transformers", "/no/such/folder"], r"--legacy-transformers /no/such/folder: not a "
                                                                      r"folder"),
    (["--device", "cpu", "--budget", "0"], r"--budget 0: must be >= 1"),
])
def test_bad_input_is_a_usage_error_before_any_work(tmp_path, capsys, args, message):
    if args[:2] == ["--device", "cuda"] and D.devices.unavailable_reason("cuda") is None:
        pytest.skip("this machine has a GPU")
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        D.main(["--out", str(out), *args])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def plan_of(**over) -> list[D.Step]:
    a = argparse.Namespace(device="cuda", model="mpt-7b", config=None, legacy_transformers=None, k=None, step=None,
                           timeouts=dict(D.TIMEOUTS))
    vars(a).update(over)
    return D.plan(a, ROOT / "never-written")


def test_the_plan_at_mpt_7b_on_a_gpu():
    steps = {s.name: s for s in plan_of()}
    bench = " ".join(steps["bench"].command)
    assert "--model mpt-7b" in bench and "--config 128,128,128 --config 2,1024,1024" in bench
    assert f"--target reference --target transformers --target {D.VIEWS} --skip {D.VIEWS}/static" in bench
    graphs = " ".join(steps["graphs"].command)
    assert "run --device cuda -m cuda --target reference --target transformers --only-targets -k graph-capture" in graphs
    suite = " ".join(steps["suite-reference"].command)
    assert "run --device cuda -m cuda --target reference --only-targets -k not graph-capture" in suite
    assert steps["bench-legacy"].status.startswith("not installed: no --legacy-transformers DIR")


def test_graph_capture_runs_on_the_targets_that_declare_static_shapes(monkeypatch):
    """A target without a static path has no static decode step to capture: listed with its own reason (not a
    failure), left out of the graphs run, whose gate then needs no opt-out (refused under CI=true anyway)."""
    monkeypatch.setattr(D, "static_path_missing", lambda spec, device: "no StaticCache for MPT" if spec ==
                        "transformers" else None)
    steps = {s.name: s for s in plan_of()}
    graphs = " ".join(steps["graphs"].command)
    assert "--target reference --only-targets" in graphs and "transformers" not in graphs
    assert "--allow-no-cache-check" not in graphs
    assert steps["graphs-transformers"].status == "not applicable: no static path: no StaticCache for MPT"
    assert steps["graphs-transformers"].ok


def test_llm_foundry_is_picked_up_where_it_is_a_builtin_and_installed(monkeypatch):
    """No dependency on llm-foundry's code: its built-in target when this mpt-kv has one and the package is
    installed (its attn_impl flash factory with it), "not installed" with the reason otherwise."""
    steps = {s.name: s for s in plan_of()}
    if versions.missing("llm-foundry") if "llm-foundry" in versions.BUILTIN else True:
        assert steps["suite-llm-foundry"].status.startswith("not installed: ")
        assert steps["suite-llm-foundry-flash"].status.startswith("not installed: ")
    monkeypatch.setattr(D, "builtin_installed", lambda name: None)
    monkeypatch.setattr(D, "foundry_flash", lambda: None)
    steps = {s.name: s for s in plan_of()}
    assert "--target llm-foundry --only-targets" in " ".join(steps["suite-llm-foundry"].command)
    assert f"--target {D.FOUNDRY_FLASH} --only-targets" in " ".join(steps["suite-llm-foundry-flash"].command)
    assert f"--target llm-foundry --target {D.FOUNDRY_FLASH} --only-targets" in " ".join(steps["graphs"].command)


def test_the_legacy_step_puts_its_folder_first_on_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    steps = {s.name: s for s in plan_of(legacy_transformers=str(tmp_path))}
    legacy = steps["bench-legacy"]
    assert legacy.status == "not run" and "--target transformers --path concat" in " ".join(legacy.command)
    assert legacy.env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), "/somewhere/else"])


def test_the_summary_puts_our_rows_beside_the_seed_prs(tmp_path):
    GiB = 2**30
    row = dict(target="reference", path="static", batch=128, max_input=128, max_new=128, throughput=5000.0,
               allocated=20 * GiB, max_allocated=30 * GiB, analytic_min=29 * GiB)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench.json").write_text(json.dumps({"meta": {"complete": False}, "rows": [row]}))
    a = argparse.Namespace(device="cuda", budget=470)
    code = D.summarize(a, tmp_path, {"gpu": "NVIDIA H200"}, [D.Step("bench", ["x"], 1, status="passed")], 12.0,
                       ["python", "-m", "mpt_kv", "devicecheck"])
    assert code == 0
    md = (tmp_path / "summary.md").read_text()
    assert ("| seed PR, Gaudi, before | 128, 128, 128 | 2900 | 37.28 | 64.39 | - |\n"
            "| seed PR, Gaudi, after | 128, 128, 128 | 4803 | 29.28 | 48.39 | - |\n"
            "| reference/static | 128, 128, 128 | 5000 | 20.00 | 30.00 | 29.00 |") in md
    assert "partial: the bench ran out of time" in md


def carry_command() -> str:
    """docs/bench.md's command that builds the folder of transformers 4.55.4 (its first `pip install --no-deps
    --target`)."""
    text = (ROOT / "docs" / "bench.md").read_text()
    return next(line.strip() for line in text.splitlines() if line.strip().startswith("pip install --no-deps --target"))


@pytest.mark.sweep
def test_the_legacy_step_runs_transformers_455_from_the_documented_carry(tmp_path):
    """The folder docs/bench.md says to carry, made with its command (from the package index), then the step:
    transformers 4.55.4 imports from it beside this environment's newer one and benches its concat path."""
    command = carry_command().replace("legacy", str(tmp_path / "legacy")).split()
    # as from a plain shell: tox's PIP_CONSTRAINT pins this env's transformers 5.x, which the carried 4.55.4 is not
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    done = subprocess.run([sys.executable, "-m", *command[:1], *command[1:]], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert D.main(["--out", str(out), *TINY, "--step", "bench-legacy", "--legacy-transformers",
                   str(tmp_path / "legacy")]) == 0
    assert statuses(out)["bench-legacy"] == "passed"
    bench = json.loads((out / "bench-legacy" / "bench.json").read_text())
    assert bench["meta"]["transformers"] == "4.55.4"
    assert [r["path"] for r in bench["rows"]] == ["concat"]
    assert summary(out)["environment"]["legacy"].startswith("4.55.4 0.")
