"""The suite's sensitivity and specificity: every known-bad variant (catalogue/variants.py) is killed
by the check it names, every legitimate design (catalogue/designs.py) and the reference pass every
check, and the kill-matrix command says so in its exit status: 1 when a variant gets through, 2
when a check fails a must-pass design."""

import json

import pytest
import torch

from mpt_kv.catalogue import killmatrix as KM
from mpt_kv.catalogue.designs import DESIGNS
from mpt_kv.catalogue.variants import COLUMNS, VARIANTS, Variant, no_change
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.errors import Unsupported
from mpt_kv.cli import killmatrix as killmatrix_cli
from mpt_kv.targets import resolve

CPU = torch.device("cpu")


def waiting_reason(v: Variant) -> str:
    """Why a variant may survive in this build: its declared waits_for, or its killers are n/a here."""
    missing = [KM.unavailable(c) for c in v.killed_by]
    if v.waits_for:
        return v.waits_for
    return "; ".join(missing) if all(missing) else ""


def variant_params():
    """Each variant; one that waits for a check this build lacks is a strict xfail: the day its
    killer arrives the test XPASSes, and the waits_for line must go."""
    for name, v in VARIANTS.items():
        why = waiting_reason(v)
        yield pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=f"waits for {why}") if why else ())


# The next two run the kill matrix's own cells per entry, in pytest: the same work as `python -m
# mpt_kv killmatrix` (exit 1 for a survivor, 2 for a false positive), which .ci/run runs as its
# first step. Marked `killmatrix` so tox's default run does not do that work twice (about 280 s of
# CPU); `pytest -m killmatrix tests/test_variants.py` runs them.
@pytest.mark.killmatrix
@pytest.mark.parametrize("name", list(variant_params()))
def test_variant_is_killed_by_its_expected_checks(name):
    v = VARIANTS[name]
    for check in v.killed_by:
        cell = KM.run_column(check, v.build, name, CPU, v.dtype or torch.float32, {})
        assert cell.killed, (f"{name} ({v.bug}) survived {check}, the check expected to kill it: a missing or weak "
                             f"test (cases: {[mc.case.describe() for mc in KM.CASES]}) [{cell.result}: {cell.detail}]")


@pytest.mark.killmatrix
@pytest.mark.parametrize("name", ["reference", *DESIGNS])
def test_must_pass_design_passes_every_check(name):
    design = KM.must_pass()[name]
    matrix = KM.run_matrix([design], [], list(KM.COLUMNS))
    failed = {c: cell.detail for c, cell in matrix["must_pass"][name].items() if cell.result not in ("pass", "n/a")}
    assert not failed, f"{name} ({design.what}) fails checks of the kill matrix (false positives): {failed}"


# The new variants of issue 11 are bugs of long sequences, wide heads and edge shapes: on cases of
# the size hypothesis draws (head_dim < 32, at most 16 positions) every check passes them, so the
# matrix's long and wide cases are what kills them, not luck.
def drawn_size(mc):
    return mc.case.cfg.head_dim < 32 and mc.case.total_len <= 16


SURVIVES_ON = {
    "sliding_window_16": drawn_size,
    "fused_decode_drops_alibi_for_large_heads": drawn_size,
    "last_slot_clamped": lambda mc: drawn_size(mc) and mc.case.total_len < mc.case.cfg.max_seq_len,
    "position_in_bf16": drawn_size,
    "bucket_of_previous_position": drawn_size,
    "contiguous_is_not_always_a_copy": lambda mc: mc.case.batch > 1 or mc.case.prompt_len > 1,
}


@pytest.mark.parametrize("name", SURVIVES_ON)
def test_long_and_wide_variants_survive_without_the_cases_that_reach_them(name, monkeypatch):
    monkeypatch.setattr(KM, "CASES", tuple(mc for mc in KM.CASES if SURVIVES_ON[name](mc)))
    assert KM.CASES, "no case left"
    v = VARIANTS[name]
    for check in v.killed_by:
        cell = KM.run_column(check, v.build, name, CPU, torch.float32, {})
        assert cell.result == "survived", f"{name} is killed by {check} on the cases left: {cell.detail}"


