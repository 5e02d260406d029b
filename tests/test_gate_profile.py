"""The gate profile (issues 41 and 49): its rule (the required coverage included), the stored profile's
currency, integrity and kill power, and the plugin's `--mpt-kv-profile gate` (mpt_kv/catalogue/gate_profile.py,
mpt_kv/plugin/profile.py): what a run's own selection (-k, -m, --deselect, --lf, --dtype) or an early stop (-x)
leaves out of the profile is named, and is a usage error or a failure under CI.

The currency test is what fails in CI when a catalogue change was made without
`python -m mpt_kv gateprofile --update`; the kill tests rerun each variant's stored killer (it must still
kill: a check change that loses a kill shows here). That every gate case passes every must-pass design is
checked by `--update` (23 designs x the gate's cases: minutes), and the kill matrix in CI checks the designs
on every column.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from mpt_kv import package_data
from mpt_kv.catalogue import gate_profile
from mpt_kv.catalogue.gate_profile import GateCase, cover
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks.registry import CHECKS
from tests.plugin_testing import output, subprocess_runner

pytest_plugins = ["pytester"]

A, B, C, D = (GateCase(x, "fp32") for x in "abcd")


# --- the rule ------------------------------------------------------------------------------------------------------

def test_cover_takes_the_case_killing_most_then_the_cheaper_then_the_registry_order():
    kills = {"v1": {A, B}, "v2": {B}, "v3": {A, C}}
    assert cover(kills, {A: 1, B: 1, C: 0.1}, [A, B, C]) == [A, B]  # A and B kill 2 each: A first in order
    assert cover(kills, {A: 1, B: 0.5, C: 0.1}, [A, B, C]) == [B, C]  # B cheaper than A: then v3 by C (cheaper)
    assert cover(kills, {A: 1, B: 0.5, C: 0.1}, [A, B, C], excluded={B}) == [A]  # v2 only B kills: left out


def test_cover_drops_a_case_the_others_make_redundant_and_is_deterministic():
    # greedy takes D (3 variants), then A and C for v4/v5; D is then redundant only if A, C cover v1-v3
    kills = {"v1": {A, D}, "v2": {C, D}, "v3": {A, D}, "v4": {A}, "v5": {C}}
    chosen = cover(kills, {A: 1, C: 1, D: 5}, [A, C, D])
    assert chosen == [A, C]
    assert all(cover(dict(reversed(list(kills.items()))), {A: 1, C: 1, D: 5}, [A, C, D]) == chosen for _ in range(3))


def test_cover_leaves_out_what_only_an_excluded_case_kills():
    """A case that fails a must-pass design is excluded: a variant only it kills is left (listed as waiting)."""
    assert cover({"v1": {A}, "v2": {B}}, {A: 1, B: 1}, [A, B], excluded={B}) == [A]


def test_cover_keeps_a_case_for_a_requirement_no_variant_needs():
    """Required coverage is covered as a variant is: C kills nothing, but it alone meets "r" (a value check
    after an extend on a path no variant's bug is on); with C excluded the requirement is given up."""
    kills = {"v1": {A}, "v2": {A, B}}
    assert cover(kills, {A: 1, B: 1, C: 5}, [A, B, C]) == [A]
    assert cover({**kills, "r": {C, D}}, {A: 1, B: 1, C: 5, D: 9}, [A, B, C, D]) == [A, C]
    assert cover({**kills, "r": {C}}, {A: 1, B: 1, C: 5}, [A, B, C], excluded={C}) == [A]


def test_the_requirements_ask_for_every_killer_column_and_a_value_check_after_extend_and_reorder_on_every_path():
    """From the index, not a hand-picked list: a value check is a property with an oracle; the program checks
    run extend and reorder (their fixed programs: the premise is checked here too); every cache path."""
    from mpt_kv.checks import index
    from mpt_kv.checks.programs import FIXED

    assert {"extend", "reorder"} <= {op.kind for program in FIXED.values() for op in program.ops}
    required = gate_profile.requirements()
    columns = {c for v in VARIANTS.values() for c in v.killed_by}
    assert {f"a case of column {c}" for c in columns} <= set(required)
    for path in index.ALL_PATHS:
        for op in ("extend", "reorder"):
            meeting = required[f"a value check after {op} on {path}"]
            assert meeting and all(CHECKS[i].property in ("ops-P1", "ops-P2") for i in meeting), (path, op, meeting)
            assert all(gate_profile.path_label(CHECKS[i]) == path for i in meeting)
    assert required["a value check after extend on static+bucket"] == ("ops-P1/static+bucket4", "ops-P2/static+bucket4")


def test_the_stored_profile_meets_every_requirement_or_says_what_it_gives_up():
    """Issue 49: a bug on an operation no catalogue variant covers still meets a value check on its path. Each
    requirement is met by a stored case that the rule says meets it, or given up with the reason; today none is
    given up, and the extend that crosses a bucket (a variant only ops-P1/P2 on static+bucket4 kill) is killed."""
    required = gate_profile.requirements()
    gives_up = PROFILE.data.get("gives_up", {})
    unmet = [r for r, meeting in required.items() if not any(c.check in meeting for c in PROFILE.cases)]
    assert all(gives_up.get(r) for r in unmet), f"no stored case meets {unmet}, and the profile does not give them up"
    for requirement, meeting in required.items():  # what the file says each case meets is the rule's
        met = [c for c in PROFILE.cases if c.check in meeting]
        assert all(requirement in case["meets"] for case in PROFILE.data["cases"]
                   if GateCase(case["check"], case["dtype"]) in met), requirement
        assert GateCase(*PROFILE.data["required"][requirement]) in met if met else requirement in gives_up
    assert gives_up == {}
    assert PROFILE.killers["extend_written_within_one_bucket"].check in required[
        "a value check after extend on static+bucket"]


# --- the stored profile ----------------------------------------------------------------------------------------------

def test_the_stored_profile_is_current():
    """Fails when the catalogue, the kill matrix's cases or the check ids changed without an update."""
    profile = gate_profile.load()
    assert gate_profile.stale_reason(profile) is None
    assert profile.cases and all(c.check in CHECKS for c in profile.cases)
    assert set(profile.killers) | set(profile.waiting) == set(VARIANTS)
    assert all(profile.killers[v] in profile.cases for v in profile.killers)


def test_a_catalogue_change_makes_the_stored_profile_stale(tmp_path, monkeypatch):
    changed = []
    for path in package_data.CATALOGUE_SOURCES:
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        changed.append(copy)
    changed[0].write_text(changed[0].read_text() + "\n# a new variant would go here\n")
    monkeypatch.setattr(package_data, "CATALOGUE_SOURCES", tuple(changed))
    reason = gate_profile.stale_reason(gate_profile.load())
    assert reason and "is stale" in reason and "python -m mpt_kv gateprofile --update" in reason


def _edited(data: dict) -> list[tuple[str, dict]]:
    """Hand edits of a profile file, each with the part it edits."""
    cut = {**data, "cases": data["cases"][:1]}
    no_killers = {**data, "killers": {}}
    no_kills = {**data, "cases": [{**c, "kills": []} for c in data["cases"]]}
    pasted = {**data, "fingerprint": "0" * 64}
    return [("cases (1 now)", cut), ("killers (0 now)", no_killers), (f"cases ({len(data['cases'])} now)", no_kills),
            ("fingerprint", pasted)]


def test_an_edited_profile_is_refused_naming_what_was_edited(tmp_path, monkeypatch, capsys):
    """Cut to one case, its killers emptied, a case's kills emptied, a fingerprint pasted over a stale one: each
    differs from the digests `--update` wrote, and both load() and `gateprofile --check` say which part."""
    from mpt_kv.cli import gateprofile

    data = json.loads(gate_profile.PROFILE_FILE.read_text())
    for part, edited in _edited(data):
        path = tmp_path / "edited.json"
        path.write_text(json.dumps(edited))
        with pytest.raises(gate_profile.ProfileError, match=rf"edited.json was edited after .*its {re.escape(part)} "):
            gate_profile.load(path)
        monkeypatch.setattr(gate_profile, "PROFILE_FILE", path)
        assert gateprofile.main(["--check"]) == 1
        assert f"was edited after `python -m mpt_kv gateprofile --update` wrote it: its {part}" in capsys.readouterr().err
    del data["digests"]
    path.write_text(json.dumps(data))
    with pytest.raises(gate_profile.ProfileError, match="has no digests of its parts"):
        gate_profile.load(path)


def test_a_profile_written_by_the_rule_loads_and_its_digests_cover_every_part(tmp_path):
    data = json.loads(gate_profile.PROFILE_FILE.read_text())
    gate_profile.write(data, tmp_path / "again.json")
    assert gate_profile.load(tmp_path / "again.json").cases == PROFILE.cases
    assert set(data["digests"]) == set(data) - {"digests"}


def test_a_missing_or_malformed_profile_names_the_file(tmp_path):
    with pytest.raises(gate_profile.ProfileError, match="is missing"):
        gate_profile.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text(json.dumps({"cases": [{"check": "P0"}]}))
    with pytest.raises(gate_profile.ProfileError, match="bad.json is malformed .*gateprofile --update"):
        gate_profile.load(tmp_path / "bad.json")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
try:
    PROFILE = gate_profile.load()
except gate_profile.ProfileError:  # test_the_stored_profile_is_current fails, saying why
    PROFILE = gate_profile.StoredProfile((), "", {}, (), {})


@pytest.fixture
def ci_profile():
    from mpt_kv.checks.profiles import load_profile

    gate_profile.use_data_profile()
    yield
    load_profile()


@pytest.mark.parametrize("variant", sorted(PROFILE.killers))
def test_each_variant_is_still_killed_by_its_stored_killer(variant, ci_profile):
    case = PROFILE.killers[variant]
    with pytest.raises(Exception):  # the kill matrix's crash rule: any exception kills (a PropertyFailure mostly)
        CHECKS[case.check](VARIANTS[variant].build, "cpu", DTYPES[case.dtype])


# --- the plugin: --mpt-kv-profile gate -------------------------------------------------------------------------------

CONFORMANCE = ("--pyargs", "mpt_kv.conformance", "--target", "reference", "--only-targets", "--device", "cpu",
               "--no-mpt-kv-matrix")


@pytest.fixture
def run(pytester, monkeypatch):
    return subprocess_runner(pytester, monkeypatch)


def test_a_gate_run_runs_exactly_the_profiles_cases(run):
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line and "no-family-implementation" not in line]
    assert sorted(ids) == sorted(  # the cases' ids end with -<dtype>-<check id>]; one target, one device
        line for line in ids if any(line.endswith(f"-{c.dtype}-{c.check}]") for c in PROFILE.cases)), output(result)
    assert len(ids) == len(PROFILE.cases), output(result)
    assert result.ret != pytest.ExitCode.USAGE_ERROR  # --collect-only: the gate then says no case passed (exit 1)


