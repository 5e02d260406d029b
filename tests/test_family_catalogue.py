"""The family catalogue (mpt_kv/catalogue/family_catalogue.py) in the kill matrix: each family
variant is killed by the family checks it names, each family design passes every family column, and
`python -m mpt_kv killmatrix` says so in its exit status (1: a family variant got through; 2: a
family check failed a family design), as for the MPT catalogues (tests/test_variants.py)."""

import dataclasses
import json

import pytest

from mpt_kv.catalogue import family_catalogue
from mpt_kv.catalogue import killmatrix as KM
from mpt_kv.catalogue.designs import DESIGNS
from mpt_kv.catalogue.family_catalogue import FAMILY_COLUMNS, FAMILY_DESIGNS, FAMILY_VARIANTS
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import family_driver, index
from mpt_kv.cli import killmatrix as killmatrix_cli
from mpt_kv.families import FAMILIES

needs_5x = pytest.mark.skipif(family_catalogue.unavailable() is not None,
                              reason=f"{family_catalogue.unavailable()}")


@pytest.fixture(autouse=True)
def fresh_runners():
    family_driver.clear_caches()
    yield
    family_driver.clear_caches()


def test_the_family_catalogue_is_documented_and_names_real_families_and_checks():
    assert {e.family for e in FAMILY_VARIANTS.values()} >= {"gemma2", "deepseek_v2", "mixtral"}
    assert set(FAMILY_COLUMNS) <= {p.name for p in index.PROPERTIES if p.family}
    assert not set(FAMILY_DESIGNS) & set(FAMILY_VARIANTS)
    assert not (set(FAMILY_DESIGNS) | set(FAMILY_VARIANTS)) & (set(VARIANTS) | set(DESIGNS) | {"reference"})
    for name, e in [*FAMILY_DESIGNS.items(), *FAMILY_VARIANTS.items()]:
        assert e.name == name and e.why and e.origin, f"{name}: why and origin must be filled in"
        assert e.variant in FAMILIES[e.family].variants, f"{name}: {e.family} has no variant {e.variant}"
        assert e.path in ("concat", "static"), name
    for name, e in FAMILY_DESIGNS.items():
        assert not e.killed_by, f"{name}: a design names no killer"
    for name, e in FAMILY_VARIANTS.items():
        assert e.killed_by and set(e.killed_by) <= set(FAMILY_COLUMNS), f"{name}: killed_by {e.killed_by}"
        assert e.patch or e.model_change, f"{name}: a variant changes something"


# Each entry's kill-matrix cells, in pytest: the same work as the family rows of `python -m mpt_kv
# killmatrix` (.ci/run's first step), marked `killmatrix` as tests/test_variants.py's (tox's default
# run does not do it twice; `pytest -m killmatrix tests/test_family_catalogue.py` runs them).
@needs_5x
@pytest.mark.killmatrix
@pytest.mark.parametrize("name", list(FAMILY_VARIANTS))
def test_family_variant_is_killed_by_its_expected_checks(name):
    v = FAMILY_VARIANTS[name]
    for check in v.killed_by:
        cell = KM.run_family_column(check, v)
        assert cell.killed, f"{name} ({v.why}) survived {check}, the check expected to kill it [{cell.result}: {cell.detail}]"


@needs_5x
@pytest.mark.killmatrix
@pytest.mark.parametrize("name", list(FAMILY_DESIGNS))
def test_family_design_passes_every_family_check(name):
    design = FAMILY_DESIGNS[name]
    matrix = KM.run_matrix([], [], [], family_designs=[design], family_checks=list(FAMILY_COLUMNS))
    cells = matrix["family_must_pass"][name]
    failed = {c: cell.detail for c, cell in cells.items() if cell.result not in ("pass", "unsupported")}
    assert not failed, f"{name} ({design.why}) fails family checks of the kill matrix (false positives): {failed}"
    assert [c for c, cell in cells.items() if cell.result == "pass"], f"{name}: no family check ran"


# The must-kill variants whose effect is below bf16's noise (docs/calibration.md, "The family checks"): no
# bound that passes the correct MoE families in bf16 sees them; the fp32 cases, which every run has too,
# kill them. Strict: a variant listed here that bf16 kills fails the test (the list must stay true).
BF16_BELOW_NOISE = {
    ("routing_capacity_not_cached", "family-P1"): "moves mixtral's cached logits by 3.6-6.3% of their scale "
    "(measured); a correct MoE family reaches 13.7% in bf16 at a routing near-tie (gpt_oss, seed 1); fp32: "
    "450-720 x the bound",
    ("sdpa_decode_mask_dropped", "family-ops"): "a padded row's first beam decode step moves llama's logits by "
    "4.6e-2 at most (measured in fp32: 1.8e3 x fp32's bound), within bf16's; family-P2 still kills it in bf16",
}


