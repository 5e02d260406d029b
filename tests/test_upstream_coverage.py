"""What a run reaches of the upstream cache code (mpt_kv/upstream, `python -m mpt_kv coverage`, `run --coverage`;
docs/reach.md "The upstream code a run reaches"): the selection's rules and the reasons read from a file's source,
a real measurement that follows a subprocess (as xdist's workers are followed), the tables and floors, the
command's inputs, and docs/reach.md's measured table held to the floors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpt_kv import package_data
from mpt_kv.upstream import selection as S
from mpt_kv.upstream import tables
from mpt_kv.upstream.measure import FORMAT
from mpt_kv.upstream.source import NEEDS_HPU, NOT_DRIVEN, OPTION, Reason, SourceFile
from plugin_testing import HANG_S

# A model file as the ports write them: an attention class with a flash branch on an HPU kernel, a reuse_cache
# branch, a helper called only from the flash branch, a class used only where the kernel imported, a dict of
# attention classes, an MLP.
PORT = textwrap.dedent('''\
    try:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except ImportError:
        FusedSDPA = None


    def repeat_kv(x, n):
        return x


    def gaudi_flash(q, k, v):
        return FusedSDPA.apply(q, k, v)


    def flash_helper(q):
        return q


    class ModuleFusedSDPA:
        def forward(self, q):
            y = q + 1
            return y


    class KVCache:
        def allocate(self, shape):
            self.cache = shape
            return self.cache

        def update(self, prev, cur):
            return cur


    class GaudiAttention:
        def __init__(self, config):
            self.fused = ModuleFusedSDPA() if FusedSDPA else None
            self.k_cache = KVCache()

        def forward(self, x, past_key_value=None, use_flash_attention=False, reuse_cache=False):
            if use_flash_attention and FusedSDPA is not None:
                out = gaudi_flash(x, x, x)
                flash_helper(x)
            else:
                out = repeat_kv(x, 1)
            if reuse_cache:
                self.k_cache.allocate(x)
            return out


    class GaudiFlashAttention2(GaudiAttention):
        def forward(self, x):
            return x


    ATTENTION_CLASSES = {"eager": GaudiAttention, "flash_attention_2": GaudiFlashAttention2}


    class GaudiMLP:
        def forward(self, x, past_key_values=None):
            return x


    class GaudiForCausalLM:
        def prepare_inputs_for_generation(self, ids, past_key_values=None):
            return ids

        def forward(self, ids):
            return ids
    ''')


@pytest.fixture
def port(tmp_path) -> SourceFile:
    path = tmp_path / "modeling_port.py"
    path.write_text(PORT)
    return SourceFile(path)


def names(functions) -> set[str]:
    return {f.qualname for f in functions}


def test_the_attention_rule_picks_attention_classes_cache_helpers_and_named_functions(port):
    picked = names(port.selected("attention"))
    assert {"repeat_kv", "GaudiAttention.forward", "GaudiAttention.__init__", "KVCache.allocate", "KVCache.update",
            "ModuleFusedSDPA.forward", "GaudiFlashAttention2.forward",
            "GaudiForCausalLM.prepare_inputs_for_generation"} <= picked
    assert not picked & {"GaudiMLP.forward", "GaudiForCausalLM.forward", "gaudi_flash", "flash_helper"}


def test_the_cache_rule_picks_functions_whose_body_names_the_cache(port):
    picked = names(port.selected("cache"))
    assert {"GaudiAttention.forward", "GaudiMLP.forward", "GaudiForCausalLM.prepare_inputs_for_generation",
            "KVCache.allocate", "GaudiAttention.__init__"} <= picked  # past_key_value(s), self.cache, k_cache
    assert not picked & {"repeat_kv", "gaudi_flash", "GaudiForCausalLM.forward"}
    assert names(port.selected("all")) == names(port.functions.values())


def test_hpu_only_lines_are_kernel_calls_and_branches_taken_only_where_one_imported(port):
    lines = PORT.splitlines()
    hpu = {lines[n - 1].strip() for n in port.hpu_lines()}
    assert hpu == {"return FusedSDPA.apply(q, k, v)", "out = gaudi_flash(x, x, x)", "flash_helper(x)"}


def reasons_when_only(port, entered_names: set[str]) -> dict[str, str]:
    """The reasons of every function not in entered_names, as if a run entered exactly those."""
    statements = {f.line: {s.lineno for s in f.node.body} for f in port.functions.values()}
    entered = {f.line for f in port.functions.values() if f.qualname in entered_names}
    return {port.functions[line].qualname: str(r) for line, r in port.reasons(statements, entered, {}).items()}


def test_reasons_for_functions_never_entered(port):
    why = reasons_when_only(port, {"repeat_kv", "GaudiAttention.__init__", "GaudiAttention.forward"})
    assert why["gaudi_flash"].startswith(f"{NEEDS_HPU}: every line of it runs on an HPU only (it calls FusedSDPA)")
    assert why["flash_helper"].startswith(f"{NEEDS_HPU}: used only where FusedSDPA imported")
    assert why["ModuleFusedSDPA.forward"].startswith(f"{NEEDS_HPU}: used only where FusedSDPA imported")
    assert why["KVCache.allocate"].startswith(f"{OPTION}: reuse_cache (called only under the condition at line")
    assert why["GaudiFlashAttention2.forward"].startswith(f"{OPTION}: 'flash_attention_2' (used only under that key")
    assert why["GaudiMLP.forward"].startswith(NOT_DRIVEN)
    assert why["GaudiForCausalLM.prepare_inputs_for_generation"].startswith(NOT_DRIVEN)
    assert "GaudiAttention.forward" not in why


def test_a_reason_is_inherited_from_the_never_entered_caller_and_a_declared_one_wins(port):
    # the attention's forward never ran: repeat_kv, called only from it, is not driven like it
    why = reasons_when_only(port, {"GaudiAttention.__init__"})
    assert why["repeat_kv"].startswith(NOT_DRIVEN), why["repeat_kv"]
    statements = {f.line: {s.lineno for s in f.node.body} for f in port.functions.values()}
    entered = {port.by_name("GaudiAttention.__init__").line}
    declared = {"GaudiAttention.forward": Reason(OPTION, "attn_implementation='gaudi'", "x.py:1")}
    got = {port.functions[k].qualname: str(r) for k, r in port.reasons(statements, entered, declared).items()}
    assert got["GaudiAttention.forward"] == f"{OPTION}: attn_implementation='gaudi' (x.py:1)"
    call = PORT.splitlines().index("            out = repeat_kv(x, 1)") + 1
    assert got["repeat_kv"] == f"{OPTION}: attn_implementation='gaudi' (through GaudiAttention.forward, line {call})"


def test_function_names_are_coverage_pys():
    """The summary joins coverage.py's function regions to the source's functions by name and `def` line."""
    from coverage.regions import code_regions

    theirs = {(r.name, r.start) for r in code_regions(PORT) if r.kind == "function"}
    ours = {(f.qualname, f.line) for f in SourceFile("port.py", PORT).functions.values()}
    assert theirs == ours


def measured_as(src: SourceFile, entered: set[str], module_ran: bool = True) -> dict:
    """coverage.py's JSON report of a file, as if a run entered exactly `entered` (every line of each)."""
    functions = {}
    for f in src.functions.values():
        lines = sorted({s.lineno for s in f.node.body})
        ran = f.qualname in entered
        functions[f.qualname] = {"start_line": f.line, "executed_lines": lines if ran else [],
                                 "missing_lines": [] if ran else lines,
                                 "summary": {"covered_branches": 0, "num_branches": 0}}
    return {"executed_lines": [1] if module_ran or entered else [], "functions": functions}