def test_the_ini_option_selects_the_profile_and_a_bad_value_is_a_usage_error(run, pytester):
    pytester.makeini("[pytest]\nmpt_kv_profile = gate\n")
    result = run("", *CONFORMANCE, "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line and "no-family-implementation" not in line]
    assert len(ids) == len(PROFILE.cases), output(result)
    pytester.makeini("[pytest]\nmpt_kv_profile = nightly\n")
    result = run("", *CONFORMANCE, "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ini option mpt_kv_profile = 'nightly': expected one of full, gate" in output(result)


def test_a_gate_run_that_keeps_no_case_is_a_usage_error(run):
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", "-k", "family-P0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "--mpt-kv-profile gate kept no conformance case" in output(result)


def test_a_stale_stored_profile_is_a_usage_error_before_any_test(run, tmp_path):
    stale = json.loads(gate_profile.PROFILE_FILE.read_text())
    stale["fingerprint"] = "0" * 64  # what a profile computed from another catalogue carries
    gate_profile.write(stale, tmp_path / "stale.json")
    conftest = ("from mpt_kv.catalogue import gate_profile\n"
                f"gate_profile.PROFILE_FILE = {str(tmp_path / 'stale.json')!r}\n")
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", files={"conftest": conftest})
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "the stored gate profile (stale.json) is stale" in output(result)
    assert "python -m mpt_kv gateprofile --update" in output(result)


def test_a_gate_run_with_an_edited_profile_is_a_usage_error_naming_what_was_edited(run, tmp_path):
    cut = _edited(json.loads(gate_profile.PROFILE_FILE.read_text()))[0][1]
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    conftest = ("from mpt_kv.catalogue import gate_profile\n"
                f"gate_profile.PROFILE_FILE = {str(tmp_path / 'cut.json')!r}\n")
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", "--collect-only", files={"conftest": conftest})
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "cut.json was edited after `python -m mpt_kv gateprofile --update` wrote it: its cases (1 now)" in output(result)


# --- what the run's own selection and its end leave of the profile (issue 49) ----------------------------------------

def _ids_of(case: GateCase) -> str:
    module = {"memory": "test_memory", "static-shape": "test_static_shape", "graph-capture": "test_static_shape"}.get(
        CHECKS[case.check].property, "test_operations" if case.check.startswith("ops-") else "test_properties")
    function = {"test_memory": "test_memory_ceilings", "test_static_shape": "test_static_path_keeps_shapes_and_storage",
                "test_operations": "test_operation", "test_properties": "test_property"}[module]
    return f"{module}.py::{function}[cpu-reference-{case.dtype}-{case.check}]"


def _unkilled_without(*dropped: GateCase) -> list[str]:
    return PROFILE.unkilled([c for c in PROFILE.cases if c not in dropped])


GRAPH = next((c for c in PROFILE.cases if c.check == "graph-capture/static"), None)  # the only graph-capture check
BF16 = [c for c in PROFILE.cases if c.dtype == "bf16"]
FIRST = PROFILE.cases[0] if PROFILE.cases else None
# a conftest a project might have: graph-capture marked slow, and a CI job that runs -m "not slow"
SLOW = ("import pytest\n\ndef pytest_collection_modifyitems(items):\n    for item in items:\n"
        "        if 'graph-capture' in item.nodeid:\n            item.add_marker(pytest.mark.slow)\n")


@pytest.mark.parametrize("args, dropped", [
    (("-k", "not graph-capture"), [GRAPH]),
    (("-m", "not slow"), [GRAPH]),
    (("--deselect", _ids_of(FIRST) if FIRST else ""), [FIRST]),
    (("--dtype", "fp32"), BF16),
    (("-p", "cacheprovider", "--lf"), [c for c in PROFILE.cases if c != FIRST]),
], ids=["-k", "-m", "--deselect", "--dtype", "--lf"])
def test_under_ci_a_selection_that_leaves_out_profile_cases_is_a_usage_error_naming_them(run, pytester, args, dropped):
    """Issue 49: `-k 'not graph-capture'` went green under CI with a variant only graph-capture kills unkilled;
    -m, --deselect, --lf and --dtype the same. Now one line before any test: the cases left out, the variants
    no case that remains kills, the required coverage lost (exit 4)."""
    assert dropped and all(dropped), "the stored profile lacks the case this test drops"
    if "--lf" in args:  # the last run failed FIRST alone: --lf reruns it and deselects the rest
        cache = pytester.path / ".pytest_cache" / "v" / "cache"
        cache.mkdir(parents=True)
        (cache / "lastfailed").write_text(json.dumps({_ids_of(FIRST): True}))
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", *args, CI="true", files={"conftest": SLOW})
    text = output(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    line = next((line for line in result.errlines if "this run's selection" in line), "")
    assert f"leaves out {len(dropped)} of the stored profile's {len(PROFILE.cases)} cases" in line, text
    assert all(str(c) in line for c in dropped), line
    unkilled = _unkilled_without(*dropped)
    assert unkilled and all(v in line for v in unkilled), line
    assert not re.search(r"\d+ (passed|failed)", text)  # before any test


def test_without_ci_the_summary_never_claims_the_cases_the_selection_left_out(run):
    """`-k P3/concat` outside CI runs the two P3 cases and passes, and the summary says which variants this run
    leaves unkilled (it said: "22 cases of the stored profile kill every catalogue variant")."""
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", "-k", "P3/concat")
    text = output(result)
    kept = [c for c in PROFILE.cases if "P3/concat" in c.check]
    assert result.ret == pytest.ExitCode.OK and f"{len(kept)} passed" in text, text
    assert "kill every catalogue variant" not in text
    left_out = [c for c in PROFILE.cases if c not in kept]
    assert (f"mpt-kv profile gate: this run's selection (-k, -m, --deselect, --lf, --dtype or its test files) leaves "
            f"out {len(left_out)} of the stored profile's {len(PROFILE.cases)} cases") in text
    assert all(v in text for v in _unkilled_without(*left_out))


def test_a_run_that_x_stops_early_never_claims_the_profile_and_fails_under_ci(run):
    """-x on a target the first case kills: the other kept cases never run. The summary names them and what
    only they kill; under CI the run fails with that reason (it said every catalogue variant was killed)."""
    for ci in ("", "true"):
        result = run("", *CONFORMANCE[:3], "mpt_kv.catalogue.variants:kv_views_of_mixed_qkv", *CONFORMANCE[4:],
                     "--mpt-kv-profile", "gate", "-x", CI=ci)
        text = output(result)
        assert result.ret == pytest.ExitCode.TESTS_FAILED and "1 failed" in text, text
        assert "kill every catalogue variant" not in text
        line = next(line for line in result.outlines if "that this run kept did not run" in line)
        assert f"{len(PROFILE.cases) - 1} of the stored profile's {len(PROFILE.cases)} cases" in line
        assert "the gate profile did not run whole" in line


def test_under_ci_and_xdist_the_workers_run_nothing_and_the_controller_says_why(run):
    """xdist's controller collects nothing: each worker refuses the selection (it runs no test) and the
    controller's end says the same line, exit 4."""
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", "-n", "2", "-k", "not graph-capture", CI="true")
    text = output(result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    assert not re.search(r"\d+ (passed|failed)", text) and "no tests ran" in text, text
    assert f"leaves out 1 of the stored profile's {len(PROFILE.cases)} cases (on reference/cpu: {GRAPH})" in text
    assert "that this run kept did not run" not in text


# --- the benchmark: python -m mpt_kv gatebench -----------------------------------------------------------------------

def test_gatebench_pairs_whole_processes_round_by_round(tmp_path, monkeypatch, capsys):
    """A stand-in transformers tree (its MPT test file) and stand-in commands: the ratios are taken round by
    round, a failing command is reported (exit 1), and a tree without the peer's file is a usage error."""
    import sys

    from mpt_kv.cli import gatebench

    tree = tmp_path / "transformers"
    (tree / gatebench.PEER_FILE).parent.mkdir(parents=True)
    (tree / gatebench.PEER_FILE).write_text("def test_nothing():\n    pass\n")
    argv = gatebench.commands("transformers", tree)
    assert argv["gate"][0][-2:] == ["--mpt-kv-profile", "gate"] and "--mpt-kv-profile" not in argv["full"][0]
    # the peer runs as its developers run it: without our plugin, and with xdist loaded (transformers'
    # conftest.py registers an xdist hook)
    assert argv["peer"] == ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:mpt_kv.plugin",
                             str(gatebench.PEER_FILE)], tree)
    # real processes (their exit status, summary and load are measured), their seconds a fake clock's: the
    # ratios' order is the test's, not the machine's load
    seconds = {"gate": 1.0, "full": 6.0, "peer": 2.0}
    monkeypatch.setattr(gatebench, "commands", lambda target, tree: {
        "gate": ([sys.executable, "-c", "pass", "gate"], None),
        "full": ([sys.executable, "-c", "pass", "full"], None),
        "peer": ([sys.executable, "-c", "raise SystemExit(1)", "peer"], tree)})
    measure = gatebench.measure
    monkeypatch.setattr(gatebench, "measure", lambda argv, cwd: {**measure(argv, cwd), "wall_s": seconds[argv[-1]],
                                                                  "cpu_s": seconds[argv[-1]] / 2})
    assert gatebench.main(["--transformers-tests", str(tree), "--runs", "2", "--warmup", "0",
                           "--out", str(tmp_path / "out")]) == 1
    result = json.loads((tmp_path / "out" / "gatebench.json").read_text())
    assert [len(result["runs"][n]) for n in ("gate", "full", "peer")] == [2, 2, 2]
    assert result["ratios"]["gate/full"] == result["ratios"]["gate/full cpu"] == {"median": 0.167,
                                                                                 "min": 0.167, "max": 0.167}
    assert result["ratios"]["full/peer"]["median"] == 3.0
    assert {m["exit"] for m in result["runs"]["peer"]} == {1}
    # CPU-second ratios beside wall (the steadier figure on a shared machine), the load around each run
    assert set(result["ratios"]) == {"gate/peer", "full/peer", "gate/full", "gate/peer cpu", "full/peer cpu",
                                     "gate/full cpu"}
    assert all(len(m["load"]) == 2 and m["summary"] == "" for ms in result["runs"].values() for m in ms)
    assert "a command did not pass: peer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gatebench.main(["--transformers-tests", str(tmp_path)])
    assert "no tests/models/mpt/test_modeling_mpt.py there" in capsys.readouterr().err


def test_gatebench_keeps_pytest_summary_line_without_its_time():
    """What each run passed, skipped and failed is recorded beside its time (a failing peer is visible)."""
    from mpt_kv.cli.gatebench import summary_line

    assert summary_line("....\n= 13 failed, 111 passed, 193 skipped in 277.77s (0:04:37) =\n") == \
        "13 failed, 111 passed, 193 skipped"
    assert summary_line("mpt-kv cost per check\n14 passed, 4 skipped, 4 xfailed in 6.07s\n") == \
        "14 passed, 4 skipped, 4 xfailed"
    assert summary_line("Traceback (most recent call last):\nImportError: no module\n") == ""
