"""Cache layouts beyond contiguous tensors (mpt_kv/targets/layouts.py, docs/targets.md "Cache
layouts"): a paged target and a block-growth target written from the docs pass every check of the
registry; P2 poisons a paged cache in its pool through the block table; P3 and memory accept the
slack a layout declares and fail the slack beyond it, naming row or layer and bytes."""

import dataclasses
import os

import pytest
import torch

import mpt_kv
from mpt_kv.checks.registry import applies
from examples import block_mpt, paged_mpt
from mpt_kv.catalogue.designs import (DESIGNS, BlockGrowthConcatCache, BlockGrowthSession, PagedMPT, PagedSession,
                                      model_with)
from mpt_kv.catalogue.variants import VARIANTS, runner_factory
from mpt_kv.checks import ceilings as C
from mpt_kv.checks import accounting as A
from mpt_kv.checks import properties as P
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict

CPU, F32 = torch.device("cpu"), torch.float32
CFG = ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32)


def reaches_the_layout(target: str, check: mpt_kv.Check) -> bool:
    """Whether a check runs code of the example's own layout. P0 is the uncached forward (the
    reference's code in both examples); the block example's static path is the reference's cache.
    The default run leaves those out (their code is the reference's, checked by its own tests);
    MPT_KV_LAYOUT_ALL_CHECKS=1 runs every check on both (measured: 101 passed)."""
    if os.environ.get("MPT_KV_LAYOUT_ALL_CHECKS"):
        return True
    if check.property == "P0":
        return False
    return target == "paged" or check.property == "P2" or check.path == "concat"


@pytest.mark.parametrize("build,check", [
    pytest.param(build, check.id, id=f"{name}-{check.id}")
    for name, build in (("paged", paged_mpt.build), ("block", block_mpt.build))
    for check in mpt_kv.CHECKS.values() if applies(check, build) and reaches_the_layout(name, check)])
def test_every_check_passes_on_a_paged_and_a_block_growth_target(build, check):
    """Every check (in fp32, on cpu) of the registry that reaches the layout passes on both examples,
    the memory checks included: the layouts are declared only as docs/targets.md says."""
    mpt_kv.CHECKS[check](build, "cpu", F32)


# --- P2: poison through the block table --------------------------------------------------------------

def pools(num_blocks, bs=4, layers=2):
    return [(torch.zeros(num_blocks, 1, bs, 2), torch.zeros(num_blocks, 1, bs, 2)) for _ in range(layers)]


def test_poison_fills_unwritten_slots_of_handed_out_blocks_and_blocks_no_table_holds():
    layout = mpt_kv.PagedLayout(pools(6), torch.tensor([[2, 0, -1], [1, 3, -1]]), 4, [5, 5])
    other = mpt_kv.PagedLayout(layout.pools, torch.tensor([[5, -1, -1]]), 4, [3])  # another session on the pool
    filled = mpt_kv.targets.layouts.poison_paged(layout, 5, P.POISON, other)
    assert filled == 3 + 3 + 4  # positions 5-7 of rows 0 and 1 (blocks 0, 3); block 4 whole
    for k, v in layout.pools:
        for pool in (k, v):
            poisoned = (pool == P.POISON).all(dim=(1, 3))  # (block, slot)
            assert poisoned[[2, 1]].sum() == 0, "written positions 0-3 must be left alone"
            assert poisoned[[0, 3], 1:].all() and not poisoned[[0, 3], 0].any(), "position 4 is written, 5-7 not"
            assert poisoned[4].all() and not poisoned[5].any(), "block 4 is nobody's; block 5 the other session's"


def test_p2_refuses_kv_copies_that_no_layout_declares():
    """A paged session whose kv() gathers copies and that declares no layout: P2's poison would land
    in the copies and check nothing. It is an error that says so, not a pass."""

    class Undeclared(PagedSession):
        def cache_layout(self):
            return None

    runner = runner_factory("undeclared_paged", PagedMPT, Undeclared)(CFG, random_state_dict(CFG), CPU, F32)
    case = P.Case(CFG, (5, 3), 3, seed=1)
    with pytest.raises(RuntimeError, match="kv\\(\\) returns copies, not the stored cache"):
        P.check_static_equals_concat(runner, P.Context("undeclared_paged", "cpu", F32, case, "static"))


# --- P3: the pool stays; block slack only as declared --------------------------------------------------

def test_p3_fails_a_pool_that_moves_within_a_generation():
    first = mpt_kv.PagedLayout(pools(4, layers=1), torch.tensor([[0, -1]]), 4, [3])
    problems, seen = P.aliasing_problems(first.pools, [None], {}, "prefill", last=False, layout=first)
    assert problems == []
    moved = dataclasses.replace(first, pools=pools(4, layers=1))
    problems, _ = P.aliasing_problems(moved.pools, [None], seen, 0, last=True, layout=moved)
    assert len(problems) == 2 and "the paged cache's pool of layer 0 key (4, 1, 4, 2) moved after step prefill" in problems[0]


