"""The CLIs refuse bad input before any work (docs/gate.md row 25): bench's memory estimate against
free memory, every output path, killmatrix on an absent device, and the plugin's report path; and (issue
49, one test per class of bad input over every command that takes it) an output that is an input or another
output, a count below its limit, a value not of its form, an input file missing, a folder or not its kind,
a target that cannot run here, an ini value read late."""

from __future__ import annotations

import re

import pytest

from mpt_kv import devices, versions
from mpt_kv.plugin import gate

from plugin_testing import FakeConfig, output, subprocess_runner

pytest_plugins = ["pytester"]


# --- 7. the CLIs: bad input before any work ----------------------------------------------------------------------

def test_bench_refuses_a_config_that_cannot_fit_before_allocating(monkeypatch, capsys):
    from mpt_kv.cli import bench

    monkeypatch.setattr(devices, "available_memory", lambda kind: (8 << 30, "a test's 8 GiB"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "mpt-7b", "--batch-size", "1", "--max-input-tokens", "16", "--max-new-tokens", "16",
                    "--target", "reference", "--path", "static", "--dtype", "bf16", "--out", "/tmp/unused"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    need = bench.memory_needed(bench.model_config("mpt-7b"), bench.BenchConfig(1, 16, 16), 1, ["static"], 2)
    assert need > 12.4 * (1 << 30)  # mpt-7b's bf16 weights alone (6.65e9 parameters)
    assert (f"needs about {need * bench.FIT_MARGIN / (1 << 30):.1f} GiB on cpu (analytic estimate "
            f"{need / (1 << 30):.2f} GiB x 1.3 margin), but only 8.0 GiB is free (a test's 8 GiB)") in err


def test_bench_memory_estimate_counts_every_loaded_target_and_the_concat_copy():
    from mpt_kv.cli import bench
    from mpt_kv.memory import analytic

    cfg, bc = bench.model_config("small"), bench.BenchConfig(4, 128, 128)
    one = bench.memory_needed(cfg, bc, 1, ["static"], 4)
    assert bench.memory_needed(cfg, bc, 3, ["static"], 4) - one == 2 * analytic.weights_bytes(bench.shape_of(cfg), 4)
    assert bench.memory_needed(cfg, bc, 1, ["concat", "static"], 4) - one == \
        analytic.kv_cache_bytes(bench.shape_of(cfg), 4, 256, 4)


@pytest.mark.parametrize("cli,args,message", [
    ("bench", ["--out", "{file}/sub"], "--out {file}/sub: {file}/sub cannot be created: {file} is not a folder"),
    ("killmatrix", ["--markdown", "{file}/x.md"], "--markdown {file}/x.md: {file} exists and is not a folder"),
    ("killmatrix", ["--json", "{dir}"], "--json {dir}: {dir} is a folder, expected a file name"),
    ("killmatrix", ["--jobs", "0"], "--jobs 0: give 1 or more processes"),
    ("run", ["--report", "{file}/r.json"], "--report {file}/r.json: {file} exists and is not a folder"),
])
def test_every_output_path_is_checked_before_the_work_starts(tmp_path, capsys, monkeypatch, cli, args, message):
    import importlib

    file = tmp_path / "a_file"
    file.write_text("")
    fill = lambda s: s.format(file=file, dir=tmp_path)  # noqa: E731
    main = importlib.import_module(f"mpt_kv.cli.{cli}").main
    monkeypatch.setattr("mpt_kv.catalogue.killmatrix.run_matrix", lambda *a: pytest.fail("the work started"))
    with pytest.raises(SystemExit) as e:
        main([fill(a) for a in args])
    assert e.value.code == 2
    assert fill(message) in capsys.readouterr().err


def test_the_plugin_checks_its_report_path_before_collecting(tmp_path):
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(pytest.UsageError, match=re.escape(f"--mpt-kv-report {file}/r.json: {file} exists and is not "
                                                          "a folder")):
        gate.configure(FakeConfig(mpt_kv_report=f"{file}/r.json"))


# --- never overwrite what the user did not name (issue 38) -------------------------------------------------------

EMPTY = "an empty path ('') names no file or folder (it is not the current folder): give one"


@pytest.mark.parametrize("cli,args", [
    ("findings", ["--repro", ""]),  # was: 80 folders written into the current folder, its README.md replaced
    ("findings", ["--check", "--doc", ""]),
    ("bench", ["--out", ""]),
    ("sweep", ["transformers==5.24.0", "--out", ""]),
    ("sweep", ["transformers==5.24.0", "--envs", ""]),
    ("calibrate", ["run", "--target", "reference", "--out", ""]),
    ("killmatrix", ["--markdown", ""]),
    ("killmatrix", ["--json", ""]),
    ("run", ["--report", ""]),
    ("checks", ["--check", "--doc", ""]),
    ("reach", ["--check", "--doc", ""]),
    # issue 49: was `gateprofile --update --out ''` writing the package's own profile, `gateprofile --out ''`
    # and `gatebench --out ''` (the current folder) silent; and every input path read as the current folder
    ("gateprofile", ["--out", ""]),
    ("gateprofile", ["--update", "--out", ""]),
    ("gatebench", ["--out", ""]),
    ("gatebench", ["--transformers-tests", ""]),
    ("devicecheck", ["--out", "dc", "--device", "cpu", "--legacy-transformers", ""]),
    ("report", [""]),
    ("report", ["r.json", "--markdown", "m.md", "--previous", ""]),
    ("reach", [""]),
    ("reach", ["--draw", "ci", "--reference-model", ""]),
    ("calibrate", ["report", ""]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_an_empty_path_is_a_usage_error_everywhere(tmp_path, capsys, monkeypatch, cli, args):
    import importlib

    (tmp_path / "README.md").write_text("the user's own\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mpt_kv.catalogue.killmatrix.run_matrix", lambda *a: pytest.fail("the work started"))
    no_work(monkeypatch)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"mpt_kv.cli.{cli}").main(args)
    assert e.value.code == 2
    assert EMPTY in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]  # nothing written, nothing replaced
    assert (tmp_path / "README.md").read_text() == "the user's own\n"


@pytest.mark.parametrize("option", ["mpt_kv_report", "mpt_kv_markdown"])
def test_the_plugin_refuses_an_empty_report_path(option):
    """Was: `--mpt-kv-markdown ''` exited 0 and wrote nothing."""
    with pytest.raises(pytest.UsageError, match=re.escape(f"--{option.replace('_', '-')} : {EMPTY}")):
        gate.configure(FakeConfig(**{option: ""}))


def test_the_plugin_refuses_an_empty_ceilings_folder():
    """Was: `--ceilings-dir ''` read as not given (the default folder), silently."""
    from mpt_kv.plugin import options

    with pytest.raises(pytest.UsageError, match=re.escape(f"--ceilings-dir '': {EMPTY}")):
        options.check_ceilings_dir(FakeConfig(ceilings_dir=""))


@pytest.mark.parametrize("cli,args", [
    ("findings", ["--repro", "{dir}"]),
    ("bench", ["--out", "{dir}"]),
    ("sweep", ["transformers==5.24.0", "--out", "{dir}"]),
])
def test_a_command_that_writes_a_folder_never_writes_into_one_of_other_files(tmp_path, capsys, monkeypatch, cli, args):
    import importlib

    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "README.md").write_text("the user's own\n")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"mpt_kv.cli.{cli}").main([a.format(dir=folder) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{folder} is a folder of 1 entries (README.md), not an earlier output of this command" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["README.md"]


def test_calibrate_run_never_writes_into_a_folder_of_other_files(tmp_path, capsys):
    from mpt_kv.cli import calibrate

    (tmp_path / "notes.txt").write_text("mine")
    assert calibrate.main(["run", "--target", "reference", "--cases", "1", "--out", str(tmp_path)]) == 2
    assert "is a folder of 1 entries (notes.txt), not an earlier output of this command" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_rerun_may_write_into_its_own_earlier_output_and_nothing_else(tmp_path):
    from mpt_kv.outputs import MARKER, dir_problem, mark_output

    out = tmp_path / "repros"
    assert dir_problem(out, "findings --repro") is None  # new
    out.mkdir()
    assert dir_problem(out, "findings --repro") is None  # empty
    (out / "a-finding").mkdir()
    assert "not an earlier output of this command" in dir_problem(out, "findings --repro")
    mark_output(out, "findings --repro")
    assert dir_problem(out, "findings --repro") is None  # its own output: a rerun replaces it
    assert "is a folder of 2 entries (.mpt-kv-output, a-finding), the output of `findings --repro`" in \
        dir_problem(out, "bench")  # another command's output is not its own
    assert (out / MARKER).read_text() == "findings --repro\n"


@pytest.mark.skipif(devices.unavailable_reason("cuda") is None, reason="this machine has CUDA")
def test_killmatrix_on_a_device_that_is_absent_is_a_usage_error(capsys, monkeypatch):
    from mpt_kv.cli import killmatrix

    monkeypatch.setattr(killmatrix, "run_matrix_in", lambda *a: pytest.fail("the work started"))
    with pytest.raises(SystemExit) as e:
        killmatrix.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda is not available here: torch.cuda.is_available() is False" in capsys.readouterr().err


# --- issue 49: every CLI input, one line before any work or write ----------------------------------------------------
#
# One test per class of bad input, over every command that takes it: the exit status of a usage error (2), one
# line naming the value and its limit, no traceback, and nothing written (the folder the command runs in, with
# the inputs it reads, is as it was: no output folder made first, no input replaced).

REPORT = {"results": [{"target": "reference", "property": "P1", "check": "P1/concat", "outcome": "passed",
                       "device": "cpu"}]}
SPEC = "transformers==5.24.0"


def no_work(monkeypatch):
    """Each command's work, which a refused input must never reach: a call is the test's failure."""
    from mpt_kv.cli import calibrate, devicecheck, gatebench, killmatrix, sweep

    started = lambda *a, **k: pytest.fail("the work started")  # noqa: E731
    for module, name in ((calibrate, "run_case"), (calibrate, "calibrate_quantized"), (calibrate, "measure_compiled"),
                         (devicecheck, "run_step"), (gatebench, "paired"), (killmatrix, "run_matrix_in"),
                         (sweep, "base_env"), (sweep, "expand")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr("mpt_kv.catalogue.gate_profile.compute", started)


def folder_state(folder) -> dict:
    """Every file (with its size and modification time) and folder under `folder`: what a refused command leaves
    (a folder's own time is not compared: the output check writes a probe file in it and removes it)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}


def inputs_in(folder):
    """The files the rows read: a report (r.json, r2.json), a file that is no JSON, a folder, an empty results
    file, a stand-in transformers tree (its MPT test file)."""
    import json

    (folder / "r.json").write_text(json.dumps(REPORT))
    (folder / "r2.json").write_text(json.dumps(REPORT))
    (folder / "notes.txt").write_text("not JSON\n")
    (folder / "a_folder").mkdir()
    (folder / "empty.jsonl").write_text("")
    (folder / "empty_folder").mkdir()
    peer = folder / "transformers" / "tests" / "models" / "mpt" / "test_modeling_mpt.py"
    peer.parent.mkdir(parents=True)
    peer.write_text("def test_nothing():\n    pass\n")


def refused(tmp_path, monkeypatch, capsys, cli: str, args: list[str]) -> str:
    """`python -m mpt_kv CLI ARGS` in a folder of inputs: a usage error (exit 2) before any work that wrote
    nothing; its stderr."""
    import importlib

    inputs_in(tmp_path)
    monkeypatch.chdir(tmp_path)
    no_work(monkeypatch)
    before = folder_state(tmp_path)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"mpt_kv.cli.{cli}").main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err, err
    assert folder_state(tmp_path) == before, "a refused command wrote"
    return err


@pytest.mark.parametrize("cli, args, message", [
    # was: the input report replaced by the Markdown summary (exit 1, the matrix gone)
    ("report", ["r.json", "--markdown", "r.json"], "--markdown r.json is the report r.json, which this run reads: an "
                                                   "output never replaces an input; name another file"),
    ("report", ["r.json", "--json", "r.json"], "--json r.json is the report r.json, which this run reads"),
    ("report", ["r.json", "r2.json", "--markdown", "summary.md", "--previous", "r2.json", "--json", "r2.json"],
     "--json r2.json is the report r2.json, which this run reads"),
    ("report", ["r.json", "--markdown", "r2.json", "--previous", "r2.json"], "--markdown r2.json is --previous r2.json, "
                                                                              "which this run reads"),
    ("report", ["r.json", "--json", "out.json", "--markdown", "out.json"], "--markdown out.json is also --json "
                                                                           "out.json: two outputs never share a file"),
    ("killmatrix", ["--markdown", "m.out", "--json", "m.out"], "--json m.out is also --markdown m.out: two outputs "
                                                               "never share a file"),
    ("sweep", [SPEC, "--out", "same", "--envs", "same"], "--out same is also --envs same: two outputs never share"),
    ("devicecheck", ["--out", "empty_folder", "--device", "cpu", "--legacy-transformers", "empty_folder"],
     "--out empty_folder is --legacy-transformers empty_folder, which this run reads"),
    ("gatebench", ["--out", "transformers", "--transformers-tests", "transformers"],
     "--out transformers is --transformers-tests transformers, which this run reads"),
    ("run", ["--report", "same.json", "--coverage", "same.json"], "--coverage same.json is also --report same.json"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, monkeypatch, capsys, cli, args, message):
    """One rule (mpt_kv.outputs.clash_problem): an output never names a file the command reads, nor the file or
    folder of another output."""
    assert message in refused(tmp_path, monkeypatch, capsys, cli, args)


def test_killmatrix_never_writes_its_markdown_over_the_doc_it_checks(tmp_path, monkeypatch, capsys):
    from mpt_kv.cli import killmatrix

    doc = killmatrix.DOC.read_text(encoding="utf-8")
    err = refused(tmp_path, monkeypatch, capsys, "killmatrix", ["--markdown", str(killmatrix.DOC), "--check-docs"])
    assert f"--markdown {killmatrix.DOC} is the kill matrix's doc {killmatrix.DOC}, which this run reads" in err
    assert killmatrix.DOC.read_text(encoding="utf-8") == doc


@pytest.mark.parametrize("cli, args, message", [
    # was: `calibrate run --cases 0` and `-3` exit 0 having run nothing, an output folder made
    ("calibrate", ["run", "--target", "reference", "--cases", "0"], "--cases 0: give 1 or more cases"),
    ("calibrate", ["run", "--target", "reference", "--cases", "-3"], "--cases -3: give 1 or more cases"),
    ("calibrate", ["quantized", "--cases", "0"], "--cases 0: give 1 or more cases"),
    ("calibrate", ["compiled", "--cases", "-3"], "--cases -3: give 1 or more cases"),
    ("calibrate", ["report", "r.json", "--show", "-1"], "--show -1: give 0 or more"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_count_below_its_limit_is_refused(tmp_path, monkeypatch, capsys, cli, args, message):
    assert message in refused(tmp_path, monkeypatch, capsys, cli, args)


@pytest.mark.parametrize("cli, args, message", [
    # was: a ValueError traceback (a/b, 1, ''), after making the output folder (0/0), or 2499 cases run (2/2)
    ("calibrate", ["run", "--target", "reference", "--shard", "a/b"], "argument --shard: 'a/b': expected K/N with "
                                                                      "0 <= K < N (shard K of N), e.g. 0/4"),
    ("calibrate", ["run", "--target", "reference", "--shard", "0/0"], "argument --shard: '0/0': expected K/N"),
    ("calibrate", ["run", "--target", "reference", "--shard", "1"], "argument --shard: '1': expected K/N"),
    ("calibrate", ["run", "--target", "reference", "--shard", "2/2"], "argument --shard: '2/2': expected K/N"),
    ("calibrate", ["run", "--target", "reference", "--shard", ""], "argument --shard: '': expected K/N"),
    # was: hypothesis's InvalidArgument traceback, after importing the models
    ("reach", ["--draw", "banana"], "argument --draw: 'banana' is no hypothesis profile: give one of dev, ci, thorough"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_value_not_of_its_form_is_refused(tmp_path, monkeypatch, capsys, cli, args, message):
    assert message in refused(tmp_path, monkeypatch, capsys, cli, args)


@pytest.mark.parametrize("cli, args, message", [
    # was: a traceback each (FileNotFoundError, JSONDecodeError, IsADirectoryError, KeyError), or exit 0 on a
    # results file without a case
    ("reach", ["missing.json"], "cannot read the report missing.json: FileNotFoundError"),
    ("reach", ["a_folder"], "cannot read the report a_folder: IsADirectoryError"),
    ("reach", ["notes.txt"], "cannot read the report notes.txt: JSONDecodeError"),
    ("reach", ["--draw", "ci", "--reference-model", "missing.json"], "--reference-model: reference model file "
                                                                     "missing.json: cannot read it as JSON"),
    ("reach", ["--draw", "ci", "--reference-model", "a_folder"], "--reference-model: reference model file a_folder: "
                                                                 "cannot read it as JSON"),
    ("reach", ["r.json", "--reference-model", "notes.txt"], "--reference-model: reference model file notes.txt: "
                                                            "cannot read it as JSON"),
    ("reach", ["r.json", "--reference-model", "r.json"], "--reference-model: reference model file r.json: expected an "
                                                         "object with 'name' and 'values'"),
    ("calibrate", ["report", "missing.jsonl"], "missing.jsonl is not a result file of `calibrate run` (JSON lines of "
                                               "cases): FileNotFoundError"),
    ("calibrate", ["report", "a_folder"], "a_folder is not a result file of `calibrate run` (JSON lines of cases): "
                                          "IsADirectoryError"),
    ("calibrate", ["report", "notes.txt"], "notes.txt is not a result file of `calibrate run` (JSON lines of cases): "
                                           "JSONDecodeError"),
    ("calibrate", ["report", "r.json"], "r.json is not a result file of `calibrate run` (JSON lines of cases): no "
                                        "'target' in a line"),
    ("calibrate", ["report", "empty.jsonl"], "empty.jsonl holds no case: nothing to report"),
    # was: the same line, exit 1 (a failed sweep's status, not bad input's)
    ("sweep", ["--render", "--out", "missing"], "mpt-kv sweep --render: cannot read missing/rows.json"),
    ("sweep", ["--render", "--out", "a_folder"], "mpt-kv sweep --render: cannot read a_folder/rows.json"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_input_file_that_is_missing_a_folder_or_not_its_kind_is_refused(tmp_path, monkeypatch, capsys, cli, args,
                                                                           message):
    assert message in refused(tmp_path, monkeypatch, capsys, cli, args)


@pytest.mark.parametrize("cli, args, message", [
    # was: a TargetUnavailable traceback, after making the output folder and its results file
    ("calibrate", ["run", "--target", "nosuch:x"], "--target nosuch:x: target 'nosuch:x': cannot import nosuch"),
    ("calibrate", ["run", "--target", ""], "--target : target '' is neither built in"),
    ("calibrate", ["compiled", "--target", "nosuch:x"], "--target nosuch:x: target 'nosuch:x': cannot import nosuch"),
    # was: every round of the benchmark timed a run that stopped at pytest's usage error
    ("gatebench", ["--target", "nosuch:x", "--out", "gb"], "--target nosuch:x: target 'nosuch:x': cannot import nosuch"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_target_that_cannot_run_here_is_refused(tmp_path, monkeypatch, capsys, cli, args, message):
    """The plugin's rule for a named target (`parametrize.named_target_problem`), in every command that takes one."""
    assert message in refused(tmp_path, monkeypatch, capsys, cli, args)


@pytest.mark.skipif(versions.missing("llm-foundry") is None, reason="llm-foundry is installed here")
def test_calibrate_on_a_builtin_target_not_installed_names_the_install_command(tmp_path, monkeypatch, capsys):
    """Was: a TargetUnavailable traceback after making the output folder (`calibrate run --target llm-foundry`)."""
    err = refused(tmp_path, monkeypatch, capsys, "calibrate", ["run", "--target", "llm-foundry"])
    assert "--target llm-foundry: llm-foundry is not installed (pip install" in err, err


# --- the plugin: its outputs never replace an input or each other; an ini value read late is read first ------------

@pytest.mark.parametrize("options, env, message", [
    # was: the JSON report lost (the Markdown written over it), exit 0
    ({"mpt_kv_report": "{tmp}/x.out", "mpt_kv_markdown": "{tmp}/x.out"}, {},
     "--mpt-kv-markdown {tmp}/x.out is also --mpt-kv-report {tmp}/x.out: two outputs never share a file"),
    ({"mpt_kv_report": "{tmp}/x.xml", "xmlpath": "{tmp}/x.xml"}, {},
     "--junitxml {tmp}/x.xml is also --mpt-kv-report {tmp}/x.xml: two outputs never share a file"),
    ({"mpt_kv_markdown": "{tmp}/pytest.ini"}, {},
     "--mpt-kv-markdown {tmp}/pytest.ini is the ini file {tmp}/pytest.ini, which this run reads"),
    ({"mpt_kv_report": "{tmp}/known.json"}, {"MPT_KV_KNOWN_FAILURES": "{tmp}/known.json"},
     "--mpt-kv-report {tmp}/known.json is the known-failures file {tmp}/known.json, which this run reads"),
    ({"mpt_kv_report": "{tmp}/ceilings/ceilings-cpu.json", "ceilings_dir": "{tmp}/ceilings"}, {},
     "--mpt-kv-report {tmp}/ceilings/ceilings-cpu.json is a stored ceilings file {tmp}/ceilings/ceilings-cpu.json"),
    ({"mpt_kv_markdown": "{tmp}/model.json", "mpt_kv_reference_model": "model.json"}, {},
     "--mpt-kv-markdown {tmp}/model.json is ini option mpt_kv_reference_model's file {tmp}/model.json"),
], ids=["report-markdown", "report-junitxml", "ini-file", "known-failures", "ceilings-file", "reference-model"])
def test_the_plugin_refuses_an_output_that_is_an_input_or_another_output(tmp_path, monkeypatch, options, env, message):
    for name in ("pytest.ini", "known.json", "model.json"):
        (tmp_path / name).write_text("{}\n")
    (tmp_path / "ceilings").mkdir()
    (tmp_path / "ceilings" / "ceilings-cpu.json").write_text("{}\n")
    fill = lambda v: v.format(tmp=tmp_path) if isinstance(v, str) else v  # noqa: E731
    for k, v in env.items():
        monkeypatch.setenv(k, fill(v))
    config = FakeConfig(**{k: fill(v) for k, v in options.items()})
    config.inipath = tmp_path / "pytest.ini"
    before = folder_state(tmp_path)
    with pytest.raises(pytest.UsageError) as e:
        gate.configure(config)
    assert fill(message) in str(e.value)
    assert folder_state(tmp_path) == before


RAN = """
def test_case(device):
    open("ran", "w").close()
"""


def test_the_plugin_refuses_a_bad_strict_known_failures_ini_value_before_any_test(pytester, monkeypatch):
    """Was: `mpt_kv_strict_known_failures = maybe` refused at the end of the run, after every case ran."""
    run = subprocess_runner(pytester, monkeypatch)
    pytester.makeini("[pytest]\nmpt_kv_strict_known_failures = maybe\n")
    result = run(RAN, "--device", "cpu", "--mpt-kv-report", "r.json")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert ("ini option mpt_kv_strict_known_failures: invalid truth value 'maybe'; expected true or false"
            in output(result)), output(result)
    assert not (pytester.path / "ran").exists(), "a test ran before the usage error"
    assert not (pytester.path / "r.json").exists()


def test_the_plugin_keeps_both_outputs_of_a_run_apart(pytester, monkeypatch):
    """End to end, as a CI job would write it: `--mpt-kv-report X --mpt-kv-markdown X` is a usage error before
    any test (exit 4), not a run whose JSON report is replaced by its summary."""
    run = subprocess_runner(pytester, monkeypatch)
    result = run(RAN, "--device", "cpu", "--mpt-kv-report", "x.out", "--mpt-kv-markdown", "x.out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "--mpt-kv-markdown x.out is also --mpt-kv-report x.out: two outputs never share a file" in output(result)
    assert not (pytester.path / "x.out").exists() and not (pytester.path / "ran").exists()
