"""Blocks shared between beams (issue 26): a paged cache declared `PagedLayout(copy_on_write=True)`
may hand one pool block to several rows at the same table index (vLLM's fork of a sequence for
beam search) as long as nobody writes it. The catalogue's `paged_copy_on_write` shares blocks and
passes; `paged_write_into_shared_block` writes into a shared block and ops-P3 names the write; the
same sharing undeclared is still "one block holds positions of two places"."""

import dataclasses

import pytest
import torch

import mpt_kv
from mpt_kv.catalogue.designs import DESIGNS, CopyOnWritePagedCache, CopyOnWritePagedMPT, CopyOnWritePagedSession
from mpt_kv.catalogue.variants import VARIANTS, SharedBlockPagedCache, runner_factory
from mpt_kv.checks import accounting as A
from mpt_kv.checks import operations, programs
from mpt_kv.checks.cases import Case, Context
from mpt_kv.checks.registry import CHECKS
from mpt_kv.errors import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets import layouts

CPU, F32 = torch.device("cpu"), torch.float32
CFG = ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32)
# 3 beams, block_size 4: prompts padded to 5 (two blocks, the second with one position); a reorder
# with repeats makes rows 0 and 1 share row 2's blocks, and the next decode writes position 6
BEAM = programs.Program(Case(CFG, (5, 3, 4), 6, seed=21), (
    programs.Op("decode"), programs.Op("reorder", index=(2, 2, 0)), programs.Op("decode"), programs.Op("decode")),
    "beam")


def pools(num_blocks=6, layers=1):
    return [(torch.zeros(num_blocks, 1, 4, 2), torch.zeros(num_blocks, 1, 4, 2)) for _ in range(layers)]


class Written:
    written = 5


@pytest.mark.parametrize("table, cow, error", [
    ([[0, 1], [0, 1]], True, None),                       # two beams forked from one: the same blocks, same indices
    ([[0, 1], [0, 1]], False, r"pool block 0 is row 0's block 0 and row 1's block 0: one block holds positions of "
                              r"two places .*declare PagedLayout\(copy_on_write=True\)"),
    ([[0, 1], [2, 0]], True, r"pool block 0 is row 0's block 0 and row 1's block 1: one block holds positions of two "
                             r"places \[block table \(2, 2\), block_size 4\]"),  # other positions: never legitimate
    ([[0, 0], [1, 2]], True, r"pool block 0 is row 0's block 0 and row 0's block 1"),
])
def test_a_declared_copy_on_write_layout_accepts_shared_blocks_only_at_one_table_index(table, cow, error):
    layout = mpt_kv.PagedLayout(pools(), torch.tensor(table), 4, [5, 5], copy_on_write=cow)
    if error is None:
        layouts.check_paged(layout, Written())
        assert layout.shared() == {0: [(0, 0), (1, 0)], 1: [(0, 1), (1, 1)]}
    else:
        with pytest.raises(PropertyFailure, match=error):
            layouts.check_paged(layout, Written())


def test_copy_on_write_must_be_a_bool():
    with pytest.raises(ValueError, match=r"copy_on_write='yes': expected True or False"):
        layouts.check_paged(mpt_kv.PagedLayout(pools(), torch.tensor([[0]]), 4, [5], copy_on_write="yes"), Written())


def test_shared_block_writes_names_the_block_its_rows_the_layer_and_the_position():
    layout = mpt_kv.PagedLayout(pools(layers=2), torch.tensor([[0, 1], [0, 1], [2, 3]]), 4, [6, 6, 6],
                                copy_on_write=True)
    before = layouts.held_blocks(layout)
    assert layouts.shared_block_writes(before, layout, 3) == [], "nothing written: nothing to say"
    layout.pools[1][1][1, :, 1] = 7.0  # layer 1's value pool, block 1 (positions 4-7), slot 1: position 5
    layout.pools[0][0][3, :, 2] = 7.0  # block 3 is row 2's alone: it may be written
    problems = layouts.shared_block_writes(before, layout, 3)
    assert problems == ["step 3 wrote into pool block 1, which row 0 and row 1 share (table index 1): layer 1 value "
                        "position 5 changed in every row that holds it. A block rows share is read-only: copy-on-write "
                        "copies it into a fresh block for the row that writes"], problems
    # a block no row held before, handed to two rows by the step
    fresh = dataclasses.replace(layout, block_table=torch.tensor([[0, 1, 4], [0, 1, 4], [2, 3, 5]]))
    assert layouts.shared_block_writes(layouts.held_blocks(layout), fresh, 4)[-1] == (
        "pool block 4 (table index 2) was handed to row 0 and row 1 at once by step 4: no row held it before, and a "
        "block rows share is never written")
    undeclared = dataclasses.replace(layout, copy_on_write=False)
    assert layouts.held_blocks(undeclared) is None and layouts.shared_block_writes(before, undeclared, 3) == []


