"""`python -m mpt_kv devicecheck` (mpt_kv/cli/devicecheck.py): its dry run on CPU from mpt-kv's wheel, its
graph step on the fake GPU (tests/fakes/cuda), time limits and budget (on a step that never ends and a fake
clock: no verdict here depends on how busy the machine is), usage errors before any work, a step that did
not run never a pass, which targets it picks up, the summary beside the seed PR's figures, and transformers
4.55.4 from a carried folder."""

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

from plugin_testing import FAKES, ROOT, HANG_S

TINY = ["--device", "cpu", "--model", "tiny", "--config", "1,4,2"]
# the suite steps narrowed to the drawn P1 cases of the static path (a cache check: the gate needs one per target)
NARROW = ["-k", "P1/static and fp32 and not bucket-128 and not max-seq-len and not long and not head-dim"]
# the steps' limits and the budget are the device lease's, a feature tested below on a fake clock: a run that
# must pass gets limits no loaded machine reaches (a hang still ends at the subprocess's HANG_S)
NO_LIMITS = ["--budget", str(10 * HANG_S), *[x for step in D.TIMEOUTS for x in ("--timeout", f"{step}={HANG_S}")]]


def summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def statuses(out) -> dict[str, str]:
    return {s["name"]: s["status"] for s in summary(out)["steps"]}


def test_the_dry_run_on_cpu_from_the_wheel(wheel_venv, tmp_path):
    """The whole command from mpt-kv's wheel, outside the repository: every step runs and passes, the
    ones that do not apply here say why, and the summary holds each target's cases and the bench rows."""
    out = tmp_path / "dry"
    run = subprocess.run([str(wheel_venv.python), "-m", "mpt_kv", "devicecheck", "--out", str(out), *TINY, *NARROW,
                          *NO_LIMITS],
                         cwd=tmp_path, env=wheel_venv.env(), capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = statuses(out)
    assert {k: v for k, v in got.items() if not v.startswith(D.NOT_HERE)} == {
        "graphs": "passed", "bench": "passed", "suite-reference": "passed", "suite-transformers": "passed"}, got
    assert got["bench-legacy"].startswith(f"{D.NOT_HERE}: no --legacy-transformers DIR"), got
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
    assert "; not run here: " in md and "bench-legacy" in md.split("; not run here: ")[1].splitlines()[0], md
    assert (out / "graphs.log").read_text().startswith("$ ")  # each step's command heads its log


def test_on_the_fake_gpu_the_graph_step_replays_cuda_graphs(tmp_path):
    """--device cuda on the simulated GPU: the static decode step is compiled and replayed from a CUDA graph
    (the check's cuda half), in a `-m cuda` run that the gate requires."""
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES / "cuda"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "mpt_kv", "devicecheck", "--out", str(out), "--device", "cuda",
                          "--model", "tiny", "--step", "graphs", *NO_LIMITS], env=env, capture_output=True, text=True,
                         timeout=HANG_S)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert statuses(out)["graphs"] == "passed"
    assert summary(out)["environment"]["gpu"].startswith("fake CUDA")
    report = json.loads((out / "graphs" / "report.json").read_text())
    reference = [r for r in report["results"] if r["target"] == "reference"]
    assert [r["device"] for r in reference] == ["cuda"] and reference[0]["outcome"] == "passed"
    assert any("captured as one CUDA graph" in n for n in reference[0]["notes"]), reference


NEVER_ENDS = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(3600)']); time.sleep(3600)"]


def test_a_step_past_its_limit_is_killed_and_reported(tmp_path, capsys, monkeypatch):
    """A step that never ends (and its child) past a 1 s limit: killed with its process group, reported so,
    the run failed. No machine is fast enough to finish it: the verdict is the limit's, not the load's."""
    plan = D.plan
    monkeypatch.setattr(D, "plan", lambda a, out: [D.Step("graphs", NEVER_ENDS, a.timeouts["graphs"]) if s.name ==
                                                   "graphs" else s for s in plan(a, out)])
    out = tmp_path / "slow"
    assert D.main(["--out", str(out), *TINY, "--step", "graphs", "--timeout", "graphs=1"]) == 1
    got = statuses(out)
    assert got["graphs"] == "timed out after 1 s", got
    assert "| graphs | timed out after 1 s |" in capsys.readouterr().out
    assert "FAILED" in (out / "summary.md").read_text()


