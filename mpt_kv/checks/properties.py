"""The properties every implementation must hold, as plain functions (pytest and the kill
matrix both call them). Each raises `PropertyFailure` naming target, device, dtype, shapes,
generation, step, layer and the error size; each returns notes (e.g. near-ties in greedy
decoding) for the report.

P0 oracle               uncached logits equal the reference's
P1 cached = uncached    every prefill and decode step equals a full forward over the same tokens
P2 static = concat      cache contents and logits agree; never-written slots do not leak
P3 no aliasing          no cached K/V shares storage with mixed_qkv or pins extra bytes
P4 outputs not reused   a tensor returned by one call is not modified by later calls, unless the
                        target declares graph outputs (Capabilities(graph_outputs=True))

How the value checks (P0-P2) run:
- every tensor they receive from the target is copied at once (results.py: the copy rule);
- three generations back to back on the same runner, each with another batch layout
  (`Case.generations`), each checked against fresh uncached forwards: state the model keeps
  between generations (a mask or position buffer not refilled, a counter not reset) shows;
- the attention mask has the case's dtype (bool, int64 or int32), carried through to the target;
- fp32 compares each path with the target's own oracle (its uncached forward, its concat path);
  a lower precision compares each path with the same target in fp32 built from the rounded
  weights (its fp32 twin, `Context.fp32`) on the same tokens, teacher-forced, each path within
  its own calibrated bound (compare.py): bf16 against bf16 would add two rounding errors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from mpt_kv.checks.cases import (LATER_NEW_TOKENS, MASK_DTYPES, Case, Context,  # noqa: F401  (their home was here)
                                 fp32_twin, other_padding, rounded_state_dict)
from mpt_kv.checks.compare import PropertyFailure, assert_close, describe
from mpt_kv.checks.results import copied, snapshot
from mpt_kv.model.session import Session
from mpt_kv.checks.storages import covered_bytes, storage_key  # P3
from mpt_kv.checks.quantized import widened  # a declared quantized cache's bound (QuantizedKV)
from mpt_kv.targets.layouts import (BlockGrowth, PagedLayout, QuantizedKV, held_blocks, kv_axes, layout_of,
                                    poison_paged, poison_quantized, shared_block_writes)

POISON = 1e30  # large and finite: a NaN would spread through 0 * v even where masked (measured: 1e30 does not)


@contextlib.contextmanager
def fresh_memory_holds_nan():
    """Make `torch.empty` (and friends) return NaN-filled floats while a check runs.

    Fresh memory may hold anything, NaN bit patterns included (on HPU and CUDA it holds what
    the last user left). A cache slot that is attended before it is written, even masked,
    turns 0 * NaN into NaN in the second matmul. Filling deterministically makes that a
    reproducible failure instead of one that depends on the allocator's history."""
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}

    def nan_filled(original):
        def alloc(*args, **kwargs):
            t = original(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return alloc

    try:
        for name, original in originals.items():
            setattr(torch, name, nan_filled(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


def twin_of(c: Context):
    if c.dtype == torch.float32:
        return None
    if c.fp32 is None:
        raise ValueError(f"{c.dtype} checks compare every path with the same target in float32 from the rounded "
                         "weights: pass Context(..., fp32=cases.fp32_twin(target, cfg, state_dict, device, dtype))")
    return copied(c.fp32)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1, keepdim=True)  # (B, 1)


@contextlib.contextmanager
def context_on_crash(prop: str, c: Context):
    """An exception other than a property failure (the target crashed, or rejected its input)
    keeps its type and traceback, and gains a note saying where: target, device, dtype, path,
    generation, case. (Exception notes need Python 3.11; before, the traceback alone.)"""
    try:
        yield
    except PropertyFailure:
        raise
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"{prop}: raised while running the target [{describe(c.ctx())}]")
        raise


# --- P0 -----------------------------------------------------------------------------------------
def check_oracle(runner, c: Context, old_context: Context | None = None) -> None:
    """Uncached logits equal the reference's (`c.reference`), for each of the case's three batch
    layouts in turn on the same runner. In a lower precision the reference must be the float32
    reference built from the rounded weights (the target's own rounding is then the whole error).
    (`check_oracle(runner, reference, c)`, the signature before the check index, still works.)"""
    if old_context is not None:
        c = dataclasses.replace(old_context, reference=c)
    if c.reference is None:
        raise ValueError(f"P0 compares with the reference: give Context(..., reference=<the reference runner>) "
                         f"[{describe(c.ctx())}]")
    runner, reference = copied(runner), copied(c.reference)
    for g, case in enumerate(c.case.generations(), 1):
        cg = c.for_generation(g, case)
        ids, mask = case.inputs(c.device)
        with torch.inference_mode(), context_on_crash("P0", cg):
            got, want = runner.logits(ids, mask), reference.logits(ids, mask)
        if c.dtype != torch.float32 and want.dtype != torch.float32:
            raise ValueError(f"P0 in {c.dtype}: the reference must run in float32 from the rounded weights "
                             f"(properties.rounded_state_dict), got {want.dtype} logits")
        assert_close(got, want, cg.tol("logits:uncached"), "P0 uncached logits vs reference",
                     cg.ctx(shape=tuple(ids.shape)), where=mask.bool()[:, :, None])


def back_to_back(prop: str, generation, runner, c: Context) -> list[str]:
    """`generation(runner, twin, context)` for each of the case's three generations, on one runner
    (results copied at once: the copy rule), a crash annotated with its generation."""
    runner, twin = copied(runner), twin_of(c)
    for g, case in enumerate(c.case.generations(), 1):
        with context_on_crash(prop, c.for_generation(g, case)):
            generation(runner, twin, c.for_generation(g, case))
    return c.notes


# --- P1 -----------------------------------------------------------------------------------------
def check_cached_equals_uncached(runner, c: Context) -> list[str]:
    """Each generation's prefill and decode logits equal an uncached forward over the same
    tokens; three generations back to back on one runner (`Case.generations`)."""
    return back_to_back("P1", p1_generation, runner, c)


def p1_generation(runner, twin, c: Context) -> None:
    """The cached generation runs first (each step's logits copied); then ONE uncached forward over
    the whole final sequence (prompt + fed tokens). The model is causal: its position S + t sees
    exactly the tokens decode step t saw, so this is the same oracle as one forward per step, at
    the cost of one."""
    ids, mask = c.case.inputs(c.device)
    S = ids.shape[1]
    crash = None
    with torch.inference_mode(), fresh_memory_holds_nan():
        session = runner.session(c.path, c.case.total_len, c.bucket)
        prefill = session.prefill(ids, mask)                                   # (B, S, V)
        tokens, steps, logits = [], [], prefill[:, -1]
        try:
            for _ in range(c.case.new_tokens):
                token = greedy(logits)
                logits = session.decode(token)                                 # (B, V)
                tokens.append(token)
                steps.append(logits)
        except Exception as e:  # noqa: BLE001  judge the steps it did produce first: a wrong value says more
            crash = e
        n = len(steps)
        all_ids = torch.cat([ids, *tokens], dim=1)                             # (B, S + n)
        all_mask = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, n)], dim=1)
        full = runner.logits(all_ids, all_mask)                                # (B, S + n, V)
        oracle = full if twin is None else twin.logits(all_ids, all_mask)
    against = "full forward" if twin is None else "the fp32 twin's full forward"
    tol = widened(c.tol(f"logits:{c.path}"), session)
    assert_close(prefill, oracle[:, :S], tol, f"P1 prefill logits vs {against}", c.ctx(step="prefill"),
                 where=mask.bool()[:, :, None])
    for step in range(n):
        check_token(tokens[step], oracle[:, S - 1 + step], tol, c, step)
        assert_close(steps[step], oracle[:, S + step], tol, f"P1 decode logits vs {against}",
                     c.ctx(step=step, position=S + step))
    if twin is not None:
        assert_close(full, oracle, c.tol("logits:uncached"), f"P1 uncached logits vs {against}",
                     c.ctx(step="uncached", shape=tuple(all_ids.shape)), where=all_mask.bool()[:, :, None])
    if crash is not None:
        raise crash


