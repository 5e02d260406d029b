"""`python -m mpt_kv sweep`: which releases, their pins from their own metadata, and the table
(worst outcome per cell, the first and last release of each finding) on hand-made reports; then
one real sweep over two transformers releases (two envs, cached between runs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from mpt_kv import releases
from mpt_kv.cli import sweep
from mpt_kv.findings import sweep as repro_sweep
from plugin_testing import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def release(package, version):
    return sweep.Release(package, Version(version))


def result(check, outcome, nodeid=None, **extra):
    prop, _, rest = check.partition("/")
    path = rest.split("/")[0].split("+")[0] or None
    return {"target": "optimum-habana", "device": "cpu", "dtype": "float32", "check": check, "property": prop,
            "path": path, "outcome": outcome, "nodeid": nodeid or f"test_x.py::test[{check}]", **extra}


def row(tmp_path, rel, results, failures=()):
    """A release's row: its report JSON and its run log with pytest's -rfE lines."""
    report, log = tmp_path / f"{rel.slug}.json", tmp_path / f"{rel.slug}.log"
    report.write_text(json.dumps({"results": results}))
    log.write_text("".join(f"FAILED {nodeid} - {message}\n" for nodeid, message in failures))
    return sweep.Row(rel, pins="transformers 4.40.2", report=report, log=log)


P3_VIEWS = ("mpt_kv.checks.compare.PropertyFailure: P3 cache aliasing after step prefill: layer 0 key (1, 1, 1, 4) "
            "are views of layer 0's mixed_qkv [target=optimum-habana, device=cpu]")


def releases_with_the_seed_bug(tmp_path):
    rows = []
    for version, buggy in [("1.12.1", True), ("1.11.1", True), ("1.14.0", False), ("1.13.2", True)]:
        rel = release("optimum-habana", version)
        p3 = result("P3/concat", "failed" if buggy else "passed")
        mem = [result("memory/concat/B16-in8-new8", "passed"),
               result("memory/concat/B2-in8-new24", "failed" if buggy else "passed", nodeid="m2")]
        rows.append(row(tmp_path, rel, [result("P0", "passed"), p3, *mem, result("P1/static+bucket4", "unsupported")],
                        [(p3["nodeid"], P3_VIEWS), ("m2", "PropertyFailure: memory: after prefill, 16384 bytes too many")]
                        if buggy else []))
    rows.append(sweep.Row(release("optimum-habana", "1.6.1"), problem="install: pip install transformers==4.28.1 failed: "
                                                                        "ERROR: no matching distribution"))
    return rows


def test_each_finding_has_its_first_and_last_release(tmp_path):
    text = "\n".join(sweep.table_lines(releases_with_the_seed_bug(tmp_path)))
    assert ("| F1 | P3/concat | failed | optimum-habana 1.11.1 | optimum-habana 1.13.2 | 3 | P3 cache aliasing after "
            "step prefill: layer 0 key (1, 1, 1, 4) are views of layer 0's mixed_qkv |") in text, text
    assert ("| F2 | memory/concat | failed | optimum-habana 1.11.1 | optimum-habana 1.13.2 | 3 | memory: after prefill, "
            "16384 bytes too many |") in text, text
    # the cells: a memory path is its worst config; rows in release order; the install failure says why
    assert "| 1.13.2 | transformers 4.40.2 | pass | unsupported | FAIL F1 | FAIL F2 |" in text, text
    assert "| 1.14.0 | transformers 4.40.2 | pass | unsupported | pass | pass |" in text, text
    lines = text.splitlines()
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(f"| {v} |")) for v in ("1.6.1", "1.11.1", "1.12.1",
                                                                                         "1.13.2", "1.14.0")]
    assert order == sorted(order)
    assert "| 1.6.1 | - | **not run**: install: pip install transformers==4.28.1 failed: ERROR: no matching" in text


def test_a_failure_without_its_message_still_names_the_log(tmp_path):
    rel = release("transformers", "4.40.2")
    text = "\n".join(sweep.table_lines([row(tmp_path, rel, [result("P3/concat", "error", nodeid="n1")])]))
    assert "| F1 | P3/concat | error | transformers 4.40.2 | transformers 4.40.2 | 1 | error: see transformers-4.40.2.log (n1) |" \
        in text, text


def test_ranges_expand_from_the_listing_and_per_minor_keeps_the_newest_patch():
    listing = {"optimum-habana": [Version(v) for v in ("1.11.0", "1.11.1", "1.12.0", "1.12.1", "1.13.0rc1", "1.22.0")]}
    specs = [sweep.parse_spec("optimum-habana>=1.11,<=1.21.2"), sweep.parse_spec("transformers==4.40.2")]
    got = sweep.expand(specs, per_minor=True, listing=listing.get)
    assert [str(r) for r in got] == ["optimum-habana 1.11.1", "optimum-habana 1.12.1", "transformers 4.40.2"]
    assert len(sweep.expand(specs[:1], per_minor=False, listing=listing.get)) == 4


def wheel(tmp_path, requires):
    path = tmp_path / "optimum_habana-1.12.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("optimum_habana-1.12.1.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: optimum-habana\nVersion: 1.12.1\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    return path


@pytest.mark.parametrize("requires, pin", [
    (["transformers <4.41.0,>=4.40.0", "sentence-transformers ==3.0.1; extra == 'tests'"], "transformers==4.40.2"),
    (["transformers >=4.32.0"], "transformers==4.32.0"),  # open-ended: the version it was written for
])
def test_the_transformers_pin_comes_from_the_release_metadata(tmp_path, requires, pin):
    listing = {"transformers": [Version(v) for v in ("4.39.3", "4.40.0", "4.40.2", "4.41.0", "5.24.0")]}.get
    assert releases.transformers_pin(release("optimum-habana", "1.12.1"), wheel(tmp_path, requires), listing) == pin


def test_a_release_without_a_transformers_requirement_says_so(tmp_path):
    with pytest.raises(sweep.SweepError, match="has no Requires-Dist on transformers"):
        releases.transformers_pin(release("optimum-habana", "1.12.1"), wheel(tmp_path, ["torch"]), lambda p: [])


@pytest.mark.parametrize("argv, message", [
    (["numpy==2.0"], "the sweep knows llm-foundry, optimum-habana, transformers, not 'numpy'"),
    (["transformers"], "give a release or a range"),
    (["transformers==5.24.0", "-p", "0"], "-p 0: between 1 and the"),
    (["transformers==5.24.0", "--timeout", "0"], "--timeout 0.0: give a positive number of seconds"),
])
def test_bad_arguments_are_usage_errors_before_any_work(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        sweep.main([*argv, "--envs", str(tmp_path / "envs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "envs").exists()


@pytest.mark.slow
@pytest.mark.sweep  # builds two environments from the package index: tests/conftest.py runs it first
@pytest.mark.skipif(importlib.util.find_spec("optimum") is not None,
                    reason="the sweep builds its own envs: tox's optimum-habana env would only repeat tox -e cpu's run")
def test_sweep_two_transformers_releases(tmp_path):
    """The real thing, kept cheap: two releases, P3/concat only, envs cached between runs (in
    $MPT_KV_SWEEP_ENVS or ~/.cache/mpt-kv/sweep-envs). 4.55.4 keeps the first K/V as views of
    mixed_qkv (a known failure: xfail), 5.24.0 copies (pass)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mpt_kv", "sweep", "transformers==4.55.4", "transformers==5.24.0",
                           "-k", "P3/concat", "--timeout", str(HANG_S), "--out", str(out)],
                          capture_output=True, text=True, timeout=3 * HANG_S, cwd=tmp_path,  # two releases
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PIP_CONSTRAINT": str(ROOT / "constraints" / "cpu.txt")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "table.md").read_text()
    assert "| 4.55.4 | transformers 4.55.4, tokenizers 0.21.4 | xfail |" in table, table
    assert "| 5.24.0 | transformers 5.24.0, tokenizers 0.23.3 | pass |" in table, table