GROWS_ON_LAST_STEP = P.Case(CFG, (4,), 9, seed=2)  # blocks of 4: the cache grows at positions 4, 8 and 12 (step 8)


def p3(build, name, case=GROWS_ON_LAST_STEP):
    runner = build(case.cfg, random_state_dict(case.cfg, seed=case.seed), CPU, F32)
    P.check_no_aliasing(runner, P.Context(name, "cpu", F32, case, "concat"))


def test_p3_accepts_a_block_grown_on_the_last_step_only_when_declared():
    p3(DESIGNS["cache_growing_in_blocks"].build, "cache_growing_in_blocks")

    class Undeclared(BlockGrowthSession):
        def cache_layout(self):
            return None

    build = runner_factory("undeclared_blocks", model_with(concat=BlockGrowthConcatCache), Undeclared)
    with pytest.raises(PropertyFailure, match=r"after step 8: .* in a buffer made at the last step \(8\)"):
        p3(build, "undeclared_blocks")


def test_p3_fails_block_slack_beyond_the_declared_block_naming_layer_and_bytes():
    # capacity: the blocks needed and two more; 4 + 9 = 13 positions: grown at position 12 to 4 blocks
    B, H, hd = 1, CFG.n_heads, CFG.head_dim
    held, capacity = 13, 24
    with pytest.raises(PropertyFailure) as e:
        p3(VARIANTS["block_growth_beyond_one_block"].build, "block_growth_beyond_one_block")
    msg = str(e.value)
    pinned, declared = B * H * (capacity - held) * hd * 4, B * H * 4 * hd * 4
    assert f"layer 0 key (1, 3, 13, 8) lives in a buffer made at the last step (8)" in msg, msg
    assert f"{pinned} bytes pinned beyond the cache (the layout declares up to {declared} of block slack)" in msg, msg


# --- ops-P3: a crop of a block-grown cache within the declared block, and beyond it ---------------------

def ops_p3(build, name):
    """6 positions (capacity 8), an extend of 8 (14: grown to 16), a crop of 6 back to 8, a decode."""
    from mpt_kv.checks import operations, programs

    program = programs.Program(P.Case(CFG, (6, 2), 10, seed=22),
                               (programs.Op("extend", 8), programs.Op("crop", 6), programs.Op("decode")))
    runner = build(CFG, random_state_dict(CFG, seed=22), CPU, F32)
    operations.check_program_aliasing(runner, P.Context(name, "cpu", F32, program.case, "concat"), program)


class SliceCropBlockCache(BlockGrowthConcatCache):
    def crop(self, n):
        for layer, (k, v) in enumerate(self.kv):
            self.kv[layer] = (k[:, :, :n], v[:, :, :n])  # the 16-position buffer kept: 8 positions of tail


def test_ops_p3_accepts_a_block_grown_crop_within_the_declared_block_and_fails_a_tail_beyond_it():
    """The design's crop copies into block-rounded buffers: the buffer the extend grew (made at one
    step, replaced at the next) and the crop's block of slack are declared; a crop by slicing keeps
    8 positions of tail where one block (4) is declared."""
    ops_p3(DESIGNS["cache_growing_in_blocks"].build, "cache_growing_in_blocks")
    build = runner_factory("slice_crop_blocks", model_with(concat=SliceCropBlockCache), BlockGrowthSession)
    B, H, hd = 2, CFG.n_heads, CFG.head_dim
    tail, before = B * H * 8 * hd * 4, B * H * 2 * hd * 4  # 16 - 8 positions after the crop, 16 - 14 before it
    with pytest.raises(PropertyFailure, match=rf"after crop -6, layer 0 key \(2, 3, 8, 8\) pins {tail - before} bytes "
                                              rf"beyond the cache \(its storage holds {4 * tail // 2} bytes, {tail} of them "
                                              rf"unreached .*; {before} before the crop\): a crop by slicing"):
        ops_p3(build, "slice_crop_blocks")


# --- memory: handed-out blocks, one block of slack per row; declared block slack -----------------------

MEMORY_CASE = P.Case(CFG, (5, 5), 3, seed=0)


def measure(build, path="concat", case=MEMORY_CASE):
    runner = build(case.cfg, random_state_dict(case.cfg), CPU, F32)
    return C.measure(runner, case, path, CPU, F32, target=getattr(build, "__name__", "t"))


