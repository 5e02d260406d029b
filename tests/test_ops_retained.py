"""ops-retained (issue 26): what a reorder and a crop leave allocated, against the analytic cache of
the surviving positions. ops-memory bounds an operation's transient, the peak above max(before,
after); an operation that keeps the old cache referenced raises "after" as well, so it reads as a
small transient while the cache is held twice. The catalogue's `old_cache_kept_for_undo` is such a
cache: only ops-retained kills it."""

import importlib.util

import pytest
import torch

from mpt_kv.catalogue import killmatrix as KM
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import index, operations, programs
from mpt_kv.checks.registry import CHECKS
from mpt_kv.errors import PropertyFailure

CPU, F32 = torch.device("cpu"), torch.float32
UNDO = VARIANTS["old_cache_kept_for_undo"].build
CASE = programs.MEMORY_CASE
CFG = CASE.cfg


def kv_bytes(positions: int, case=CASE, itemsize: int = 4) -> int:
    """KV(positions): 2 x layers x B x H x positions x hd x itemsize."""
    c = case.cfg
    return 2 * c.n_layers * case.batch * c.n_heads * positions * c.head_dim * itemsize


def test_the_row_is_in_the_index_with_its_operations_and_checks():
    prop = index.by_name("ops-retained")
    assert prop.runs == "operation" and prop.column == "ops" and prop.operations == ("reorder", "crop")
    assert [c for c in CHECKS if c.startswith("ops-retained/")] == [
        "ops-retained/concat/reorder", "ops-retained/concat/crop", "ops-retained/static/reorder",
        "ops-retained/static/crop", "ops-retained/static+bucket8/reorder", "ops-retained/static+bucket8/crop"]


@pytest.mark.parametrize("check", [c for c in CHECKS if c.startswith("ops-retained/")])
def test_the_reference_retains_exactly_its_cache_before_and_after(check):
    notes = CHECKS[check]("reference", "cpu", F32)
    assert len(notes) == 2, notes  # the fixed case and the corner
    for note in notes:
        assert "0 bytes beyond the analytic cache before it, 0 after it" in note, note


@pytest.mark.parametrize("operation, positions", [("reorder", CASE.prompt_len), ("crop", CASE.total_len)])
def test_a_cache_kept_for_undo_is_the_whole_old_cache_named_by_attribute(operation, positions):
    """Exactly the cache before the operation (positions it held then), found where the session keeps
    it: session.cache.undo."""
    after = positions if operation == "reorder" else positions - operations.MEMORY_CROP
    with pytest.raises(PropertyFailure) as e:
        CHECKS[f"ops-retained/concat/{operation}"](UNDO, "cpu", F32)
    msg = str(e.value)
    assert (f"({positions} -> {after} positions): {kv_bytes(positions)} bytes more retained beyond the analytic cache "
            f"of the surviving positions after it than before it (0 before, {kv_bytes(positions)} after; exact)") in msg, msg
    assert f"expected the KV cache {kv_bytes(after)} bytes (2 x 3 layers x B 3 x H 4 x L {after} x hd 8 x 4 bytes)" in msg
    per_tensor = kv_bytes(positions) // (2 * CFG.n_layers)
    assert f"session.cache.undo[0][0] (3, 4, {positions}, 8) float32 keeps {per_tensor} bytes" in msg, msg


def test_the_transient_alone_does_not_see_a_cache_kept_for_undo():
    """ops-memory's reorder transient passes the variant: the old cache is kept, so the level after
    the reorder is as high as its peak. Without ops-retained the ops column lets it through."""
    CHECKS["ops-memory/concat/reorder"](UNDO, "cpu", F32)
    assert KM.run_column("ops", UNDO, "old_cache_kept_for_undo", CPU, F32, {}).killed


def test_without_the_row_the_kill_matrix_lets_the_variant_through(monkeypatch):
    others = tuple(p for p in index.PROPERTIES if p.name != "ops-retained")
    monkeypatch.setattr(KM.index, "of_column", lambda column: tuple(p for p in others if p.column == column))
    cell = KM.run_column("ops", UNDO, "old_cache_kept_for_undo", CPU, F32, {})
    assert cell.result == "survived", cell.detail


def test_a_crop_that_slices_keeps_the_cropped_positions_beyond_the_cache():
    """A crop by slicing (transformers' DynamicLayer.crop) keeps KV(MEMORY_CROP) of the storage it
    had: those bytes, per layer's key and value."""
    from mpt_kv.catalogue.assembly import model_with
    from mpt_kv.catalogue.variants import runner_factory
    from mpt_kv.model.cache import ConcatCache

    class SliceCrop(ConcatCache):
        def crop(self, n):
            self.kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]

    build = runner_factory("slice_crop", model_with(concat=SliceCrop))
    cropped = kv_bytes(operations.MEMORY_CROP)
    per_tensor = cropped // (2 * CFG.n_layers)
    with pytest.raises(PropertyFailure, match=rf"ops-retained crop -5 \(24 -> 19 positions\): {cropped} bytes more "
                                              rf".*layer 0 key \(3, 4, 19, 8\) lives in a storage of "
                                              rf"{kv_bytes(24) // 6} bytes, {per_tensor} more than it holds"):
        CHECKS["ops-retained/concat/crop"](build, "cpu", F32)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_crop_retains_the_cropped_tail_the_known_failure_says():
    """The measured figure of the known failure (DynamicLayer.crop slices; 4.55.4 and 5.24.0): the
    cropped 5 positions of every layer, KV(5) = 11520 bytes in fp32 at MEMORY_CASE."""
    with pytest.raises(PropertyFailure, match=rf"crop -5 \(24 -> 19 positions\): {kv_bytes(5)} bytes more retained"):
        CHECKS["ops-retained/concat/crop"]("transformers", "cpu", F32)
    CHECKS["ops-retained/concat/reorder"]("transformers", "cpu", F32)  # its reorder keeps nothing