def test_a_target_that_does_not_build_is_the_rows_problem():
    log = ("target reference       ok\n"
           "target optimum-habana  does not build on cpu: TargetUnavailable: optimum-habana 1.7.0 has no MPT: "
           "/x/optimum/habana/transformers/models/mpt/modeling_mpt.py does not exist\n")
    assert sweep.target_build_problem(log, "optimum-habana") == (
        "the target does not build: TargetUnavailable: optimum-habana 1.7.0 has no MPT: "
        "/x/optimum/habana/transformers/models/mpt/modeling_mpt.py does not exist")
    assert sweep.target_build_problem(log.replace("does not build on cpu: TargetUnavailable", "ok"), "optimum-habana") is None


def test_render_makes_the_table_again_from_a_finished_sweep(tmp_path, capsys):
    rows = releases_with_the_seed_bug(tmp_path)
    (tmp_path / "optimum-habana-1.7.0.log").write_text(
        "target optimum-habana  does not build on cpu: TargetUnavailable: optimum-habana 1.7.0 has no MPT\n")
    (tmp_path / "optimum-habana-1.7.0.json").write_text(json.dumps({"results": [result("P0", "error")]}))
    listed = [{"package": r.release.package, "version": str(r.release.version), "pins": r.pins, "problem": r.problem,
               "seconds": 1.0} for r in rows] + [{"package": "optimum-habana", "version": "1.7.0", "pins": "",
                                                 "problem": None, "seconds": 1.0}]
    (tmp_path / "rows.json").write_text(json.dumps({"made": "Made by hand.", "rows": listed}))
    assert sweep.main(["--render", "--out", str(tmp_path)]) == 1  # rows that did not run: exit 1
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("Made by hand.\n") and "| F1 | P3/concat | failed | optimum-habana 1.11.1 |" in table
    assert "| 1.7.0 | - | **not run**: the target does not build: TargetUnavailable: optimum-habana 1.7.0 has no MPT" \
        in table, table


