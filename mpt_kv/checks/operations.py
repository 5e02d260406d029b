"""The ops properties: what must hold after every operation of a program of cache operations
(`mpt_kv.checks.programs`: what a program is, how it is drawn and run; docs/operations.md).

ops-P1      the logits equal an uncached forward over each row's surviving token history (the
            oracle follows the same crops and reorders on the history and on each row's padding);
ops-P2      static = concat after the same program: logits, and K/V at every written position;
            never-written static slots are poisoned after the prefill and again after every crop
            (the slots past n must be masked again: the mask is the source of truth there);
ops-P3      no cached K/V shares storage with mixed_qkv or pins a per-step temporary
            (properties.aliasing_problems), and a crop or reorder pins no bytes beyond the cache
            that were not pinned before it (a crop by slicing keeps the cropped tail alive); in a
            paged cache declared copy-on-write, no operation writes into a block rows share;
ops-static-storage
            on the static path a crop, reorder or extend moves no cache buffer (a captured graph
            replays into the old address);
ops-memory  the transient of a reorder is at most one layer's K and V (a whole-cache copy is a
            finding, with its bytes at the seed's MPT-7B configs), and the transient of a
            k-token extend is bounded like a decode step's, with k queries;
ops-retained
            after a reorder or a crop, no bytes beyond the analytic cache of the surviving positions
            stay allocated (an old cache kept referenced, a cropped tail kept).

Every step is judged as it comes, so a wrong value before a crash is that step's failure (the
crash rule: `programs.run_op`).
"""

from __future__ import annotations

import gc

import torch

from mpt_kv.checks.accounting import (ROUNDING, TRANSIENT_SLACK, WeakQkvCapture, checked_meter, itemsize, retained,
                                      shape_of, step_allowance)
from mpt_kv.checks.cases import Context
from mpt_kv.checks.ceilings import decode_tokens, warm_up
from mpt_kv.checks.compare import PropertyFailure, assert_close, describe
from mpt_kv.checks.programs import Fed, History, Op, Program, ctx_of, program_of, run_op
from mpt_kv.checks.properties import WqkvCapture, aliasing_problems, fresh_memory_holds_nan, poison_unwritten, twin_of
from mpt_kv.checks.quantized import widened  # a declared quantized cache's bound
from mpt_kv.checks.results import copied
from mpt_kv.checks.static_shape import cache_tensors
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.memory import analytic
from mpt_kv.targets.layouts import BlockGrowth, held_blocks, kv_axes, layout_of, shared_block_writes


# --- ops-P1 --------------------------------------------------------------------------------------------------

def check_program_cached(runner, c: Context, program: Program | None = None, fed: Fed | None = None) -> list[str]:
    """ops-P1: after every operation the logits equal an uncached forward over the surviving history."""
    program, fed = program_of(c, program, fed)
    runner, twin = copied(runner), twin_of(c)
    oracle_runner = twin or runner
    ids, mask = program.case.inputs(c.device)
    L = program.max_len
    tol = c.tol(f"logits:{c.path}")
    against = "full forward" if twin is None else "the fp32 twin's full forward"
    with torch.inference_mode(), fresh_memory_holds_nan():
        session = runner.session(c.path, L, c.bucket)
        fed.add("prefill", ids)
        prefill = session.prefill(ids, mask)
        tol = widened(tol, session)  # a declared quantized cache's bound (checks/quantized.py)
        history = History(ids, mask)

        def oracle():
            pid, pmask = history.padded(L)
            fed.add("uncached", pid)
            return oracle_runner.logits(pid, pmask)

        full = oracle()
        S = ids.shape[1]
        assert_close(prefill, full[:, :S], tol, f"ops-P1 prefill logits vs {against}",
                     ctx_of(c, program, step="prefill"), where=mask.bool()[:, :, None])
        held = ["prefill"]  # each logits call is judged as it comes (a crop or reorder: by the next one)
        for step, op in enumerate(program.ops):
            tokens = program.tokens(step, op.k, c.device) if op.kind in ("decode", "extend") else None
            out = run_op(session, op, tokens, step, "ops-P1", c, fed, held)
            history.apply(op, tokens)
            if out is None:
                continue
            t = history.ids.shape[1]
            full = oracle()
            assert_close(out, full[:, t - op.k:t], tol,
                         f"ops-P1 {op.describe()} logits (batch, query, vocab) vs {against} over each row's "
                         f"surviving history (positions {t - op.k}..{t - 1})", ctx_of(c, program, step=step))
            held.append(f"step {step} ({op.describe()})")
    return c.notes


