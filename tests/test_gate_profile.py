"""The gate profile (issue 41): its rule, the stored profile's currency and kill power, and the plugin's
`--mpt-kv-profile gate` (mpt_kv/catalogue/gate_profile.py, mpt_kv/plugin/profile.py).

The currency test is what fails in CI when a catalogue change was made without
`python -m mpt_kv gateprofile --update`; the kill tests rerun each variant's stored killer (it must still
kill: a check change that loses a kill shows here). That every gate case passes every must-pass design is
checked by `--update` (23 designs x the gate's cases: minutes), and the kill matrix in CI checks the designs
on every column.
"""

from __future__ import annotations

import json
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
    stale["fingerprint"] = "0" * 64
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    conftest = ("from mpt_kv.catalogue import gate_profile\n"
                f"gate_profile.PROFILE_FILE = {str(tmp_path / 'stale.json')!r}\n")
    result = run("", *CONFORMANCE, "--mpt-kv-profile", "gate", files={"conftest": conftest})
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "the stored gate profile (stale.json) is stale" in output(result)
    assert "python -m mpt_kv gateprofile --update" in output(result)


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
    sleep = "import time; time.sleep({})"
    monkeypatch.setattr(gatebench, "commands", lambda target, tree: {
        "gate": ([sys.executable, "-c", sleep.format(0.05)], None),
        "full": ([sys.executable, "-c", sleep.format(0.3)], None),
        "peer": ([sys.executable, "-c", sleep.format(0.1) + "; raise SystemExit(1)"], tree)})
    assert gatebench.main(["--transformers-tests", str(tree), "--runs", "2", "--warmup", "0",
                           "--out", str(tmp_path / "out")]) == 1
    result = json.loads((tmp_path / "out" / "gatebench.json").read_text())
    assert [len(result["runs"][n]) for n in ("gate", "full", "peer")] == [2, 2, 2]
    assert result["ratios"]["gate/full"]["median"] < 1 < result["ratios"]["full/peer"]["median"]
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
