"""The CLIs refuse bad input before any work (docs/gate.md row 25): bench's memory estimate against
free memory, every output path, killmatrix on an absent device, and the plugin's report path."""

from __future__ import annotations

import re

import pytest

from mpt_kv import devices
from mpt_kv.plugin import gate

from plugin_testing import FakeConfig


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
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_an_empty_output_path_is_a_usage_error_everywhere(tmp_path, capsys, monkeypatch, cli, args):
    import importlib

    (tmp_path / "README.md").write_text("the user's own\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mpt_kv.catalogue.killmatrix.run_matrix", lambda *a: pytest.fail("the work started"))
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