def check_token(cached: torch.Tensor, oracle: torch.Tensor, tol, c: Context, step, what: str = "P1") -> None:
    """The greedy token the cached path chose (B, 1) against the oracle's logits (B, V) there.
    Logits within a bound b of each other may swap two candidates whose oracle logits are up to
    2b apart: within that a differing token is a near-tie (a note), beyond it a failure. `what`:
    the check the message names (the generate checks judge generate's tokens by the same rule)."""
    bound = tol.bound(oracle)
    for b in (cached != greedy(oracle)).flatten().nonzero().flatten().tolist():
        row = oracle[b].float()
        gap = (row.max() - row[int(cached[b])]).item()
        if gap <= 2 * bound:
            c.notes.append(f"near-tie (not a failure) at step {step}, row {b}: the cached path chose token "
                           f"{int(cached[b])}, the oracle's top token {int(row.argmax())} is {gap:.2e} higher, within "
                           f"2 x the bound ({2 * bound:.2e}), so the greedy choice may legitimately differ "
                           f"[{describe(c.ctx())}]")
        else:
            raise PropertyFailure(f"{what} greedy token differs at step {step}, row {b}: cached {int(cached[b])} vs "
                                  f"oracle {int(row.argmax())}, whose logit is {gap:.3e} higher "
                                  f"(2 x bound {2 * bound:.3e}) [{describe(c.ctx(step=step))}]")