def test_another_message_in_the_same_check_is_another_finding(tmp_path):
    """1.7.3 and 1.9.0 error on transformers 4.3x's ALiBi for 6 heads, 1.14.0 on its own bf16
    softmax: P0 errors in all three, as two findings; sizes differ within one finding."""
    rows = []
    for version, message in [("1.7.3", "RuntimeError: shape '[1, 6, 1, 1]' is invalid for input of size 8"),
                             ("1.9.0", "RuntimeError: shape '[1, 3, 1, 1]' is invalid for input of size 4"),
                             ("1.14.0", "RuntimeError: expected scalar type BFloat16 but found Float")]:
        rows.append(row(tmp_path, release("optimum-habana", version), [result("P0", "error", nodeid="p0")],
                        [("p0", message)]))
    text = "\n".join(sweep.table_lines(rows))
    assert ("| F1 | P0 | error | optimum-habana 1.7.3 | optimum-habana 1.9.0 | 2 | shape '[1, 6, 1, 1]' is invalid "
            "for input of size 8 |") in text, text
    assert ("| F2 | P0 | error | optimum-habana 1.14.0 | optimum-habana 1.14.0 | 1 | expected scalar type BFloat16 "
            "but found Float |") in text, text
    assert "| 1.9.0 | transformers 4.40.2 | error F1 |" in text and "| 1.14.0 | transformers 4.40.2 | error F2 |" in text


def test_main_runs_the_releases_in_parallel_and_writes_the_table(tmp_path, monkeypatch, capsys):
    """The command's own flow with the env and run steps replaced: -p 2 runs two releases at once,
    every row lands in rows.json and table.md, and a row that did not run makes the exit status 1."""
    import threading

    both_running = threading.Barrier(2, timeout=HANG_S)  # a -p 1 sweep would stop here: BrokenBarrierError

    def fake_run_release(rel, envs, out, base, timeout, run_args, listing=None):
        both_running.wait()
        if rel.version == Version("4.40.2"):
            return sweep.Row(rel, problem="install: pip install transformers==4.40.2 failed: ERROR: offline")
        return row(out, rel, [result("P3/concat", "passed")])

    monkeypatch.setattr(sweep, "base_env", lambda envs, timeout: (envs / "_base" / "venv", "digest"))
    monkeypatch.setattr(sweep, "run_release", fake_run_release)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 2)
    out = tmp_path / "out"
    code = sweep.main(["transformers==4.40.2", "transformers==5.24.0", "-p", "2", "--envs", str(tmp_path / "e"),
                       "--out", str(out)])
    assert code == 1
    table = (out / "table.md").read_text()
    assert "| 5.24.0 | transformers 4.40.2 | pass |" in table and "| 4.40.2 | - | **not run**: install: pip" in table
    assert sorted(r["version"] for r in json.loads((out / "rows.json").read_text())["rows"]) == ["4.40.2", "5.24.0"]