# --- ops-P2 --------------------------------------------------------------------------------------------------

def check_program_static_concat(runner, c: Context, program: Program | None = None, fed: Fed | None = None) -> list[str]:
    """ops-P2: the static path and the concat path run the same program; after every operation
    their logits and their K/V at every written position agree (bf16: each against the fp32
    twin's concat path). Never-written static slots are poisoned after the prefill and every crop."""
    program, fed = program_of(c, program, fed)
    runner, twin = copied(runner), twin_of(c)
    ids, mask = program.case.inputs(c.device)
    L = program.max_len
    with torch.inference_mode(), fresh_memory_holds_nan():
        concat, static = runner.session("concat", L), runner.session("static", L, c.bucket)
        oracle = None if twin is None else twin.session("concat", L)
        fed.add("prefill", ids)
        outs = [concat.prefill(ids, mask), static.prefill(ids, mask)]
        poison_unwritten(static.live, concat.live)  # a paged pool may be shared: the concat path's blocks are its own
        o = None if oracle is None else oracle.prefill(ids, mask)
        compare_paths(c, program, "prefill", concat, outs[0], static, outs[1], oracle, o, where=mask.bool()[:, :, None])
        held = ["prefill"]  # each step is compared as it comes
        for step, op in enumerate(program.ops):
            tokens = program.tokens(step, op.k, c.device) if op.kind in ("decode", "extend") else None
            a = run_op(concat, op, tokens, step, "ops-P2 (concat)", c, fed, held)
            b = run_op(static, op, tokens, step, "ops-P2 (static)", c, fed, held)
            o = None if oracle is None else run_op(oracle, op, tokens, step, "ops-P2 (fp32 twin)", c, Fed(), held)
            if op.kind == "crop":
                poison_unwritten(static.live, concat.live)  # the cropped slots [n, old written) must be masked again
            compare_paths(c, program, f"{step} ({op.describe()})", concat, a, static, b, oracle, o)
            held.append(f"step {step} ({op.describe()})")
    return c.notes


def compare_paths(c, program, step, concat, concat_logits, static, static_logits, oracle=None, oracle_logits=None,
                  where=None) -> None:
    t = concat.written
    real = concat.mask[:, :t].bool()[None, :, None, :, None]  # (1, B, 1, t, 1): tokens, not padding
    if oracle is None:
        judged, against, ref_logits = [("static", static, static_logits)], "concat", concat_logits
        ref_kv = kv_axes(concat, program.case.cfg)
    else:
        judged = [("static", static, static_logits), ("concat", concat, concat_logits)]
        against, ref_logits, ref_kv = "the fp32 twin's concat path", oracle_logits, oracle.kv()
    check_static_mask(c, program, step, concat, static)
    for path, session, logits in judged:
        if logits is not None:
            assert_close(logits, ref_logits, widened(c.tol(f"logits:{path}"), session), f"ops-P2 {path} vs {against} logits",
                         ctx_of(c, program, step=step), where=where)
        kv = kv_axes(session, program.case.cfg)
        for i, name in enumerate(("key", "value")):
            got, want = (torch.stack([pair[i][:, :, :t] for pair in x]) for x in (kv, ref_kv))
            assert_close(got, want, widened(c.tol(f"kv:{path}"), session),
                         f"ops-P2 {path} vs {against} cached {name}s (layer, batch, head, position, dim) at written "
                         f"positions [0, {t})", ctx_of(c, program, step=step), where=real)