# --- P2 -----------------------------------------------------------------------------------------
def check_static_equals_concat(runner, c: Context) -> list[str]:
    """The static path's logits and cached K/V equal the concat path's, step by step, for three
    generations back to back; never-written static slots are poisoned. In a lower precision both
    paths are compared with the fp32 twin's concat path, fed the same tokens."""
    return back_to_back("P2", p2_generation, runner, c)


def p2_generation(runner, twin, c: Context) -> None:
    ids, mask = c.case.inputs(c.device)
    n = c.case.total_len
    with torch.inference_mode(), fresh_memory_holds_nan():
        concat, static = runner.session("concat", n), runner.session("static", n, c.bucket)
        oracle = None if twin is None else twin.session("concat", n)
        a, b = concat.prefill(ids, mask), static.prefill(ids, mask)
        poison_unwritten(static.live, concat.live)
        o = None if oracle is None else oracle.prefill(ids, mask)
        compare_step(c, "prefill", concat, a, static, b, oracle, o, where=mask.bool()[:, :, None])
        for step in range(c.case.new_tokens):
            token = greedy(a[:, -1] if a.dim() == 3 else a)
            a, b = concat.decode(token), static.decode(token)
            o = None if oracle is None else oracle.decode(token)
            compare_step(c, step, concat, a, static, b, oracle, o, every_position=step == c.case.new_tokens - 1)


def poison_unwritten(static: Session, *others: Session) -> None:
    """Fill slots no token has reached yet: a step that lets them through is caught. A paged cache
    (`cache_layout()`, layouts.py) is poisoned in its pool, through its block table: the slots past
    the written length in each row's blocks and the blocks no table hands out (`others`: sessions
    that may share the pool, whose blocks are left alone). A contiguous cache in its `kv()`
    tensors, which must then be the stored cache, not copies: poison that does not land is an error."""
    layout = layout_of(static)
    if isinstance(layout, PagedLayout):
        poison_paged(layout, static.written, POISON, *(layout_of(o) for o in others))
        return
    if isinstance(layout, QuantizedKV):  # its codes and scales: 1e30 fits no int8 or fp8 code
        poison_quantized(layout, static.written, POISON)
        codes = layout_of(static).codes
        if codes and codes[0][0].shape[2] > static.written and not bool(
                (codes[0][0][:, :, static.written:].float() == poison_code(layout.dtype)).all()):
            raise RuntimeError("P2: the never-written slots poisoned through cache_layout()'s QuantizedKV codes are "
                               "not poisoned in the next cache_layout(): its codes must be the stored cache, not copies")
        return
    kv = static.kv()
    for k, v in kv:
        k[:, :, static.written:] = POISON
        v[:, :, static.written:] = POISON
    unwritten = kv[0][0].shape[2] > static.written if kv else False
    if unwritten and not bool((static.kv()[0][0][:, :, static.written:] == POISON).all()):
        raise RuntimeError("P2: the never-written slots poisoned through kv() are not poisoned in the next kv(): "
                           "kv() returns copies, not the stored cache. A paged cache declares it "
                           "(Session.cache_layout() -> mpt_kv.PagedLayout, docs/targets.md 'Cache layouts')")