@pytest.mark.parametrize("module_ran", [True, False])
def test_a_port_that_cannot_run_off_an_hpu_gives_its_registry_reason_where_the_source_names_none(port, module_ran):
    from mpt_kv.upstream.measure import summarize_file

    source = S.Source("optimum-habana", "optimum-habana", "ports", S.PORTS, "attention")
    selected = {"source": source, "path": "optimum/habana/transformers/models/port/modeling_port.py",
                "file": port.path, "release": "optimum-habana 1.21.2", "note": "its MoE calls torch.ops.hpu (x.py:1)"}
    got = {fn["name"]: fn for fn in summarize_file(selected, measured_as(port, set(), module_ran))["functions"]}
    assert got["repeat_kv"]["reason"] == f"{NEEDS_HPU}: its MoE calls torch.ops.hpu (x.py:1)"
    assert got["repeat_kv"]["hpu_only"] == got["repeat_kv"]["lines"][1] == 1
    # what the source shows is kept where the module ran: an option is an option on an HPU too
    expected = f"{OPTION}: 'flash_attention_2'" if module_ran else f"{NEEDS_HPU}: its MoE"
    assert got["GaudiFlashAttention2.forward"]["reason"].startswith(expected)
    without = dict(selected, note=None)
    plain = {fn["name"]: fn for fn in summarize_file(without, measured_as(port, set(), module_ran))["functions"]}
    assert plain["repeat_kv"]["reason"].startswith(NOT_DRIVEN) and plain["repeat_kv"]["hpu_only"] == 0