def beam_session(build):
    runner = build(CFG, random_state_dict(CFG, seed=21), CPU, F32)
    session = runner.session("concat", BEAM.max_len)
    ids, mask = BEAM.case.inputs(CPU)
    session.prefill(ids, mask)
    session.decode(BEAM.tokens(0, 1, CPU))
    return session


def test_the_design_shares_blocks_after_a_reorder_and_copies_the_one_a_row_writes():
    """What makes the design a copy-on-write one, seen in its table: the reorder shares every block of
    row 2 between rows 0 and 1 (no block copied), the next decode gives one of them a fresh copy of
    the block it writes, and the prompt's full block stays shared."""
    session = beam_session(DESIGNS["paged_copy_on_write"].build)
    pool_size = len(session.cache.pool.free)
    source = session.cache.host[2]
    session.reorder(torch.tensor([2, 2, 0]))
    layout = session.cache_layout()
    assert layout.copy_on_write and session.cache.host[0] == session.cache.host[1] == source
    assert sorted(layout.shared()) == sorted(b for b in source if b >= 0)
    assert len(session.cache.pool.free) == pool_size + 2, "row 1's two blocks went back to the pool, none was taken"
    session.decode(BEAM.tokens(2, 1, CPU))  # position 6: block index 1
    table = session.cache.host
    assert table[0][0] == table[1][0] == source[0], "the prompt's full block is still shared"
    assert table[0][1] != table[1][1] and source[1] in (table[0][1], table[1][1]), "one row copied the block it wrote"


def test_ops_p3_passes_the_design_and_names_the_variants_write_into_a_shared_block():
    c = Context("cow", "cpu", F32, BEAM.case, "concat")
    design = DESIGNS["paged_copy_on_write"].build(CFG, random_state_dict(CFG, seed=21), CPU, F32)
    operations.check_program_aliasing(design, c, BEAM)
    variant = VARIANTS["paged_write_into_shared_block"].build(CFG, random_state_dict(CFG, seed=21), CPU, F32)
    with pytest.raises(PropertyFailure, match=r"ops-P3 cache aliasing after decode \(step 2\): step 2 \(decode\) wrote "
                                              r"into pool block \d+, which row 0 and row 1 share \(table index 1\): layer "
                                              r"0 key position 6 changed in every row that holds it"):
        operations.check_program_aliasing(variant, c, BEAM)


def test_the_same_sharing_undeclared_is_a_block_in_two_places():
    class Undeclared(CopyOnWritePagedSession):
        def cache_layout(self):
            layout = super().cache_layout()
            return None if layout is None else dataclasses.replace(layout, copy_on_write=False)

    build = runner_factory("cow_undeclared", CopyOnWritePagedMPT, Undeclared, capabilities=mpt_kv.Capabilities(
        cache_pool=True))
    with pytest.raises(PropertyFailure, match=r"paged cache: pool block \d+ is row 0's block 0 and row 1's block 0: one "
                                              r"block holds positions of two places .*declare PagedLayout\(copy_on_write"):
        operations.check_program_aliasing(build(CFG, random_state_dict(CFG, seed=21), CPU, F32),
                                        Context("cow_undeclared", "cpu", F32, BEAM.case, "concat"), BEAM)


class HandsOneBlockToTwoRows(SharedBlockPagedCache, CopyOnWritePagedCache):
    """paged_block_shared_between_rows's allocator bug in a cache declared copy-on-write."""


def test_a_fresh_block_handed_to_two_rows_is_caught_under_the_declaration_too():
    class Model(CopyOnWritePagedMPT):
        cache_class = HandsOneBlockToTwoRows

    build = runner_factory("cow_hands_one_block_to_two", Model, CopyOnWritePagedSession,
                           capabilities=mpt_kv.Capabilities(cache_pool=True))
    with pytest.raises(PropertyFailure, match=r"P3 cache aliasing after step \d+: pool block \d+ \(table index \d+\) was "
                                              r"handed to row 0 and row \d+ at once by step \d+"):
        CHECKS["P3/concat"](build, "cpu", F32)
    # undeclared, the variant in the catalogue: still killed by the layout check
    with pytest.raises(PropertyFailure, match="one block holds positions of two places"):
        CHECKS["P3/concat"](VARIANTS["paged_block_shared_between_rows"].build, "cpu", F32)


def test_memory_counts_a_shared_block_once():
    layout = mpt_kv.PagedLayout(pools(), torch.tensor([[0, 1], [0, 1], [2, 3]]), 4, [5, 5, 5], copy_on_write=True)
    count = A.paged_count(layout, 5, {})
    per_block = layout.block_bytes()
    assert count.handed == 4 * per_block and count.accepted == 4 * per_block
    over = dataclasses.replace(layout, block_table=torch.tensor([[0, 1, 4], [0, 1, 5], [2, 3, -1]]))
    assert A.paged_count(over, 5, {}).accepted == 4 * per_block, "rows 0 and 1 each hold a block beyond the 2 allowed"