# Issue 38: every config field the docs say is drawn reaches a value where dropping it shows, in every run (a
# model that hard-codes eps=1e-5 passed every check while the drawn values were 1e-5 and 1e-6)
@pytest.mark.parametrize("name, check", [
    ("layer_norm_epsilon_dropped", "P0/batch-8-heads-32"),  # eps 1e-3 there (and drawn)
    ("clip_qkv_dropped", "P0/batch-8-heads-32"),            # clip_qkv 0.5 there (and drawn)
    ("vocab_size_dropped", "P0"),                           # every drawn vocab is one the adapter's model is not
    ("alibi_bias_max_always_8", "P0/alibi-bias-max-16"),    # P0's drawn cases keep 8 (docs/reach.md)
])
def test_an_adapter_that_drops_a_drawn_config_field_fails_p0_in_every_run(name, check):
    from mpt_kv import CHECKS
    from mpt_kv.errors import InputError

    assert "P0" in VARIANTS[name].killed_by
    with pytest.raises((PropertyFailure, InputError)):
        CHECKS[check](VARIANTS[name].build, "cpu", torch.float32)
    CHECKS[check]("reference", "cpu", torch.float32)  # the case itself is right: the reference passes it


def test_catalogues_are_documented_and_usable_as_targets():
    assert len(VARIANTS) >= 28 and len(DESIGNS) >= 8
    for name, v in VARIANTS.items():
        assert v.bug and v.origin and v.killed_by, f"{name}: bug, origin and expected killers must be filled in"
        assert set(v.killed_by) <= set(COLUMNS), f"{name}: unknown columns {set(v.killed_by) - set(COLUMNS)}"
        assert resolve(f"mpt_kv.catalogue.variants:{name}") is v.build, f"--target mpt_kv.catalogue.variants:{name}"
    for name, d in DESIGNS.items():
        assert d.what and d.origin, f"{name}: what and origin must be filled in"
        assert resolve(f"mpt_kv.catalogue.designs:{name}") is d.build, f"--target mpt_kv.catalogue.designs:{name}"
    assert not set(VARIANTS) & set(DESIGNS)


# --- the command's verdicts ---------------------------------------------------------------------------

def test_cli_reports_a_survivor_and_exits_1(tmp_path, capsys):
    # P0 alone cannot see K/V views: the variant survives and the command must say so
    out = tmp_path / "m.json"
    rc = killmatrix_cli.main(["--variant", "kv_views_of_mixed_qkv", "--check", "P0", "--json", str(out)])
    assert rc == 1, capsys.readouterr()
    assert "kv_views_of_mixed_qkv SURVIVED" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["must_kill"]["kv_views_of_mixed_qkv"]["cells"]["P0"]["result"] == "survived"
    assert data["must_pass"]["reference"]["cells"]["P0"]["result"] == "pass"


def test_cli_reports_a_harmless_variant_as_survivor(monkeypatch, capsys):
    monkeypatch.setitem(VARIANTS, "no_change", Variant("no_change", "nothing: the reference", "-", (), no_change))
    rc = killmatrix_cli.main(["--variant", "no_change"])
    text = capsys.readouterr()
    assert rc == 1, text.out
    assert "no_change SURVIVED every check" in text.err
    row = next(line for line in text.out.splitlines() if line.startswith("no_change"))
    assert "killed" not in row, row


def test_cli_exits_zero_when_every_variant_is_killed(tmp_path, capsys):
    md = tmp_path / "m.md"
    rc = killmatrix_cli.main(["--variant", "kv_swapped_in_static_decode", "--variant", "only_v_cloned",
                              "--check", "P1", "--check", "P3", "--markdown", str(md)])
    assert rc == 0, capsys.readouterr()
    table = md.read_text()
    assert "| `kv_swapped_in_static_decode` |" in table and "killed*" in table and "| `reference` |" in table