def test_each_step_gets_its_limit_or_what_is_left_of_the_budget(tmp_path, monkeypatch):
    """The limits on a fake clock: each step runs under min(its limit, what the budget has left), and a step
    with under 5 s left is not run (and fails the run) instead of starting to be killed at once."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(D.time, "monotonic", lambda: clock["now"])
    given = {}

    def run_step(step, log, limit):  # each step "takes" 100 s of the fake clock and passes
        given[step.name] = limit
        clock["now"] += 100
        step.status, step.seconds = "passed", 100.0

    monkeypatch.setattr(D, "run_step", run_step)
    monkeypatch.setattr(D, "environment", lambda a: {"device": a.device})
    out = tmp_path / "budget"
    code = D.main(["--out", str(out), *TINY, "--budget", "290", "--timeout", "bench=150"])
    # graphs 45 s (its own limit), bench 150 of 190 left, suite-reference 55 of 90, suite-transformers none of
    # the -10 left (not run)
    assert given == {"graphs": 45, "bench": 150, "suite-reference": 55}, given
    assert statuses(out)["suite-transformers"] == "not run: the 290 s budget was spent"
    assert code == 1


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
    # a step asked for that cannot run here (was: "PASSED", bench-legacy "not installed", exit 0)
    (["--device", "cpu", "--model", "tiny", "--step", "bench-legacy"], r"--step bench-legacy: bench-legacy cannot run "
                                                                     r"here \(not run: not installed here: no "
                                                                     r"--legacy-transformers DIR"),
    (["--device", "cpu", "--model", "tiny", "--config", "1,40,40"], r"--config 1,40,40: max input 40 \+ max new 40 = 80 "
                                                                   r"\(config B=1 in=40 new=40\) exceeds max_seq_len 64"),
    (["--device", "cpu", "--model", "tiny", "--config", "0,4,4"], r"--config 0,4,4: --batch-size 0 \(config B=0 in=4 "
                                                                 r"new=4\): must be >= 1"),
    (["--device", "cpu", "--legacy-transformers", ""], r"argument --legacy-transformers: an empty path \(''\) names "
                                                       r"no file or folder"),
    (["--device", "cpu", "--config", "banana"], r"--config 'banana': expected BATCH,MAX_INPUT,MAX_NEW, e\.g\. 4,128,128"),
], ids=["cuda-absent", "model", "timeout-step", "legacy-not-a-folder", "budget-0", "step-that-cannot-run",
        "config-too-long", "config-batch-0", "legacy-empty", "config-banana"])
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
                           timeouts=dict(D.TIMEOUTS), gaudi_before=None, gaudi_after=None)
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
    assert steps["bench-legacy"].status.startswith(f"{D.NOT_HERE}: no --legacy-transformers DIR")


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
        assert steps["suite-llm-foundry"].status.startswith(f"{D.NOT_HERE}: ")
        assert steps["suite-llm-foundry-flash"].status.startswith(f"{D.NOT_HERE}: ")
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


def test_the_seed_gaudi_steps_bench_optimum_habanas_mpt_as_the_seed_ran_it_from_each_folder(tmp_path, monkeypatch):
    """seed-gaudi-before/after: the seed's four rows at MPT-7B, the optimum-habana target with the seed's recipe
    (bf16, the static path), each release's folder first on its step's path; without the folders, "not
    installed here" with what to carry (docs/bench.md)."""
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    steps = {s.name: s for s in plan_of(gaudi_before=str(tmp_path / "old"), gaudi_after=str(tmp_path / "new"))}
    for when, folder in (("before", "old"), ("after", "new")):
        seed = steps[f"seed-gaudi-{when}"]
        command = " ".join(seed.command)
        assert seed.status == "not run" and seed.group == "seed-gaudi" and seed.limit == D.TIMEOUTS["seed-gaudi"]
        assert ("--model mpt-7b --repeat 1 --warmup 0 --quiet --config 128,128,128 --config 16,128,1024 --config "
                "2,1024,1024 --config 16,1024,1024 --target mpt_kv.targets.gaudi:seed --path static --dtype bf16") in command
        assert seed.env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / folder), "/somewhere/else"])
    missing = {s.name: s for s in plan_of()}["seed-gaudi-before"]
    assert missing.status.startswith(f"{D.NOT_HERE}: no --gaudi-before DIR (optimum-habana 1.12.1 with transformers "
                                     "4.40.2")
    assert {s.name: s for s in plan_of()}["bench-legacy"].group == "bench-legacy"