def check_static_mask(c, program, step, concat, static) -> None:
    """The mask the static path last gave the target: the concat path's on written slots, and off on
    every slot past them (after a crop, the cropped slots: the mask is the source of truth there, and
    a decode step of optimum-habana's MPT applies no causal mask of its own)."""
    t, mask = concat.written, static.mask
    if mask is None:
        return
    if not torch.equal(mask[:, :t].bool(), concat.mask[:, :t].bool()):
        raise PropertyFailure(f"ops-P2 static mask on the written slots [0, {t}) differs from the concat path's "
                              f"[{describe(ctx_of(c, program, step=step))}]")
    ahead = mask[:, t:].bool()
    if ahead.any():
        rows, slots = ahead.nonzero(as_tuple=True)
        raise PropertyFailure(f"ops-P2 static mask after step {step}: {int(ahead.sum())} slots past the {t} written "
                              f"positions are still switched on (row {int(rows[0])}, slot {t + int(slots[0])}): "
                              f"stale K/V there are attended by any call that does not mask causally "
                              f"[{describe(ctx_of(c, program, step=step))}]")


# --- ops-P3 --------------------------------------------------------------------------------------------------

def pinned_by_storage(kv) -> dict[int, tuple[int, list[str]]]:
    """storage identity -> (bytes of it no cached tensor reaches, the cached tensors in it)."""
    tensors: dict[int, list] = {}
    for layer, pair in enumerate(kv):
        for name, t in zip(("key", "value"), pair):
            tensors.setdefault(storage_key(t), []).append((layer, name, t))
    out = {}
    for key, ts in tensors.items():
        nbytes = ts[0][2].untyped_storage().nbytes()
        out[key] = (nbytes - covered_bytes(nbytes, [t for _, _, t in ts]),
                    [f"layer {layer} {name} {tuple(t.shape)}" for layer, name, t in ts], nbytes)
    return out


def declared_blocks(session):
    """The session's BlockGrowth layout, if any: its block of slack per cached tensor is the cache's
    own (a buffer grown by an extend and replaced by the next crop is not a per-step temporary)."""
    layout = layout_of(session)
    return layout if isinstance(layout, BlockGrowth) else None


def check_program_aliasing(runner, c: Context, program: Program | None = None, fed: Fed | None = None) -> list[str]:
    """ops-P3: after every operation, `aliasing_problems`; after a crop or reorder, no storage of
    the cached K/V pins more bytes beyond the cache than it did before the operation (or than the
    block of slack per tensor a BlockGrowth layout declares); a paged cache declared copy-on-write
    (`PagedLayout(copy_on_write=True)`) wrote into no block two rows share (`shared_block_writes`)."""
    program, fed = program_of(c, program, fed)
    ids, mask = program.case.inputs(c.device)
    capture = WqkvCapture(runner.wqkv_modules())
    try:
        with torch.inference_mode():
            session = runner.session(c.path, program.max_len, c.bucket)
            fed.add("prefill", ids)
            session.prefill(ids, mask)
            problems, storages = aliasing_problems(kv_axes(session, program.case.cfg), capture.outputs, {}, "prefill",
                                                   last=not program.ops,
                                                   layout=declared_blocks(session))
            fail_p3(problems, "prefill", c, program)
            held = ["prefill"]  # each step is judged as it comes
            for step, op in enumerate(program.ops):
                tokens = program.tokens(step, op.k, c.device) if op.kind in ("decode", "extend") else None
                before = pinned_by_storage(session.kv())
                shared_before = held_blocks(layout_of(session))  # a copy-on-write paged cache's blocks
                run_op(session, op, tokens, step, "ops-P3", c, fed, held)
                kv = session.kv()
                layout = layout_of(session)
                blocks = layout if isinstance(layout, BlockGrowth) else None
                problems, storages = aliasing_problems(kv, capture.outputs, storages, f"{step} ({op.describe()})",
                                                       last=step == len(program.ops) - 1, layout=blocks)
                problems += shared_block_writes(shared_before, layout, f"{step} ({op.describe()})")
                if op.kind in ("crop", "reorder"):
                    for key, (pinned, names, nbytes) in pinned_by_storage(kv).items():
                        was = before.get(key, (0,))[0]
                        declared = storages[key].declared if key in storages else 0
                        if pinned > max(was, declared):
                            problems.append(f"after {op.describe()}, {' and '.join(names[:4])} "
                                            f"{'pin' if len(names) > 1 else 'pins'} {pinned - was} bytes beyond the "
                                            f"cache (its storage holds {nbytes} bytes, {pinned} of them unreached by "
                                            f"the cached tensors; {was} before the {op.kind})"
                                            + (": a crop by slicing keeps the cropped tail alive" if op.kind == "crop"
                                               else ""))
                fail_p3(problems, step, c, program, op)
                held.append(f"step {step} ({op.describe()})")
    finally:
        capture.close()
    return c.notes