# --- --repros: the findings' standalone repros per release -------------------------------------------

def repro_row(version, codes, package="transformers", problem=None):
    """A release's row of a --repros sweep: slug -> (exit status, the script's last line)."""
    return sweep.Row(release(package, version), pins=f"transformers {version}", problem=problem,
                     repros=None if problem else {slug: (code, f"line {code}") for slug, code in codes.items()})


def test_holds_range_is_the_first_and_last_release_that_exit_1_and_the_first_fixed_after():
    r = [release("transformers", v) for v in ("4.30.2", "4.40.2", "4.45.2", "4.55.4", "4.56.2", "5.0.0")]
    # cannot run (2) before the class exists, holds in 4.45-4.55, fixed (0) from 4.56
    assert repro_sweep.holds_range(list(zip(r, [2, 2, 1, 1, 0, 0]))) == (r[2], r[3], r[4])
    assert repro_sweep.holds_range(list(zip(r, [0, 1, 1, 1, 1, 1]))) == (r[1], r[5], None)  # still holds in the newest
    assert repro_sweep.holds_range(list(zip(r, [0, 0, 0, 0, 0, 2]))) == (None, None, None)  # never holds
    assert repro_sweep.holds_range(list(zip(r, [1, 0, 2, 1, 2, 0]))) == (r[0], r[3], r[5])  # a 2 is neither held nor fixed


def test_the_repro_table_is_finding_by_release_with_notes_for_what_cannot_run():
    rows = [repro_row("4.55.4", {"t-mpt": 1, "t-phi3": 1}), repro_row("4.30.2", {"t-mpt": 1, "t-phi3": 2}),
            repro_row("4.56.2", {"t-mpt": 0, "t-phi3": 0}),
            repro_row("4.40.2", {}, problem="install: pip install transformers==4.40.2 failed: ERROR: offline")]
    rows[1].repros["t-phi3"] = (2, "cannot run the experiment: cannot import name 'Phi3Config'")
    text = "\n".join(repro_sweep.repro_table_lines(rows))
    assert "| finding | 4.30.2 | 4.40.2 | 4.55.4 | 4.56.2 | holds first | holds last | fixed in |" in text, text
    assert "| t-mpt | 1 | - | 1 | 0 | 4.30.2 | 4.55.4 | 4.56.2 |" in text, text
    assert "| t-phi3 | 2a | - | 1 | 0 | 4.55.4 | 4.55.4 | 4.56.2 |" in text, text
    assert "- 2a: cannot run the experiment: cannot import name 'Phi3Config'" in text
    assert "- transformers 4.40.2: **not run**: install: pip install transformers==4.40.2 failed" in text