def poison_code(dtype: torch.dtype) -> float:
    """The code a never-written slot of a quantized cache holds after `poison_quantized`."""
    return float(torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max)


def compare_step(c: Context, step, concat, concat_logits, static, static_logits, oracle=None, oracle_logits=None,
                 where=None, every_position=False) -> None:
    """fp32: static against concat. Lower precision: each path against the fp32 twin's concat path.
    Cached K/V: after the prefill and after the last step every written position, in between the
    position the step wrote (a write that lands elsewhere shows there or at the end)."""
    t = concat.written
    first = 0 if step == "prefill" or every_position else t - 1
    # (B, 1, t, 1) real tokens only: padding K/V from layer 1 on are built from all-masked
    # query rows, whose output depends on how many slots each path masked
    real = concat.mask[:, first:t].bool()[None, :, None, :, None]
    if oracle is None:
        judged, against, reference_logits = [("static", static, static_logits)], "concat", concat_logits
        reference_kv = kv_axes(concat, c.case.cfg)
    else:
        judged = [("static", static, static_logits), ("concat", concat, concat_logits)]
        against, reference_logits, reference_kv = "the fp32 twin's concat path", oracle_logits, oracle.kv()
    for path, session, logits in judged:
        assert_close(logits, reference_logits, widened(c.tol(f"logits:{path}"), session), f"P2 {path} vs {against} logits",
                     c.ctx(step=step), where=where)
        kv = kv_axes(session, c.case.cfg)
        for i, name in enumerate(("key", "value")):
            # every layer at once: (layer, B, H, positions, hd); the failing index names the layer
            got, want = (torch.stack([pair[i][:, :, first:t] for pair in x]) for x in (kv, reference_kv))
            assert_close(got, want, widened(c.tol(f"kv:{path}"), session),
                         f"P2 {path} vs {against} cached {name}s (layer, batch, head, position - {first}, dim) "
                         f"at written positions [{first}, {t})", c.ctx(step=step), where=real)


# --- P3 -----------------------------------------------------------------------------------------
class WqkvCapture:
    """Holds each layer's latest `Wqkv` output (mixed_qkv) until the next check, so its memory
    cannot be reused by a later allocation and fake an overlap."""

    def __init__(self, modules):
        self.outputs: list[torch.Tensor | None] = [None] * len(modules)
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i):
        def hook(module, args, output):
            self.outputs[i] = output
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        self.outputs = []


@dataclass
class CacheStorage:
    """One storage the cached tensors live in, as seen after one step."""

    storage: torch.UntypedStorage  # held: its identity cannot pass to a new storage while P3 compares steps
    tensors: list[tuple[int, str, torch.Tensor]]  # (layer, "key"/"value", tensor)
    made_at: object       # the step after which it first held cached tensors
    persisted: bool       # it already held cached tensors at the previous step
    covered: int = 0      # bytes of it the cached tensors reach
    declared: int = 0     # bytes beyond them its layout declares (BlockGrowth: one block per tensor)

    @property
    def pinned(self) -> int:
        return self.storage.nbytes() - self.covered

    def names(self) -> str:
        parts = [f"layer {layer} {name} {tuple(t.shape)}" for layer, name, t in self.tensors]
        return " and ".join(parts) if len(parts) <= 4 else ", ".join(parts[:3]) + f" and {len(parts) - 3} more"

    def sizes(self, with_declared: bool = True) -> str:
        declared = (f" (the layout declares up to {self.declared} of block slack)"
                    if self.declared and with_declared else "")
        return (f"its storage holds {self.storage.nbytes()} bytes, the cached tensors in it {self.covered}: "
                f"{self.pinned} bytes pinned beyond the cache{declared}")