def fail_p3(problems, step, c, program, op: Op | None = None) -> None:
    if problems:
        what = "prefill" if op is None else op.kind
        raise PropertyFailure(f"ops-P3 cache aliasing after {what} (step {step}): " + "; ".join(problems)
                              + f" [{describe(ctx_of(c, program, step=step, operation=what))}]")


# --- ops-static-storage ---------------------------------------------------------------------------------------

def check_program_static_storage(runner, c: Context, program: Program | None = None, fed: Fed | None = None) -> list[str]:
    """ops-static-storage: on the static path every tensor the cache lives in (each layer's K and V
    buffer; a paged cache's pools and block table; a quantized cache's codes and scales:
    `static_shape.cache_tensors`) keeps its storage, at its address, from the prefill through every
    operation of the program. A CUDA or HPU graph captured on a decode step replays into the
    addresses it captured: a crop or a reorder that replaces a buffer leaves the graph reading and
    writing memory the cache no longer holds. The old buffers are held until the check ends, so a
    replaced one cannot come back at the same address by chance."""
    program, fed = program_of(c, program, fed)
    ids, mask = program.case.inputs(c.device)
    with torch.inference_mode():
        session = runner.session(c.path, program.max_len, c.bucket)
        fed.add("prefill", ids)
        session.prefill(ids, mask)
        first = {what: t for what, _, t in cache_tensors(session)}
        held = ["prefill"]
        for step, op in enumerate(program.ops):
            tokens = program.tokens(step, op.k, c.device) if op.kind in ("decode", "extend") else None
            run_op(session, op, tokens, step, "ops-static-storage", c, fed, held)
            now = {what: t for what, _, t in cache_tensors(session)}
            moved = [f"{what} moved from storage {first[what].untyped_storage().data_ptr():#x} to "
                     f"{t.untyped_storage().data_ptr():#x}" for what, t in now.items()
                     if what in first and t.untyped_storage().data_ptr() != first[what].untyped_storage().data_ptr()]
            gone = sorted(set(first) - set(now))
            if moved or gone:
                parts = moved[:4] + ([f"and {len(moved) - 4} more"] if len(moved) > 4 else [])
                parts += [f"{', '.join(gone[:4])} no longer in the cache"] if gone else []
                raise PropertyFailure(
                    f"ops-static-storage: after {op.describe()} (step {step}) the static cache's storage moved: "
                    + "; ".join(parts) + ". A graph captured on a decode step replays into the old addresses; a "
                    f"static cache keeps its buffers and writes into them [{describe(ctx_of(c, program, step=step, operation=op.kind))}]")
            held.append(f"step {step} ({op.describe()})")
    return c.notes


# --- ops-memory ----------------------------------------------------------------------------------------------

MEMORY_BEAM_INDEX = (2, 2, 0)
MEMORY_EXTEND = 8
MEMORY_CROP = 5


def memory_beam_index(batch: int) -> tuple[int, ...]:
    """The measured reorder: `MEMORY_BEAM_INDEX` for 3 rows (two beams from the last row, the first
    row moved); for other batches the last row twice and row 0 last (batch 1: the identity)."""
    return MEMORY_BEAM_INDEX if batch == 3 else tuple([batch - 1] * (batch - 1) + [0])