def test_cli_exits_2_when_a_check_fails_a_must_pass_design(monkeypatch, capsys):
    """A design that is in fact a bug is a failing must-pass row: the command reads it as a false
    positive of that check (exit 2), whatever the variants do."""
    from mpt_kv.catalogue.designs import Design

    bad = VARIANTS["only_v_cloned"]
    monkeypatch.setitem(DESIGNS, "views_as_design", Design("views_as_design", "k as a view", "-", bad.build))
    rc = killmatrix_cli.main(["--design", "views_as_design", "--check", "P3"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "must-pass views_as_design fails P3: P3 cache aliasing after step prefill: layer 0 key" in err, err


def test_cli_refuses_when_the_reference_fails(monkeypatch, capsys):
    def always_fails(runner, c):
        raise PropertyFailure("a check that fails every model")

    from mpt_kv.checks import properties

    monkeypatch.setattr(properties, "check_oracle", always_fails)  # P0's function, by its name in the index
    rc = killmatrix_cli.main(["--variant", "softmax_in_bf16", "--check", "P0"])
    assert rc == 2
    assert "must-pass reference fails P0: a check that fails every model" in capsys.readouterr().err


def test_a_column_this_build_lacks_is_na_and_its_variants_wait(monkeypatch, capsys):
    """A check that does not exist in a build (as P4 before issue 12's output-reuse check) is "n/a" in
    every row, never a crash; a variant only it can kill is reported as waiting, and does not fail the run."""
    monkeypatch.setitem(KM.UNAVAILABLE, "P4", "not in this build")
    rc = killmatrix_cli.main(["--variant", "shared_output_buffer", "--check", "P1", "--check", "P4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "WAITING: shared_output_buffer survives here, waiting for not in this build (expected killers: P4)" in out
    row = next(line for line in out.splitlines() if line.startswith("shared_output_buffer"))
    assert row.split()[1:] == ["(waits)", "survived", "n/a*"], row


def test_a_waiting_variant_that_is_killed_fails_until_its_waits_for_goes(monkeypatch, capsys):
    v = VARIANTS["index_copy_at_token_idx"]
    monkeypatch.setitem(VARIANTS, v.name, Variant(v.name, v.bug, v.origin, v.killed_by, v.build, waits_for="a check"))
    rc = killmatrix_cli.main(["--variant", v.name, "--check", "P1"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "index_copy_at_token_idx: P1 kills it now, but it is declared waiting for 'a check'" in err, err


def test_a_declared_capability_gap_is_unsupported_not_a_pass(monkeypatch):
    """A design that declares a feature unsupported is skipped there (the cell says so), never counted
    as passing a check it did not run."""
    from mpt_kv.catalogue.assembly import runner_factory
    from mpt_kv.targets import Capabilities

    build = runner_factory("no_static", capabilities=Capabilities(unsupported={"static": "no static path here"}))
    cell = KM.run_column("static-shape", build, "no_static", CPU, torch.float32, {})
    assert (cell.result, cell.detail) == ("unsupported", "no_static: no static path here")


def _raise(error):
    raise error


@pytest.mark.parametrize("error, cell", [
    (None, ("survived", "")),
    (PropertyFailure("P1 step 2: logits differ"), ("killed", "P1 step 2: logits differ")),
    (IndexError("index 9 is out of bounds"), ("killed (error: IndexError)",
                                              "IndexError: index 9 is out of bounds [row r, path=static]")),
    (Unsupported("no static path here"), ("unsupported", "no static path here")),
])
def test_every_cell_is_read_by_the_one_rule(error, cell):
    """MPT, family and generate cells alike: a finding is a kill, a crash a kill named as one, a declared gap
    unsupported (never survived), a return survived (KM.reading)."""
    got = KM.reading(lambda: None if error is None else _raise(error), "row r, path=static")
    assert (got.result, got.detail) == cell


def test_the_matrix_in_two_processes_is_the_matrix_in_one():
    """--jobs: the rows dealt to forked processes give the same cells, in the same row order."""
    designs = [KM.must_pass()["stacked_kv"]]  # a design and two variants: both processes get a row
    variants = [VARIANTS["kv_views_of_mixed_qkv"], VARIANTS["only_v_cloned"]]
    checks = ["P3"]
    one = KM.run_matrix(designs, variants, checks)
    two = KM.run_matrix_in(2, designs, variants, checks)
    assert two == one
    assert list(two["must_pass"]) == ["reference", "stacked_kv"]
    assert list(two["must_kill"]) == [v.name for v in variants]