def cache_storages(kv, step, previous: dict[int, CacheStorage], layout=None) -> dict[int, CacheStorage]:
    """The storages of every layer's cached key and value (a paged layout: its pools), by identity,
    with the bytes they cover and, for BlockGrowth, the block of slack each tensor may have."""
    now: dict[int, CacheStorage] = {}
    for layer, pair in enumerate(kv):
        for name, t in zip(("key", "value"), pair):
            key = storage_key(t)
            if key not in now:
                before = previous.get(key)
                now[key] = CacheStorage(t.untyped_storage(), [], before.made_at if before else step, before is not None)
            now[key].tensors.append((layer, name, t))
    for st in now.values():
        st.covered = covered_bytes(st.storage.nbytes(), [t for _, _, t in st.tensors])
        if isinstance(layout, BlockGrowth):
            st.declared = sum(layout.slack_bytes(t) for _, _, t in st.tensors)
    return now


def aliasing_problems(kv, captured, previous: dict[int, CacheStorage] | None = None, step="prefill",
                      last: bool = True, layout=None) -> tuple[list[str], dict[int, CacheStorage]]:
    """What the cached keys and values keep alive besides the cache, after `step`.

    - a storage that is a layer's mixed_qkv (the `Wqkv` output captured at this step): bad, always;
    - a storage whose every byte a cached tensor reaches is the cache's own allocation: fine (one
      tensor each, K and V stacked in one buffer, all layers in one buffer);
    - a storage with bytes no cached tensor reaches is fine if it persists from step to step (a
      preallocated cache with room to spare, a pool), bad if it was made at one step and is gone at
      the next (a view of a per-step temporary) or made at the last step (nothing shows it persists),
      unless the layout declares that slack (`BlockGrowth`: up to one block per cached tensor; the
      cache grew on that step);
    - `layout` a `PagedLayout`: `kv` is its pools, and a pool must stay where it is (a graph, and
      every row's block table, point into it).

    Returns (problems, this step's storages): pass the latter back as `previous` for the next step."""
    previous = previous or {}
    now = cache_storages(kv, step, previous, layout)
    qkv = {storage_key(t): (layer, t) for layer, t in enumerate(captured) if t is not None}
    problems = []
    for key, st in now.items():
        if key in qkv:
            layer, t = qkv[key]
            verb = "are views" if len(st.tensors) > 1 else "is a view"
            problems.append(f"{st.names()} {verb} of layer {layer}'s mixed_qkv {tuple(t.shape)}: {st.sizes(False)}")
        elif st.pinned > st.declared and not st.persisted and last:
            problems.append(f"{st.names()} {'live' if len(st.tensors) > 1 else 'lives'} in a buffer made at the last "
                            f"step ({step}) that the cache does not fill: {st.sizes()} (no later step shows it to be "
                            "the cache's own, persisting allocation)")
    for key, st in previous.items():
        if isinstance(layout, PagedLayout) and key not in now:
            problems.append(f"the paged cache's pool of {st.names()} moved after step {st.made_at}: its storage of "
                            f"{st.storage.nbytes()} bytes is no longer the pool (a pool stays where it is: the block "
                            "table and a captured graph point into it)")
        elif st.pinned > st.declared and not st.persisted and key not in now:
            problems.append(f"{st.names()} {'were views' if len(st.tensors) > 1 else 'was a view'} of a per-step "
                            f"temporary, made at step {st.made_at} and gone after the next: {st.sizes()}")
    return problems, now