def whole_cache_finding(extra: int, layer_bytes: int) -> str:
    """What a whole-cache copy per reorder costs at the seed's MPT-7B configs (bf16)."""
    shape, rows = analytic.PRESETS["mpt-7b"], []
    for row in analytic.SEED_TABLE:
        if row.version != "after":
            continue
        whole = analytic.kv_cache_bytes(shape, row.batch, row.max_input + row.max_new, analytic.SEED_ITEMSIZE)
        rows.append(f"batch {row.batch}, {row.max_input} + {row.max_new} tokens: {whole / analytic.GiB:.2f} GiB")
    return (f"a whole-cache copy: {extra} bytes above the per-layer bound ({layer_bytes} bytes, one layer's K and V); "
            "at MPT-7B bf16, each beam step would hold a second whole KV cache: " + "; ".join(rows))


def quick_readings(meter):
    """(allocated, peak, reset_peak) of `meter`. The cpu meter is read from its tracker without the
    `gc.collect()` of `CpuMeter.allocated()`: nothing here makes reference cycles, and in a large
    process (the kill matrix) each collection costs a fraction of a second."""
    tracker = getattr(meter, "tracker", None)
    if tracker is not None:
        return (lambda: tracker.live), (lambda: tracker.peak), tracker.reset_peak
    return meter.allocated, meter.peak, meter.reset_peak


def check_operation_memory(runner, c: Context, operation: str | None = None) -> list[str]:
    """ops-memory: the transient (peak above the level before and after) of one reorder or one
    k-token extend (`c.operation`) on a filled cache, measured exactly on CPU (`mpt_kv.memory.meter`)."""
    operation = operation or c.operation
    case, device = c.case, torch.device(c.device)
    cfg, B = case.cfg, case.batch
    ids, mask = case.inputs(device)
    L, s = case.total_len, itemsize(c.dtype)
    masks = 3 * B * L * 8  # the session's old and new mask, an index
    meter = checked_meter(device)
    with torch.inference_mode(), meter:
        session = runner.session(c.path, L, c.bucket)
        session.prefill(ids, mask)
        k0, v0 = session.kv()[0]
        layer_kv = (k0.numel() + v0.numel()) * s  # one layer's K and V as the target stores them now
        g = torch.Generator().manual_seed(case.seed)
        tokens = torch.randint(0, cfg.vocab_size, (B, MEMORY_EXTEND), generator=g).to(device)
        del k0, v0
        allowance, allowed = step_allowance(session, cfg, B, L, s, MEMORY_EXTEND)  # the decode steps' rule
        level, peak_of, reset = quick_readings(meter)
        reset()
        before = level()
        op = Op("reorder", index=memory_beam_index(B)) if operation == "reorder" else Op("extend", MEMORY_EXTEND)
        out = run_op(session, op, tokens, "measured", "ops-memory", c, Fed())
        if operation == "reorder":
            bound = layer_kv + masks
        else:
            shape = shape_of(cfg)
            bound = (TRANSIENT_SLACK * analytic.layer_transients(shape, B, MEMORY_EXTEND, L, s, softmax_itemsize=4)
                     + 2 * analytic.logits_bytes(shape, B, MEMORY_EXTEND, trim=False, itemsize=s)
                     + B * L * (2 * 8 + 4 + 1) + (analytic.kv_cache_bytes(shape, B, L, s) if c.path == "concat" else 0)
                     + allowance)
        del out
        peak, after = peak_of(), level()
    transient = peak - max(before, after)
    what = f"{operation}" + (f" of {MEMORY_EXTEND} tokens" if operation == "extend" else f" by {list(op.index)}")
    ctx = describe(c.ctx(operation=operation, before=before, peak=peak, after=after))
    if transient > bound:
        finding = whole_cache_finding(transient - bound, layer_kv) if operation == "reorder" else (
            f"{transient - bound} bytes above the bound of a cached call with {MEMORY_EXTEND} queries"
            + (f" (it includes {allowed})" if allowance else ""))
        raise PropertyFailure(f"ops-memory {what}: transient {transient} bytes > bound {bound} bytes: {finding} [{ctx}]")
    return [f"ops-memory {what}: transient {transient} bytes, bound {bound} ({transient / bound:.2f} of it) [{ctx}]"]