def test_seed_gaudi_without_its_folders_is_a_usage_error_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        D.main(["--out", str(out), *TINY, "--step", "seed-gaudi", "--gaudi-before", str(tmp_path)])
    assert e.value.code == 2
    assert "--step seed-gaudi: seed-gaudi-after cannot run here (not run: not installed here: no --gaudi-after DIR" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        D.main(["--out", str(out), *TINY, "--gaudi-after", str(tmp_path / "nope")])
    assert "--gaudi-after " + str(tmp_path / "nope") + ": not a folder" in capsys.readouterr().err
    assert not out.exists()


def test_the_summary_labels_each_seed_gaudi_row_by_the_release_its_folder_held(tmp_path):
    row = dict(target=D.SEED_TARGET, path="static", batch=16, max_input=128, max_new=1024, throughput=900.0,
               allocated=23 * 2**30, max_allocated=34 * 2**30, analytic_min=33 * 2**30)
    for when, release in (("before", "1.12.1"), ("after", "1.21.2")):
        (tmp_path / f"seed-gaudi-{when}").mkdir()
        (tmp_path / f"seed-gaudi-{when}" / "bench.json").write_text(json.dumps(
            {"meta": {"complete": True, "optimum-habana": release}, "rows": [row]}))
    a = argparse.Namespace(device="cuda", budget=470)
    D.summarize(a, tmp_path, {}, [D.Step("seed-gaudi-before", ["x"], 1, status="passed")], 1.0, ["devicecheck"])
    md = (tmp_path / "summary.md").read_text()
    assert ("| seed PR, Gaudi, before | 16, 128, 1024 | 624 | 26.55 | 41.79 | - |\n"
            "| seed PR, Gaudi, after | 16, 128, 1024 | 1215 | 23.04 | 33.77 | - |\n"
            "| optimum-habana 1.12.1 (seed recipe)/static | 16, 128, 1024 | 900 | 23.00 | 34.00 | 33.00 |\n"
            "| optimum-habana 1.21.2 (seed recipe)/static | 16, 128, 1024 | 900 | 23.00 | 34.00 | 33.00 |") in md, md


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


@pytest.mark.parametrize("requested, statuses_, problem", [
    # --step bench-legacy where it cannot run (its folder not given): was "PASSED", exit 0
    (["bench-legacy"], {"bench-legacy": None}, "bench-legacy was asked for (--step bench-legacy) and did not run: "
                                               "not run: not installed here: no --legacy-transformers DIR"),
    # every step left out or not here: nothing ran (was "PASSED", exit 0)
    (None, {"graphs": "not run: not among --step", "bench-legacy": None}, "no step ran: a device check that ran "
                                                                           "nothing is not a pass"),
], ids=["requested-step-not-run", "nothing-ran"])
def test_a_step_that_did_not_run_is_never_a_pass(tmp_path, requested, statuses_, problem):
    """The summary's verdict (what `main` refuses before any work where it can know): a step asked for with
    --step of which nothing ran, or a check where no step ran, is FAILED with the reason, exit 1."""
    planned = {s.name: s for s in plan_of(device="cpu", model="tiny")}
    steps = [planned[name] if status is None else D.Step(name, [], 0, status=status)
             for name, status in statuses_.items()]
    a = argparse.Namespace(device="cpu", budget=470, step=requested)
    assert D.summarize(a, tmp_path, {}, steps, 1.0, ["python", "-m", "mpt_kv", "devicecheck"]) == 1
    md = (tmp_path / "summary.md").read_text()
    assert "FAILED in 1 s" in md and f"- {problem}" in md, md
    assert summary(tmp_path)["passed"] is False