@pytest.mark.parametrize("argv, message", [
    (["transformers==5.24.0", "--repros", "--render"], "--repros runs the findings' repros, not the conformance "
                                                         "cases: not with --render"),
    (["transformers==5.24.0", "--repros", "-k", "P3"], "not with -k"),
    (["transformers==5.24.0", "--repros", "--dtype", "bf16"], "not with --dtype"),
    (["--repros"], "name the releases"),
])
def test_repros_bad_arguments_are_usage_errors_before_any_work(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        sweep.main([*argv, "--envs", str(tmp_path / "envs"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "envs").exists() and not (tmp_path / "out").exists()


def test_main_repros_runs_each_release_and_a_release_not_built_is_exit_1(tmp_path, monkeypatch, capsys):
    """The --repros flow with the env and script steps replaced: each package's scripts go to its
    releases only; a release that could not be built makes the exit status 1, its row says why."""
    seen = {}

    def fake_run_release_repros(rel, envs, base, timeout, scripts, listing=None):
        seen[str(rel)] = [slug for slug, _ in scripts.get(rel.package, [])]
        if rel.version == Version("4.40.2"):
            return sweep.Row(rel, problem="install: pip install transformers==4.40.2 failed: ERROR: offline")
        return repro_row(str(rel.version), {slug: 1 for slug in seen[str(rel)]}, package=rel.package)

    monkeypatch.setattr(repro_sweep, "write_repro_scripts", lambda folder: {
        "transformers": [("t-mpt", folder / "t-mpt" / "repro.py")],
        "optimum-habana": [("oh-codegen", folder / "oh-codegen" / "repro.py")]})
    monkeypatch.setattr(repro_sweep, "base_env", lambda envs, timeout: (envs / "_base" / "venv", "digest"))
    monkeypatch.setattr(repro_sweep, "run_release_repros", fake_run_release_repros)
    out = tmp_path / "out"
    code = sweep.main(["transformers==4.40.2", "transformers==5.24.0", "optimum-habana==1.21.2", "--repros",
                       "--envs", str(tmp_path / "e"), "--out", str(out)])
    assert code == 1
    assert seen == {"transformers 4.40.2": ["t-mpt"], "transformers 5.24.0": ["t-mpt"],
                    "optimum-habana 1.21.2": ["oh-codegen"]}
    table = (out / "repros.md").read_text()
    assert "| t-mpt | - | 1 | 5.24.0 | 5.24.0 | - |" in table and "| oh-codegen | 1 | 1.21.2 | 1.21.2 | - |" in table
    assert json.loads((out / "repros.json").read_text())["rows"][0]["repros"] == {"oh-codegen": [1, "line 1"]}


def test_a_repros_cannot_run_note_names_the_exception_not_the_pointer_to_it():
    output = ("torch 2.13.0, transformers 4.45.2\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
              "RuntimeError: expected scalar type BFloat16 but found Float\n"
              "cannot run the experiment (see the error above)\n")
    assert repro_sweep.output_last_line(output) == ("cannot run the experiment: RuntimeError: expected scalar type BFloat16 "
                                              "but found Float")
    assert repro_sweep.output_last_line("cannot run the experiment: cannot import name 'Phi3Config'\n") == (
        "cannot run the experiment: cannot import name 'Phi3Config'")
    assert repro_sweep.output_last_line("") == "(no output)"
    assert repro_sweep.output_last_line("cannot run the experiment: cannot import name 'MptConfig' from 'transformers' "
                                  "(/envs/transformers-4.30.2/venv/lib/transformers/__init__.py)\n") == (
        "cannot run the experiment: cannot import name 'MptConfig' from 'transformers'")
    assert [repro_sweep.note_id(n) for n in (0, 25, 26, 27)] == ["a", "z", "aa", "ab"]


@pytest.mark.parametrize("requires, wanted", [
    (["transformers <4.46.0,>=4.45.2", "optimum", "torch", "accelerate <0.34.0,>=0.33.0", "diffusers ==0.29.2"],
     ["optimum", "accelerate<0.34.0,>=0.33.0"]),
    (["transformers<4.56.0,>=4.55.0", "optimum<2.1.0,>=2.0.0", "accelerate ; extra == 'x'"],
     ["optimum<2.1.0,>=2.0.0"]),
    (["transformers >=4.32.0"], []),
])
def test_an_optimum_habana_env_gets_its_own_optimum_and_accelerate_requirements(tmp_path, requires, wanted):
    assert releases.runtime_requirements(wheel(tmp_path, requires)) == wanted


def test_an_llm_foundry_env_is_its_transformers_pin_its_model_imports_and_the_release_without_deps(tmp_path, monkeypatch):
    """llm-foundry's requirements pin the training stack (composer, torch 2.7): the env holds only the transformers
    its wheel pins (0.18 on write it 'v4.49.0'), the three packages its model files import, and the wheel with --no-deps."""
    artifact = wheel(tmp_path, ["mosaicml[gcs,mlflow]<0.33,>=0.32.1", "transformers<4.52,>=v4.51.0", "torch<2.7.1,>=2.7.0"])
    monkeypatch.setattr(releases, "download", lambda rel, folder, timeout: artifact)
    seen, calls = {}, []

    def ensure_venv(folder, lock, install, timeout):
        seen.update(lock)
        (tmp_path / "venv" / "lib" / "python3" / "site-packages").mkdir(parents=True, exist_ok=True)
        install(tmp_path / "venv", timeout)
        return {"installed": ["transformers==4.51.3"]}

    monkeypatch.setattr(releases, "ensure_venv", ensure_venv)
    monkeypatch.setattr(releases, "pip", lambda venv, args, timeout, what: calls.append(args) or "")
    monkeypatch.setattr(releases, "site_packages", lambda venv: tmp_path / "venv" / "lib" / "python3" / "site-packages")
    listing = lambda p: [Version(v) for v in ("4.49.0", "4.51.0", "4.51.3", "4.52.0")]  # noqa: E731
    _, pins = releases.release_env(release("llm-foundry", "0.22.0"), tmp_path, (tmp_path / "base", "d"), 1e12, listing)
    assert seen["requirements"] == ["transformers==4.51.3", *releases.FOUNDRY_MODEL_IMPORTS] and pins == "transformers 4.51.3"
    assert ["install", "-q", "--no-compile", "--no-deps", str(artifact)] in calls
    assert not [a for a in calls if any("mosaicml" in x or x.startswith("torch") for x in a)]


def test_two_checkouts_get_their_own_env_of_a_release(tmp_path, monkeypatch):
    """The envs folder is shared (~/.cache/mpt-kv/sweep-envs): a second clone's sweep must not rebuild the
    first's env of a release under its running scripts (the lock names the checkout's path)."""
    folders = []

    def ensure_venv(folder, lock, install, timeout):
        folders.append(folder)
        return {"installed": ["transformers==4.55.4"]}

    monkeypatch.setattr(releases, "ensure_venv", ensure_venv)
    for checkout in ("/work/a", "/work/b", "/work/a"):
        monkeypatch.setattr(releases, "SOURCE", Path(checkout))
        releases.release_env(release("transformers", "4.55.4"), tmp_path, (tmp_path / "base", "d"), 1e12)
    assert folders[0] != folders[1] and folders[0] == folders[2], folders
    assert all(f.parent == tmp_path and f.name.startswith("transformers-4.55.4-") for f in folders)


def test_one_checkouts_concurrent_sweeps_build_an_env_once(tmp_path, monkeypatch):
    """Two sweeps of one checkout reaching the same missing env: the second waits on the first's file lock,
    then reuses what it built (without the lock both build, and one rmtree's the other's venv)."""
    import threading
    import time

    builds = []

    def fake_venv(cmd, **kwargs):  # `python -m venv DIR`: the interpreter's file is enough here
        python = Path(cmd[-1]) / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def install(venv, timeout):
        builds.append(venv)
        time.sleep(0.3)  # a pip install: the other sweep arrives meanwhile

    monkeypatch.setattr(releases.subprocess, "run", fake_venv)
    monkeypatch.setattr(releases, "pip", lambda venv, args, timeout, what: "transformers==4.55.4")
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        releases.ensure_venv(tmp_path / "env", {"request": 1}, install, 60))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1, f"built {len(builds)} times"
    assert results[0] == results[1]


def test_an_envs_every_step_is_limited_by_the_callers_timeout_only(tmp_path, monkeypatch):
    """The sweep's --timeout bounds a release's install and run; no step has a fixed limit of its own (a
    `python -m venv` limited to 300 s failed the real sweep test on a loaded machine with 3000 s to spend)."""
    limits = {}

    def fake_venv(cmd, **kwargs):
        limits["venv"] = kwargs["timeout"]
        python = Path(cmd[-1]) / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_pip(venv, args, timeout, what):
        limits[args[0]] = timeout
        return "transformers==4.55.4"

    monkeypatch.setattr(releases.subprocess, "run", fake_venv)
    monkeypatch.setattr(releases, "pip", fake_pip)
    releases.ensure_venv(tmp_path / "env", {"request": 1}, lambda venv, t: limits.setdefault("install", t), 3000)
    assert limits["venv"] == 3000
    assert 2990 < limits["install"] <= 3000 and 2990 < limits["freeze"] <= 3000, limits

    def slow_venv(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(releases.subprocess, "run", slow_venv)
    with pytest.raises(releases.SweepError, match=r"python -m venv: timed out after 3000 s"):
        releases.ensure_venv(tmp_path / "other", {"request": 2}, lambda venv, t: None, 3000)