def test_memory_fails_a_row_holding_more_than_one_block_of_slack_naming_row_layer_and_bytes():
    m = measure(VARIANTS["paged_two_blocks_of_slack"].build)
    msg = m.problems[0] if m.problems else ""
    H, hd, bs = CFG.n_heads, CFG.head_dim, 4
    extra = 4 - (5 // bs + 1)  # 2 blocks for 5 positions + 2 ahead, 2 allowed
    per_layer = 2 * extra * H * bs * hd * 4
    too_many = 2 * CFG.n_layers * per_layer  # 2 rows, every layer's key and value pool
    assert f"after prefill, {m.prefill_retained} bytes allocated, {too_many} bytes too many (exact)" in msg, msg
    for row in (0, 1):
        assert (f"row {row} holds 4 blocks of block_size 4 for 5 positions: {extra} beyond the one block of slack a row "
                f"may have (layer 0 {per_layer} bytes, layer 1 {per_layer} bytes in its key and value pools)") in msg, msg


def test_memory_counts_blocks_no_row_holds_in_a_pool_the_generation_allocated():
    class OwnPoolMPT(PagedMPT):
        def new_cache(self, path, batch, max_len=None, fill=None):
            self.block_pool = None  # a pool per generation, twice what it needs
            return super().new_cache(path, batch, max_len, fill)

    m = measure(runner_factory("own_pool", OwnPoolMPT, PagedSession))
    H, hd, bs = CFG.n_heads, CFG.head_dim, 4
    blocks, handed = 2 * 2 * 2, 2 * 2  # 2 rows x 2 blocks (8 positions), twice over; 2 rows x 2 blocks handed out
    msg = m.problems[0] if m.problems else ""
    assert (f"layer 1 value pool ({blocks}, {H}, {bs}, {hd}): {blocks - handed} of its {blocks} blocks are handed out "
            f"to no row ({(blocks - handed) * H * bs * hd * 4} bytes), in a pool this generation allocated") in msg, msg


def test_memory_fails_block_slack_beyond_the_declared_block_naming_layer_and_bytes():
    m = measure(VARIANTS["block_growth_beyond_one_block"].build)
    msg = m.problems[0] if m.problems else ""
    B, H, hd = 2, CFG.n_heads, CFG.head_dim
    held, capacity = 5, 16  # blocks of 4: 2 needed and 2 more
    beyond, declared = B * H * (capacity - held) * hd * 4, B * H * 4 * hd * 4
    assert (f"layer 0 key (2, 3, 5, 8) lives in a storage of {B * H * capacity * hd * 4} bytes, {beyond} more than it "
            f"holds (a buffer {beyond} bytes larger than the cached tensors; BlockGrowth(block_size=4) declares up to "
            f"{declared}, {beyond - declared} beyond it)") in msg, msg


def test_an_undeclared_block_buffer_is_not_called_mixed_qkv():
    """Without BlockGrowth the block buffer is extra bytes, named as a buffer larger than the cached
    tensors: only a storage that was a Wqkv output is called mixed_qkv."""

    class Undeclared(BlockGrowthSession):
        def cache_layout(self):
            return None

    m = measure(runner_factory("undeclared_blocks", model_with(concat=BlockGrowthConcatCache), Undeclared))
    msg = m.problems[0] if m.problems else ""
    assert "bytes too many (exact)" in msg and "a buffer 576 bytes larger than the cached tensors" in msg, msg
    assert "mixed_qkv" not in msg, msg


@pytest.mark.parametrize("design", ["cache_growing_in_blocks", "cache_growing_in_blocks_of_16"])
@pytest.mark.parametrize("config", C.CONFIGS, ids=lambda c: f"B{c.batch}-in{c.max_input}-new{c.max_new}")
def test_a_block_growth_cache_passes_memory_whatever_its_block_size(design, config):
    """A decode step that grows a BlockGrowth(b) cache holds the old buffers and new ones of whole blocks:
    the bound follows the declared block (vLLM's 16 failed at the step that grew, B2-in8-new24's step 8,
    while a bound counting the tokens held let blocks of 4 pass in the slack)."""
    runner = DESIGNS[design].build(config.cfg, random_state_dict(config.cfg), CPU, F32)
    m = C.measure(runner, config.case(), "concat", CPU, F32, target=design)
    assert not m.problems, m.problems


def test_the_block_growth_bound_counts_whole_blocks_and_says_so():
    cfg = C.CONFIGS[1].cfg
    assert A.new_cache_length(17, 16) == 32 and A.new_cache_length(17, None) == 17 and A.new_cache_length(32, 16) == 32
    assert A.decode_bound(cfg, 2, 17, 4, "concat", 16) - A.decode_bound(cfg, 2, 17, 4, "concat") == \
        C.analytic.kv_cache_bytes(A.shape_of(cfg), 2, 15, 4)
    assert "KV(32)" in A.decode_bound_text(cfg, 2, 17, 4, "concat", 16) and "whole blocks of 16" in \
        A.decode_bound_text(cfg, 2, 17, 4, "concat", 16)
