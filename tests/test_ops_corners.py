"""The ops checks' corners (issue 26): batch 1, one head, one layer, a prompt of 1, where a slice of
the cache is contiguous and `.contiguous()` of it is no copy. The fixed programs are batches of 2-3
with 2-3 heads, and hypothesis's ci draws rarely get there, so the corner program
(`programs.corner_program`) and the operation checks' corner case (`programs.MEMORY_CORNER`) are
fixed cases of every ops check on CPU. The catalogue's `crop_by_contiguous_slice` is killed only
there; the program strategy draws the config fields the value checks draw."""

import pytest
import torch

from mpt_kv.catalogue import killmatrix as KM
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import programs, running
from mpt_kv.checks.registry import CHECKS
from mpt_kv.checks.strategies import ALIBI_BIAS_MAXES, LAYER_NORM_EPSILONS, VOCAB_SIZES, RandomPicks
from mpt_kv.errors import PropertyFailure

CPU, F32 = torch.device("cpu"), torch.float32
CROP = VARIANTS["crop_by_contiguous_slice"].build


def test_the_corner_program_is_batch_1_one_head_one_layer_a_prompt_of_1_with_every_operation_allowed():
    p = programs.corner_program(set(programs.OPERATIONS))
    c = p.case
    assert (c.batch, c.cfg.n_heads, c.cfg.n_layers, c.prompt_len) == (1, 1, 1, 1)
    assert p.describe() == ("corner: prefill, extend 3, crop -2, decode, reorder [0], decode, extend 4, crop -6, "
                            "decode (cache length 10)")
    assert programs.corner_program({"reorder"}).describe() == "corner: prefill, reorder [0], decode (cache length 10)"
    assert programs.corner_program({"crop"}) is None, "a crop needs positions past the prompt: an extend"
    m = programs.MEMORY_CORNER
    assert (m.batch, m.cfg.n_heads, m.cfg.n_layers, m.prompt_len) == (1, 1, 1, 1)


def test_every_ops_check_runs_its_corner_on_cpu_and_not_on_hpu():
    assert programs.corner_program(set(programs.OPERATIONS)) in programs.fixed_programs("cpu", set(programs.OPERATIONS))
    assert all(p.style != "corner" for p in programs.fixed_programs("hpu", set(programs.OPERATIONS)))
    assert programs.MEMORY_CORNER in programs.MEMORY_CASES
    notes = CHECKS["ops-memory/concat/reorder"]("reference", "cpu", F32)
    assert any("reorder by [0]" in n for n in notes), notes


@pytest.mark.parametrize("check, message", [
    ("ops-P3/concat", r"after crop -2, layer 0 key \(1, 1, 2, 8\) pins 64 bytes beyond the cache .*a crop by slicing "
                      r"keeps the cropped tail alive"),
    ("ops-retained/concat/crop", r"crop -5 \(9 -> 4 positions\): 320 bytes more retained .*layer 0 key \(1, 1, 4, 8\) "
                                 r"lives in a storage of 288 bytes, 160 more than it holds"),
])
def test_a_crop_by_contiguous_is_caught_at_the_corner(check, message):
    with pytest.raises(PropertyFailure, match=message):
        CHECKS[check](CROP, "cpu", F32)


def without_corners(monkeypatch):
    monkeypatch.setattr(programs, "CORNER_GROUPS", ())
    monkeypatch.setattr(programs, "MEMORY_CASES", (programs.MEMORY_CASE,))
    monkeypatch.setattr(KM.programs, "corner_program", lambda allowed: None)


def test_without_the_corners_the_kill_matrix_lets_a_crop_by_contiguous_through(monkeypatch):
    assert KM.run_column("ops", CROP, "crop_by_contiguous_slice", CPU, F32, {}).killed
    without_corners(monkeypatch)
    monkeypatch.setattr(KM.programs, "MEMORY_CORNER", programs.MEMORY_CASE)
    cell = KM.run_column("ops", CROP, "crop_by_contiguous_slice", CPU, F32, {})
    assert cell.result == "survived", cell.detail


def test_without_the_corners_the_fixed_cases_of_the_shipped_checks_pass_it(monkeypatch):
    """The same on the checks' own fixed cases (their drawn programs left out): the fixed beam and
    speculative programs and MEMORY_CASE copy with .contiguous(), the corner does not."""
    without_corners(monkeypatch)
    monkeypatch.setattr(running, "drive", lambda *args, **kwargs: None)
    for check in ("ops-P3/concat", "ops-retained/concat/crop"):
        CHECKS[check](CROP, "cpu", F32)


def test_the_program_strategy_draws_the_value_checks_config_fields():
    drawn = [programs.small_case_from(RandomPicks(i)).cfg for i in range(200)]
    assert {c.vocab_size for c in drawn} == set(VOCAB_SIZES)
    assert {c.alibi_bias_max for c in drawn} == set(ALIBI_BIAS_MAXES)
    assert {c.layer_norm_epsilon for c in drawn} == set(LAYER_NORM_EPSILONS)
    assert {c.clip_qkv for c in drawn} == {None, 0.5, 4.0}