# --- ops-retained --------------------------------------------------------------------------------------------

def check_operation_retained(runner, c: Context, operation: str | None = None) -> list[str]:
    """ops-retained: what one reorder (`memory_beam_index`) or one crop (`MEMORY_CROP` positions,
    after `MEMORY_EXTEND` decode steps; `c.operation`) leaves allocated, measured exactly on CPU.
    Before and after it, the bytes allocated above the level before the session are compared with
    the analytic cache of the positions the session holds, as the memory checks count a cache
    (`ceilings.retained`: the layout's own storage, a pool kept from a warm-up generation as the
    cache, the session's mask and counters as bookkeeping): what the operation adds beyond it
    fails. ops-memory bounds the transient, the peak above max(before, after); an operation that
    keeps the old cache referenced (for an undo, a rollback) raises "after" too, so its transient
    reads small while the cache is held twice, and a crop that keeps a view of the old storage
    holds the cropped tail: both show here, with the bytes and where they are."""
    operation = operation or c.operation
    case, device = c.case, torch.device(c.device)
    cfg, B, L, s = case.cfg, case.batch, case.total_len, itemsize(c.dtype)
    ids, mask = case.inputs(device)
    tokens = decode_tokens(case, device)
    model = getattr(runner, "model", None)
    weights = [*model.parameters(), *model.buffers()] if model is not None else []
    preexisting = {storage_key(t) for t in [ids, mask, tokens, *weights]}
    meter = checked_meter(device)
    qkv = WeakQkvCapture(runner)
    gc.freeze()  # pre-existing objects out of the meter's gc.collect()
    try:
        with torch.inference_mode(), meter:
            warm = warm_up(runner, c.path, case, c.bucket, ids, mask, tokens)  # a pool, lazily built state
            base = meter.allocated()
            kept = {key: ref for key, ref in warm.items() if ref() is not None}
            session = runner.session(c.path, L, c.bucket)
            session.prefill(ids, mask)
            if operation == "crop":
                for step in range(case.new_tokens):
                    session.decode(tokens[step])
                op = Op("crop", MEMORY_CROP)
            else:
                op = Op("reorder", index=memory_beam_index(B))

            def held():
                n = session.written if c.path == "concat" else L  # the positions the path keeps
                return retained(session, meter.allocated() - base, n, cfg, B, s, preexisting, kept, qkv)

            excess_before, written = held().excess, session.written  # (its accounting holds the old tensors: gone)
            run_op(session, op, None, "measured", "ops-retained", c, Fed())
            after, now = held(), session.written
            slack = ROUNDING.get(device.type, 4096) * (len(after.acc.kv_storages) + len(after.acc.bookkeeping) + 2)
            growth, excess_after = after.excess - excess_before, after.excess
            message = None
            if growth > slack:
                tolerance = "exact" if meter.exact else f"allowed {slack}: allocator rounding"
                message = (f"ops-retained {op.describe()} ({written} -> {now} positions): {growth} bytes more retained "
                           f"beyond the analytic cache of the surviving positions after it than before it "
                           f"({excess_before} before, {excess_after} after; {tolerance}): expected {after.expected}. "
                           f"{after.explain()}")
            del session, after
    finally:
        gc.unfreeze()
        qkv.close()
    ctx = describe(c.ctx(operation=operation, positions=f"{written} -> {now}"))
    if message:
        raise PropertyFailure(f"{message} [{ctx}]")
    return [f"ops-retained {op.describe()}: {excess_before} bytes beyond the analytic cache before it, {excess_after} "
            f"after it [{ctx}]"]