@needs_5x
def test_in_bf16_too_every_family_variant_is_killed_and_every_family_design_passes():
    """The kill matrix's family rows run in fp32; the family cases run in bf16 too, against the fp32 oracle
    from the bf16-rounded weights within bf16's calibrated bounds (docs/calibration.md): every must-kill
    variant is still killed by each check it names, but those whose effect is below bf16's noise
    (BF16_BELOW_NOISE), and every design passes every family column."""
    import torch

    survived = {(name, check) for name, v in FAMILY_VARIANTS.items() for check in v.killed_by
                if not KM.run_family_column(check, v, torch.bfloat16).killed}
    assert survived == set(BF16_BELOW_NOISE), f"family variants that survive in bf16: {sorted(survived)}"
    failed = {(name, check): cell.detail for name, d in FAMILY_DESIGNS.items() for check in FAMILY_COLUMNS
              if (cell := KM.run_family_column(check, d, torch.bfloat16)).result not in ("survived", "unsupported")}
    assert not failed, f"family designs that fail in bf16 (false positives): {failed}"


# --- the command's verdicts on the family rows ------------------------------------------------------------------

@needs_5x
def test_cli_exits_1_when_a_family_variant_survives(monkeypatch, tmp_path, capsys):
    """The copying window (a design) entered as a variant: nothing kills it, and the run says so."""
    harmless = dataclasses.replace(FAMILY_DESIGNS["window_copied"], name="window_copied_again",
                                   killed_by=("family-P1",))
    monkeypatch.setitem(FAMILY_VARIANTS, harmless.name, harmless)
    out = tmp_path / "m.json"
    rc = killmatrix_cli.main(["--variant", harmless.name, "--check", "family-P1", "--check", "family-P3",
                              "--json", str(out)])
    text = capsys.readouterr()
    assert rc == 1, text.out
    assert "window_copied_again SURVIVED every check that ran (family-P1, family-P3): a missing or weak test" in text.err
    assert "window_copied_again: expected family-P1 to kill it, but it survived family-P1" in text.err
    data = json.loads(out.read_text())
    assert data["family_must_kill"]["window_copied_again"]["cells"]["family-P1"]["result"] == "survived"