def check_no_aliasing(runner, c: Context) -> None:
    """P3: after the prefill and every decode step, the cached K/V keep nothing alive besides the
    cache (`aliasing_problems`): no view of mixed_qkv, no view of a per-step temporary. A paged
    cache is judged by its pools (`Session.cache_layout()`), a block-grown one with its slack; in
    one declared copy-on-write no decode step writes into a block rows share."""
    ids, mask = c.case.inputs(c.device)
    capture = WqkvCapture(runner.wqkv_modules())
    try:
        with torch.inference_mode():
            session = runner.session(c.path, c.case.total_len, c.bucket)
            logits = session.prefill(ids, mask)[:, -1]
            steps, storages = ["prefill", *range(c.case.new_tokens)], {}
            shared_before = None
            for step in steps:
                if step != "prefill":
                    logits = session.decode(greedy(logits))
                layout = layout_of(session)
                kv = (layout.storage_tensors() if isinstance(layout, (PagedLayout, QuantizedKV))
                      else kv_axes(session, c.case.cfg))
                problems, storages = aliasing_problems(kv, capture.outputs, storages, step,
                                                       last=step == steps[-1], layout=layout)
                problems += shared_block_writes(shared_before, layout, step)  # copy-on-write: shared blocks unwritten
                shared_before = held_blocks(layout)
                if problems:
                    raise PropertyFailure(f"P3 cache aliasing after step {step}: " + "; ".join(problems)
                                          + f" [{describe(c.ctx(step=step))}]")
    finally:
        capture.close()


# --- P4 -----------------------------------------------------------------------------------------
def check_outputs_not_reused(runner, c: Context) -> list[str]:
    """P4: a tensor the target returned is not modified by its later calls. Calls: two uncached
    forwards of one shape (other tokens), then a prefill and `new_tokens` decode steps of the
    same shape each. A CUDA or HPU graph replay returns the graph's static output, which the next
    replay of that shape overwrites: allowed when the target declares it
    (`Capabilities(graph_outputs=True)`; a note says so), a failure otherwise."""
    ids, mask = c.case.inputs(c.device)
    other = (ids + 1) % c.case.cfg.vocab_size
    declared = getattr(getattr(runner, "capabilities", None), "graph_outputs", False)
    returned: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (call, the tensor as returned, its copy)

    def call(what, fn, *args):
        out = fn(*args)
        if declared and c.notes and c.notes[-1].startswith("P4:"):
            return out  # reuse seen and declared: nothing more to learn
        for earlier, kept, copy in list(returned):
            changed = ~((kept == copy) | (kept.isnan() & copy.isnan()))
            if not changed.any():
                continue
            if declared:  # as declared: the suite copies every result (results.py)
                by = getattr(runner, "graph_outputs_declared_by", None) or \
                    "the target (its Capabilities(graph_outputs=True))"
                c.notes.append(f"P4: the {earlier} output was overwritten by the {what}, as declared by {by}; "
                               f"expected, not a failure [{describe(c.ctx())}]")
                returned.clear()
                break
            size = (kept.float() - copy.float()).abs().nan_to_num(float("inf")).max().item()
            raise PropertyFailure(
                f"P4 output reuse: the logits {tuple(kept.shape)} returned by the {earlier} were modified by the "
                f"later {what}: {int(changed.sum())} of {kept.numel()} elements changed, max change {size:.3e}. "
                "The target reuses its output buffers (as a CUDA or HPU graph replay does) without declaring "
                "it: declare Capabilities(graph_outputs=True), or return fresh tensors "
                f"[{describe(c.ctx(step=what))}]")
        returned.append((what, out, snapshot(out)))
        return out

    with torch.inference_mode(), fresh_memory_holds_nan(), context_on_crash("P4", c):
        call("uncached forward", runner.logits, ids, mask)
        call("uncached forward of other tokens (same shape)", runner.logits, other, mask)
        session = runner.session(c.path, c.case.total_len, c.bucket)
        logits = call("prefill", session.prefill, ids, mask)[:, -1]
        for step in range(c.case.new_tokens):
            logits = call(f"decode step {step}", session.decode, greedy(logits))
    return c.notes