# --- a real measurement ----------------------------------------------------------------------------------------------

SUBPROCESS = """
import torch
from transformers.cache_utils import DynamicCache
cache = DynamicCache()
cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
"""


@pytest.mark.slow  # a subprocess that imports transformers: about 5 s
def test_a_measurement_follows_python_subprocesses_as_xdist_workers_are_followed(tmp_path):
    """What the main job's xdist workers run is measured: here a subprocess started inside the measurement
    updates a DynamicCache, and the summary has DynamicLayer.update entered, nothing of generate."""
    import coverage

    from mpt_kv.upstream.measure import Measurement, summarize

    measurement = Measurement()
    try:
        measurement.start()
        try:
            subprocess.run([sys.executable, "-c", SUBPROCESS], check=True, timeout=HANG_S)
        finally:
            measurement.stop()
        summary = summarize(measurement.coverage, ["transformers"], "ci")
        measurement.keep(tmp_path / "kept.coverage")  # what `run --coverage` keeps beside its summary
    finally:
        measurement.close()
    kept = coverage.CoverageData(basename=str(tmp_path / "kept.coverage"))
    kept.read()
    assert any(f.endswith("transformers/cache_utils.py") for f in kept.measured_files())
    by_path = {f["path"]: f for f in summary["files"]}
    update = {fn["name"]: fn for fn in by_path["transformers/cache_utils.py"]["functions"]}
    assert update["DynamicLayer.update"]["reason"] is None and update["DynamicLayer.update"]["lines"][0] > 0
    generate = by_path["transformers/generation/utils.py"]
    assert generate["functions"] and all(fn["reason"] for fn in generate["functions"])
    assert summary["format"] == FORMAT and summary["implementations"] == ["transformers"]


# --- tables and floors -------------------------------------------------------------------------------------------------