@needs_5x
def test_cli_exits_1_when_an_expected_family_killer_misses(monkeypatch, capsys):
    """The roomy window is killed by family-memory, not family-P1: declared the other way, the run fails."""
    roomy = dataclasses.replace(FAMILY_VARIANTS["window_one_too_many"], killed_by=("family-P1",))
    monkeypatch.setitem(FAMILY_VARIANTS, roomy.name, roomy)
    rc = killmatrix_cli.main(["--variant", roomy.name, "--check", "family-P1", "--check", "family-memory"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "window_one_too_many: expected family-P1 to kill it, but it survived family-P1" in err, err


@needs_5x
def test_cli_exits_2_when_a_family_check_fails_a_family_design(monkeypatch, capsys):
    """A family design that is in fact the slice that pins evicted positions: family-P3's false positive."""
    pinning = dataclasses.replace(FAMILY_VARIANTS["window_slice_pins_evicted"], name="slice_as_design", killed_by=())
    monkeypatch.setitem(FAMILY_DESIGNS, pinning.name, pinning)
    rc = killmatrix_cli.main(["--design", "slice_as_design", "--check", "family-P3"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("must-pass slice_as_design fails family-P3: family-P3 cache pins storage after prefill: layer 0 key "
            "(2, 2, 3, 8) is a view of a buffer that is no fused projection's output") in err, err


@needs_5x
def test_cli_exits_0_when_the_family_rows_hold(capsys, tmp_path):
    md = tmp_path / "m.md"
    rc = killmatrix_cli.main(["--design", "window_copied", "--variant", "window_one_short", "--variant",
                              "routing_capacity_not_cached", "--check", "family-P1", "--markdown", str(md)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "window_one_short (gemma2)" in out and "routing_capacity_not_cached (mixtral)" in out
    table = md.read_text()
    assert "| `window_one_short` | gemma2/hybrid-window4, concat |" in table and "killed*" in table
    assert "| `window_copied` | gemma2/hybrid-window4, concat |" in table


def test_family_rows_without_transformers_5_are_na_and_their_variants_wait(monkeypatch, capsys):
    """Where the catalogue's changes cannot apply (transformers 4.x), its cells read n/a with the
    reason and its variants wait (reported, exit 0), as an MPT column a build lacks."""
    monkeypatch.setattr(family_catalogue, "unavailable", lambda: "transformers 4.55.4: no sliding-window layers")
    rc = killmatrix_cli.main(["--design", "window_copied", "--variant", "window_one_short", "--check", "family-P1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert ("WAITING: window_one_short survives here, waiting for transformers 4.55.4: no sliding-window layers "
            "(expected killers: family-P1)") in out
    row = next(line for line in out.splitlines() if line.startswith("window_one_short"))
    assert row.split()[1:] == ["(waits)", "(gemma2)", "n/a*"], row


@needs_5x
def test_family_checks_alone_run_no_mpt_row(capsys):
    """Naming only family columns runs the family rows, not every MPT variant with no column (each
    would 'survive every check that ran (none)')."""
    rc = killmatrix_cli.main([arg for column in FAMILY_COLUMNS for arg in ("--check", column)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "1 must-pass rows and 0 must-kill variants x 0 checks" in out and "x 5 family checks" in out
    assert "latent_view_of_fused_projection (deepseek_v2)" in out


def test_mpt_checks_alone_run_no_family_row(capsys):
    rc = killmatrix_cli.main(["--variant", "only_v_cloned", "--check", "P3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAMILY MUST" not in out and "0 family must-pass rows" in out


@needs_5x
def test_the_family_rows_in_two_processes_are_the_family_rows_in_one():
    designs = [FAMILY_DESIGNS["window_copied"]]
    variants = [FAMILY_VARIANTS["window_one_short"], FAMILY_VARIANTS["window_one_too_many"]]
    checks = ["family-P1", "family-memory"]
    one = KM.run_matrix([], [], [], family_designs=designs, family_variants=variants, family_checks=checks)
    two = KM.run_matrix_in(2, [], [], [], family_designs=designs, family_variants=variants, family_checks=checks)
    assert two == one
    assert list(two["family_must_kill"]) == [v.name for v in variants]
    assert two["family_must_kill"]["window_one_short"]["family-P1"].killed


# --- the sdpa rows: their change lives in transformers' sdpa path alone -----------------------------------------

SDPA_ROWS = [e for e in [*FAMILY_DESIGNS.values(), *FAMILY_VARIANTS.values()] if e.attention == "sdpa"]


def test_the_catalogue_has_sdpa_rows_of_both_kinds():
    assert {e.name for e in SDPA_ROWS} >= {"sdpa_mask_always_built", "sdpa_gqa_in_the_kernel",
                                           "sdpa_is_causal_with_a_cache", "sdpa_decode_mask_dropped"}
    assert {e.name in FAMILY_VARIANTS for e in SDPA_ROWS} == {True, False}


@needs_5x
@pytest.mark.parametrize("name", [e.name for e in SDPA_ROWS if e.name in FAMILY_VARIANTS])
def test_an_sdpa_variant_on_eager_attention_survives_every_family_check(name):
    """The same change with the row built on eager attention changes nothing the checks see: the bug the
    sdpa row is killed for is on the sdpa path only (eager's mask never asks _ignore_causal_mask_sdpa)."""
    eager = dataclasses.replace(FAMILY_VARIANTS[name], attention=None)
    cells = {c: KM.run_family_column(c, eager) for c in FAMILY_COLUMNS}
    assert not [c for c, cell in cells.items() if cell.killed], {c: cell.detail for c, cell in cells.items()}


@needs_5x
def test_the_is_causal_variant_needs_family_p1s_unpadded_batch(monkeypatch):
    """is_causal with a cache is reached where sdpa skips the mask, a batch without padding: family-P1's drive
    of an sdpa row kills it; with the left-padded batch every other drive has, it survives."""
    variant = FAMILY_VARIANTS["sdpa_is_causal_with_a_cache"]
    cell = KM.run_family_column("family-P1", variant)
    assert cell.killed and "family-P1 extend 3 (step 3): cached logits" in cell.detail, cell.detail
    monkeypatch.setattr(family_driver, "unpadded_p1", lambda c: False)
    assert KM.run_family_column("family-P1", variant).result == "survived"