def test_a_step_not_installed_here_is_named_in_a_passing_verdict(tmp_path):
    """A step whose prerequisite is missing, not asked for by name, leaves the check passing (the dry run on a
    machine without llm-foundry), and the verdict line names it as not run: never silently green."""
    planned = {s.name: s for s in plan_of(device="cpu", model="tiny")}
    steps = [D.Step("graphs", ["x"], 1, status="passed"), planned["bench-legacy"]]
    a = argparse.Namespace(device="cpu", budget=470, step=None)
    assert D.summarize(a, tmp_path, {}, steps, 1.0, ["python", "-m", "mpt_kv", "devicecheck"]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "PASSED in 1 s (budget 470 s); not run here: bench-legacy (their rows below say why)" in md, md


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
                          timeout=HANG_S, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    assert D.main(["--out", str(out), *TINY, "--step", "bench-legacy", "--legacy-transformers",
                   str(tmp_path / "legacy")]) == 0
    assert statuses(out)["bench-legacy"] == "passed"
    bench = json.loads((out / "bench-legacy" / "bench.json").read_text())
    assert bench["meta"]["transformers"] == "4.55.4"
    assert [r["path"] for r in bench["rows"]] == ["concat"]
    assert summary(out)["environment"]["legacy"].startswith("4.55.4 0.")


def gaudi_carry_commands() -> list[str]:
    """docs/bench.md's commands that build the seed-gaudi folders where an index is reachable (its `pip install
    --no-deps --target gaudi-...` lines)."""
    text = (ROOT / "docs" / "bench.md").read_text()
    return [line.strip() for line in text.splitlines() if line.strip().startswith("pip install --no-deps --target gaudi-")]


@pytest.mark.device_prep
def test_the_prepared_seed_gaudi_run_dry_runs_on_cpu_from_the_documented_folders(tmp_path):
    """The device run prepared in docs/bench.md (optimum-habana 1.12.1 and 1.21.2's MPT, each with its
    transformers, carried as folders), dry-run on this CPU: both steps pass, each row is labelled with its
    release, and 1.12.1's static cache, views of mixed_qkv, holds more than 1.21.2's at every row."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}  # as from a plain shell (docs/bench.md)
    folders = []
    for command in gaudi_carry_commands():
        folder = command.split("--target ")[1].split()[0]
        folders.append(tmp_path / folder)
        done = subprocess.run([sys.executable, "-m", *command.replace(folder, str(tmp_path / folder)).split()],
                              capture_output=True, text=True, timeout=HANG_S, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert [f.name for f in folders] == ["gaudi-1.12.1", "gaudi-1.21.2"]
    out = tmp_path / "out"
    assert D.main(["--out", str(out), *TINY[:4], "--step", "seed-gaudi", "--gaudi-before", str(folders[0]),
                   "--gaudi-after", str(folders[1]), *NO_LIMITS]) == 0
    rows = {(r["label"], r["batch"], r["max_input"]): r for r in summary(out)["bench"]}
    assert summary(out)["environment"]["gaudi-before"] == "1.12.1 4.40.2"
    for batch, length in ((4, 16), (2, 32)):  # the tiny model's rows (SMALL_ROWS)
        before = rows[("optimum-habana 1.12.1 (seed recipe)/static", batch, length)]
        after = rows[("optimum-habana 1.21.2 (seed recipe)/static", batch, length)]
        assert before["allocated"] > after["allocated"], (before, after)