def summary(profile="ci", executed=5, release="transformers 5.24.0", group="cache_utils"):
    fn = lambda name, e, reason: {"name": name, "line": 1, "lines": [e, 10], "branches": [e // 2, 4],  # noqa: E731
                                  "hpu_only": 0 if reason is None or NEEDS_HPU not in reason else 10, "reason": reason}
    return {"format": FORMAT, "hypothesis_profile": profile, "implementations": ["transformers"], "coverage": "7",
            "files": [{"implementation": "transformers", "release": release, "group": group,
                       "path": "transformers/cache_utils.py", "rule": "all", "imported": True,
                       "functions": [fn("A.update", executed, None), fn("A.crop", 0, f"{NOT_DRIVEN}: x"),
                                     fn("A.hpu", 0, f"{NEEDS_HPU}: y"),
                                     {"name": "A.stub", "line": 9, "lines": [0, 0], "branches": [0, 0], "hpu_only": 0,
                                      "reason": f"{NOT_DRIVEN}: z"}]}]}


def test_a_group_row_sums_its_functions_and_leaves_out_hpu_only_lines_apart(monkeypatch):
    monkeypatch.setattr(S, "FLOORS", {"transformers 5.24 cache_utils": (10, 5)})
    (row,) = [line for line in tables.group_lines([summary()]) if line.startswith("| transformers")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 3 functions with statements (the stub has none), 1 entered; 5 of 30 lines; the 10 HPU-only lines apart
    assert cells[2:] == ["1/3", "5/30 (16.7%)", "2/12 (16.7%)", "10", "25.0%", "1 / 0 / 1", "10%, 5%"], cells


def test_floors_fail_below_without_a_floor_and_for_a_floor_no_summary_measures(monkeypatch):
    monkeypatch.setattr(S, "FLOORS", {"transformers 5.24 cache_utils": (16, 16)})
    assert tables.floor_problems([summary()]) == []
    assert "below its floor of 16% and 16%" in tables.floor_problems([summary(executed=4)])[0]
    monkeypatch.setattr(S, "FLOORS", {"transformers 5.25 cache_utils": (16, 16)})
    problems = tables.floor_problems([summary()])
    assert any("transformers 5.24 cache_utils: no floor" in p for p in problems)
    assert any("transformers 5.25 cache_utils: a floor, but no summary measures that group" in p for p in problems)


def write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_update_docs_then_check_and_a_floor_fails_the_check(tmp_path, monkeypatch, capsys):
    from mpt_kv.cli import coverage as cli

    monkeypatch.setattr(S, "FLOORS", {"transformers 5.24 cache_utils": (16, 16)})
    doc = tmp_path / "reach.md"
    doc.write_text("# r\n\n<!-- upstream-coverage:begin -->\nstale\n<!-- upstream-coverage:end -->\nafter\n")
    one = write(tmp_path, "one.json", summary())
    assert cli.main(["--check", "--doc", str(doc), str(one)]) == 1
    assert "is stale: run python -m mpt_kv coverage --update-docs" in capsys.readouterr().err
    assert cli.main(["--update-docs", "--doc", str(doc), str(one)]) == 0
    assert cli.main(["--check", "--doc", str(doc), str(one)]) == 0
    assert "| transformers 5.24.0 | cache_utils: transformers/cache_utils.py | 1/3 |" in doc.read_text()
    monkeypatch.setattr(S, "FLOORS", {"transformers 5.24 cache_utils": (17, 16)})
    capsys.readouterr()
    assert cli.main(["--check", "--doc", str(doc), str(one)]) == 1
    assert "floor not held: transformers 5.24 cache_utils: lines 16.7%" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "give the summaries of the runs"),
    (["--doc", "x.md", "s.json"], "--doc is only read with --update-docs or --check"),
    (["--json", "o.json", "s.json"], "--implementation, --report and --json are read with --data only"),
    (["--data", "nosuch/.coverage"], "--data needs what its run drove"),
    (["--data", "x", "--report", "r.json", "--implementation", "transformers"], "--data needs what its run drove"),
    (["--data", "{one}", "--report", "nosuch.json"], "--report nosuch.json: no such file"),
    (["--data", "nosuch/.coverage", "--implementation", "transformers"], "no such file"),
    (["--data", "x", "--implementation", "nosuch"], "invalid choice: 'nosuch'"),
    (["nosuch.json"], "nosuch.json: [Errno 2] No such file"),
    (["{bad}"], "not a summary of `python -m mpt_kv run --coverage`"),
    (["{one}", "{one}"], "give one summary per environment"),
    (["--check", "{dev}"], "these summaries were drawn under dev"),
    (["--check", "--doc", "nosuch/reach.md", "{one}"], "No such file"),
    ([""], "an empty path"),
])
def test_bad_arguments_exit_2_with_one_line_before_any_work(tmp_path, argv, message, capsys):
    from mpt_kv.cli import coverage as cli

    files = {"{bad}": write(tmp_path, "bad.json", {"files": []}), "{one}": write(tmp_path, "one.json", summary()),
             "{dev}": write(tmp_path, "dev.json", summary(profile="dev"))}
    with pytest.raises(SystemExit) as info:
        cli.main([str(files.get(a, a)) for a in argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_run_refuses_an_unwritable_coverage_summary_before_any_test(tmp_path):
    (tmp_path / "f").write_text("a file where a folder is meant")
    done = subprocess.run([sys.executable, "-m", "mpt_kv", "run", "--coverage", str(tmp_path / "f" / "x.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 2 and "--coverage" in done.stderr and "exists and is not a folder" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "reports").exists()


# --- docs/reach.md's measured table holds the floors ---------------------------------------------------------------------

ROW = re.compile(r"^\| (?P<release>[\w.-]+ [\d.]+) \| (?P<group>[^:(|]+?)(?: \(\d+ files\)|: [^|]+) \| \d+/\d+ \| "
                 r"\d+/\d+ \((?P<lines>[\d.]+)%\) \| \d+/\d+ \((?P<branches>[\d.]+)%\) \|")


def doc_groups() -> dict[str, tuple[float, float]]:
    from mpt_kv.cli import docblocks

    text, start, end = docblocks.read_block(package_data.REACH_DOC, "upstream-coverage")
    out = {}
    for line in text[start:end].splitlines():
        m = ROW.match(line)
        if m:
            out[f"{tables.minor(m['release'])} {m['group']}"] = (float(m["lines"]), float(m["branches"]))
    return out


def test_docs_reach_table_holds_every_floor_and_every_group_has_one():
    """docs/reach.md's table is the main job's measured reach (`.ci/run` fails when it is not this run's:
    `coverage --check`); here it must hold the floors, so reach cannot drop by regenerating the table."""
    measured = doc_groups()
    assert set(measured) == set(S.FLOORS), (set(measured) ^ set(S.FLOORS))
    low = {k: (v, S.FLOORS[k]) for k, v in measured.items() if v[0] < S.FLOORS[k][0] or v[1] < S.FLOORS[k][1]}
    assert not low, f"groups below their floors (measured, floor): {low}"
    assert {"transformers", "optimum-habana", "llm-foundry"} <= {k.split()[0] for k in measured}


def section_commands() -> list[str]:
    text = package_data.REACH_DOC.read_text(encoding="utf-8")
    section = text[text.index("## The upstream code a run reaches"):]
    block = re.search(r"^```bash\n(.*?)^```", section, flags=re.S | re.M).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_docs_commands_read_the_files_tox_writes_and_ci_checks():
    """docs/reach.md's commands read the summaries tox.ini's conformance runs write (`--coverage`), and .ci/run
    checks those same files."""
    root = package_data.CHECKOUT_ROOT
    written = re.findall(r"--coverage \{tox_root\}\{/\}reports\{/\}(coverage-\w+\.json)", (root / "tox.ini").read_text())
    assert sorted(written) == ["coverage-cpu.json", "coverage-foundry.json", "coverage-ohabana.json"]
    (check,) = [line for line in (root / ".ci" / "run").read_text().splitlines()
                if "mpt_kv coverage" in line and not line.startswith("#")]
    commands = section_commands()
    assert commands[0] == "CI=true .venv/bin/tox -m conformance"
    for command in [*commands[1:], check]:
        assert sorted(re.findall(r"reports/(coverage-\w+\.json)", command)) == sorted(written), command
    assert "--check" in check and any("--check" in c for c in commands)


def test_the_docs_commands_work_when_copied(tmp_path):
    """The table and check commands of docs/reach.md, run as written from a folder whose reports/ holds three
    summaries: the table exits 0 with a row per group, the check exits 1 (these made-up runs are not the
    table's), naming what is stale."""
    (tmp_path / "reports").mkdir()
    for env, release in (("cpu", "transformers 5.24.0"), ("ohabana", "optimum-habana 1.21.2"),
                         ("foundry", "llm-foundry 0.22.0")):
        write(tmp_path / "reports", f"coverage-{env}.json", summary(release=release))
    for command in section_commands()[1:]:
        argv = command.split()
        assert argv[:3] == [".venv/bin/python", "-m", "mpt_kv"], command
        done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
        if "--check" in argv:
            assert done.returncode == 1 and "is stale" in done.stderr, done.stderr
        else:
            assert done.returncode == 0 and "| llm-foundry 0.22.0 | cache_utils" in done.stdout, done.stderr


def test_run_coverage_summarizes_the_implementations_its_own_report_ran(tmp_path, monkeypatch, capsys):
    """`run --coverage` selects the files of the implementations the run's cases ran: a family case's
    implementation, an MPT target case's target; a report older than the measurement (an earlier run's) says none."""
    import time

    from mpt_kv.cli import run
    from mpt_kv.upstream import measure

    seen = []
    monkeypatch.setattr(measure, "summarize", lambda cov, impls, profile: seen.append((impls, profile)) or summary())

    class Measured:
        coverage, started = None, time.time() - 60

        def keep(self, path):
            path.write_text("data")

    report = write(tmp_path, "r.json", {"hypothesis_profile": "ci", "results": [
        {"target": "llm-foundry"}, {"target": "transformers/gpt2/mha", "implementation": "transformers"},
        {"target": "reference"}]})
    run.write_coverage(Measured(), report, tmp_path / "c.json")
    assert seen[-1] == (["llm-foundry", "reference", "transformers"], "ci")
    assert json.loads((tmp_path / "c.json").read_text())["format"] == FORMAT and (tmp_path / "c.coverage").is_file()
    Measured.started = time.time() + 60
    run.write_coverage(Measured(), report, tmp_path / "c.json")
    assert seen[-1] == ([], None)
