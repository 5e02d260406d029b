"""Memory ceilings: what one generation may hold, measured on every target, path and device.

    m = measure(runner, case, path, device)          # one generation under the device's meter
    m.problems                                       # the analytic properties it broke, if any
    check_memory(runner, context)                    # the same, raising PropertyFailure (kill matrix)

Bytes are counted above the level before the generation (weights and inputs already exist),
with `mpt_kv.memory.meter` (cpu: exact live storages; cuda/hpu: allocator statistics). Notation as in
`mpt_kv.memory.analytic`: B batch, L cache length, n layers, H heads, hd head dim, s itemsize;
KV(L) = 2 * n * B * H * L * hd * s (`analytic.kv_cache_bytes`).

Two kinds of limit, combined like this:

1. Analytic properties (`measure` -> `problems`), for any case, with no stored number. The
   kill matrix runs only these (its cases and variant names have no stored ceilings).
   - retained: after prefill and after every decode step, the bytes still allocated equal
     KV(L) plus the session's bookkeeping, L the length the path keeps (concat: the tokens so
     far; static: the preallocated length). Bookkeeping is what the session protocol says a
     session holds besides K/V: its attention mask (`Session.mask`) and 0-/1-element tensors
     (counters such as transformers' `cumulative_length`), found by walking the session's
     attributes. Exact on cpu (to the byte); within the allocator's rounding elsewhere
     (`ROUNDING`). A cache that keeps K/V as views of `mixed_qkv` pins the q third: exactly
     n * B * S * D * s too many after prefill, reported per layer with the storage's size. A
     cache pool's storages (kept from the warm-up generation and reused) are part of KV(L):
     allocated before the generation, they are counted as the cache, not as missing bytes.
   - static decode: a step's peak above what was allocated before it is at most
     `decode_bound`: one layer's transients at q = 1 (`analytic.layer_transients`, times
     `TRANSIENT_SLACK`), the step's logits and its masks, plus the allowance of the way its
     attention reads the cache (`step_allowance`: one layer dequantized, or upcast to fp32 below
     float32; the message names the one applied). Per layer, never per cache, so it holds at any
     sequence length; a step that copies (or dequantizes, or upcasts) the whole cache does not fit.
   - concat decode: the same plus KV(L + 1): the new cache may coexist with the old one
     (`torch.cat` while the old tensors are referenced: per layer in the reference, the whole
     cache in optimum-habana's tuple cache, the transformers issue "forward pass consumes 2x memory"), but
     nothing beyond one old and one new cache.
   - no leak: allocation does not grow from one generation to the next: after the measured
     generation's session is deleted, and after `LEAK_GENERATIONS - 1` more, allocation is back
     at the level before it (net growth over repeated generations, as PyTorch's CUDA leak checks
     judge a test). A cache pool allocated once passes; a pool that grows every generation fails.
   - cache with its session: the cache's storages die with its session, unless the target
     declares a pool (`Capabilities(cache_pool=True)`, optimum-habana's reuse_cache).
   - nothing kept on the model: after every generation ended and its session is gone, the
     model and runner hold their weights and a declared pool and nothing else, measured from the
     level before the warm-up generation (exact on cpu; after it for a target that declares graph
     outputs, whose output buffers are made there on purpose); what they keep (attention
     probabilities, a logits history, a kept session) is named by attribute path, with its bytes
     (`model_state_problem`). A tensor the model made in the warm-up and still holds, the same
     storage with the same bytes after generations of other tokens, is a constant built lazily on
     the first forward (llm-foundry's ALiBi bias): model state, not per-generation state.

2. Stored ceilings, for the config table `CONFIGS` only: the measured `METRICS` of each config,
   kept per device kind in a project's file and compared after the analytic properties held
   (`mpt_kv.checks.stored_ceilings`: the file, its keys, --update-ceilings).

The byte accounting both use (what a cache may hold, a step's bound, where an excess is) is
`mpt_kv.checks.accounting`.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import asdict, dataclass, field

import torch

from mpt_kv.checks.accounting import (ROUNDING, WeakQkvCapture, checked_meter, decode_bound, decode_bound_text,
                                      growth_block, itemsize, quantized_layout, retained, shape_of, step_allowance,
                                      weights_bytes)
from mpt_kv.checks.cases import Case, Context
from mpt_kv.checks.model_state import made_once, model_state_problem
from mpt_kv.checks.storages import storage_key
# the stored ceilings a memory check compares with (public here: docs/targets.md)
from mpt_kv.checks.stored_ceilings import METRICS, StoredCeilings, compare_stored  # noqa: F401
from mpt_kv.errors import PropertyFailure, describe
from mpt_kv.memory import analytic
from mpt_kv.model.config import ModelConfig
from mpt_kv.targets.layouts import storage_tensors
from mpt_kv.versions import target_version


# Tiny MPT: hd = 32 makes one layer's K+V (2*B*H*L*hd*s) larger than its score chain
# (B*H*L*(s+8)), so a decode step that copies a layer's cache stands out from the transients.
# 4 layers: a step's bound is per layer, so only the layer count separates one layer's transient
# from a whole-cache copy. In bf16 one layer's upcast allowance (fp32 K and V: 8 N) is the whole
# cache of 2 layers (2 x 2 x 2 N): at 2 layers a bf16-only target could keep a second cache during
# every step and pass (measured 0.90 of the bound, as the legitimate upcast); at 4 it is 1.73
# (docs/memory-model.md, "Transient allowances").
SHAPE = ModelConfig(d_model=128, n_heads=4, n_layers=4, vocab_size=256, max_seq_len=96)


@dataclass(frozen=True)
class MemoryConfig:
    """One row of the seed PR's table: batch size, max input tokens, max new tokens; `padded`: the
    rows' prompts of unequal lengths (left-padded to max_input), else every row a full prompt."""

    batch: int
    max_input: int
    max_new: int
    cfg: ModelConfig = SHAPE
    padded: bool = False

    @property
    def id(self) -> str:
        return f"B{self.batch}-in{self.max_input}-new{self.max_new}" + ("-padded" if self.padded else "")

    def case(self) -> Case:
        # the seed's "max input tokens" is the padded length: memory is that of the padded batch;
        # padded rows (max_input, then shorter ones down to one token) reach the mask's other values
        if self.padded:
            lens = tuple(max(1, self.max_input - (i * self.max_input) // self.batch) for i in range(self.batch))
        else:
            lens = (self.max_input,) * self.batch
        return Case(self.cfg, lens, self.max_new, seed=0)


# The seed's rows, scaled down to run in seconds on a CPU: a large batch with short sequences
# (seed: 128, 128, 128), a generation longer than its prompt (16, 128, 1024) and a long prompt
# (2, 1024, 1024).
CONFIGS = (
    MemoryConfig(16, 8, 8),
    MemoryConfig(2, 8, 24),
    MemoryConfig(4, 32, 8),
    # a batch of 8 unequally padded rows with prompts past 128 (a path or bucket chosen by length)
    MemoryConfig(8, 130, 4, dataclasses.replace(SHAPE, max_seq_len=136), padded=True),
)


@dataclass
class Measurement:
    """One generation's memory, in bytes above the level before it."""

    target: str
    target_version: str
    device: str  # kind: cpu | cuda | hpu
    dtype: str  # "float32" | "bfloat16"
    path: str
    bucket: int | None
    batch: int
    max_input: int
    max_new: int
    cfg: dict  # ModelConfig fields
    weights: int  # parameters and buffers of the model (reported, not measured)
    prefill_retained: int  # allocated after prefill, its logits dropped
    prefill_excess: int  # of it, bytes beyond the analytic cache and bookkeeping (the seed bug's q third shows here)
    decode_transient: int  # max over steps of (peak during the step - allocated before it)
    allocated: int  # after the last step, cache alive ("Memory allocated")
    max_allocated: int  # peak over the whole generation ("Max memory allocated")
    returned: int  # after the session is deleted (0: nothing leaked)
    kv_bytes: int  # live storages of session.kv() after the last step
    kv_analytic: int  # KV(L) after the last step
    problems: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in METRICS}


def decode_tokens(case: Case, device) -> torch.Tensor:
    """(new, B, 1) token ids fed at each step. Memory does not depend on which tokens, so they
    are drawn up front (outside the measurement) instead of argmax'ed from the logits."""
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randint(0, case.cfg.vocab_size, (case.new_tokens, case.batch, 1), generator=g).to(device)


def measure(runner, case: Case, path: str, device, dtype: torch.dtype, bucket: int | None = None,
            target: str | None = None) -> Measurement:
    """Run one generation (prefill, `case.new_tokens` decode steps, delete the session) under the
    device's meter and check the analytic properties (module doc) at every point; then run it
    again, `LEAK_GENERATIONS` in all, to see whether allocation grows from one to the next."""
    device = torch.device(device)
    target = target or runner.name
    cfg, B, s = case.cfg, case.batch, itemsize(dtype)
    ctx = dict(target=target, device=device.type, dtype=str(dtype).replace("torch.", ""), path=path,
               bucket=bucket, case=case.describe())
    meter = checked_meter(device)
    ids, mask = case.inputs(device)
    tokens = decode_tokens(case, device)
    # the generations after the measured one run other tokens (the same lengths and padding): state a
    # generation writes into the model then differs from what the warm-up left there, a constant built
    # once does not (`made_once`)
    other_ids, other_tokens = (ids + 1) % cfg.vocab_size, (tokens + 1) % cfg.vocab_size
    preexisting = {storage_key(t) for t in [ids, mask, tokens, other_ids, other_tokens,
                                            *runner.model.parameters(), *runner.model.buffers()]}
    slack_per_storage = ROUNDING.get(device.type, 4096)
    pool_declared = getattr(getattr(runner, "capabilities", None), "cache_pool", False)
    problems: dict[str, str] = {}  # property -> first failure
    excess_at: dict[str, int] = {}  # phase -> bytes retained beyond the analytic cache and bookkeeping

    def expected_len(written: int) -> int:
        return written if path == "concat" else case.total_len

    def check_retained(session, phase: str, allocated: int) -> int:
        r = retained(session, allocated, expected_len(session.written), cfg, B, s, preexisting, kept, qkv)
        excess_at[phase] = r.excess
        slack = slack_per_storage * (len(r.acc.kv_storages) + len(r.acc.bookkeeping) + 2)
        tolerance = "exact" if meter.exact else f"allowed {slack}: allocator rounding"
        if abs(r.excess) > slack and "retained" not in problems:
            problems["retained"] = (
                f"memory: after {phase}, {allocated} bytes allocated, {r.excess} bytes "
                f"{'too many' if r.excess > 0 else 'too few'} ({tolerance}): expected {r.expected}. "
                f"{r.explain()} [{describe(ctx)}]")
        return r.kv_bytes

    qkv = WeakQkvCapture(runner)  # names a retained storage that is a mixed_qkv, holding none
    gc.freeze()  # pre-existing objects out of the meter's gc.collect(): 400 ms -> microseconds
    try:
        with torch.inference_mode(), meter:
            meter.release_library_caches()  # a library's own workspace is no state of the target's (cuda: cuBLAS)
            start = meter.allocated()  # before the warm-up: the model holds its weights only
            warm = warm_up(runner, path, case, bucket, ids, mask, tokens)
            once = made_once(runner, preexisting)  # lazily built state: a constant if it outlives the rest unchanged
            meter.reset_peak()
            base = meter.allocated()
            kept = {key: ref for key, ref in warm.items() if ref() is not None}  # outlived the warm-up's session
            session = runner.session(path, case.total_len, bucket)
            session.prefill(ids, mask)  # logits dropped at once
            prefill_retained = meter.allocated() - base
            max_allocated = meter.peak() - base
            kv_bytes = check_retained(session, "prefill", prefill_retained)
            allocated, transient = prefill_retained, 0
            for step in range(case.new_tokens):
                L = expected_len(session.written)
                meter.reset_peak()
                session.decode(tokens[step])
                peak, before = meter.peak() - base, allocated
                step_transient = peak - before
                allocated = meter.allocated() - base
                transient, max_allocated = max(transient, step_transient), max(max_allocated, peak)
                kv_bytes = check_retained(session, f"decode step {step}", allocated)
                block, layout = growth_block(session), quantized_layout(session)
                allowance, allowed = step_allowance(session, cfg, B, L + (path == "concat"), s)
                bound = decode_bound(cfg, B, L + (path == "concat"), s, path, block, layout) + allowance
                if step_transient > bound and "decode" not in problems:
                    problems["decode"] = (
                        f"memory: {path} decode step {step} peaked {step_transient} bytes above the "
                        f"{before} allocated before it, {step_transient - bound} bytes too many: the bound "
                        f"is {bound} ({decode_bound_text(cfg, B, L + (path == 'concat'), s, path, block, layout)}"
                        f"{f' + {allowed}' if allowance else ''}) "
                        f"[{describe(ctx)}]")
            del session
            returned = meter.allocated() - base
            last = kept
            for _ in range(LEAK_GENERATIONS - 1):
                last = generate(runner, path, case, bucket, other_ids, mask, other_tokens)
            growth = meter.allocated() - base
            # declared graph outputs (one buffer per output shape, made in the warm-up) are kept on
            # purpose, like a pool: such a target is judged from the level after the warm-up
            graph_outputs = getattr(getattr(runner, "capabilities", None), "graph_outputs", False)
            meter.release_library_caches()  # as before `start`: what cuBLAS allocated in the warm-up is not held
            held = meter.allocated() - (base if graph_outputs else start)
    finally:
        gc.unfreeze()
        qkv.close()
    model_state = model_state_problem(runner, held, {**kept, **last} if pool_declared else {}, preexisting,
                                      slack_per_storage, ctx, once)
    if model_state:
        problems["model-state"] = model_state
    slack = slack_per_storage * 4 * LEAK_GENERATIONS
    if max(abs(returned), abs(growth)) > slack:
        problems["leak"] = (
            f"memory: after the session was deleted, {returned} bytes are still allocated above the level before "
            f"the generation, {growth} after {LEAK_GENERATIONS} generations ({growth // LEAK_GENERATIONS} per "
            f"generation): they leak across steps and calls [{describe(ctx)}]")
    elif kept and not pool_declared:
        problems["pool"] = (
            f"memory: the cache outlives its session: {sum(ref().nbytes() for ref in kept.values() if ref())} bytes "
            f"of K/V storages of a generation were alive after its session was deleted. A target that keeps its "
            f"cache for the next generation on purpose declares it (Capabilities(cache_pool=True)); otherwise the "
            f"cache must go with its session [{describe(ctx)}]")
    L = expected_len(case.total_len)
    return Measurement(
        target=target, target_version=target_version(target), device=device.type, dtype=ctx["dtype"],
        path=path, bucket=bucket, batch=B, max_input=case.prompt_len, max_new=case.new_tokens,
        cfg=asdict(cfg), weights=weights_bytes(runner.model), prefill_retained=prefill_retained,
        prefill_excess=excess_at["prefill"],
        decode_transient=transient, allocated=allocated, max_allocated=max_allocated, returned=returned,
        kv_bytes=kv_bytes, kv_analytic=analytic.kv_cache_bytes(shape_of(cfg), B, L, s),
        problems=list(problems.values()))


# Generations measured for leaks, after the warm-up: allocation must not grow from one to the next
# (as PyTorch's CUDA leak checks judge a test: by net growth, not by a level). Exact on cpu, so
# two show a leak of one byte; on an allocator a leak grows by the same amount every generation.
LEAK_GENERATIONS = 2


def generate(runner, path, case, bucket, ids, mask, tokens, steps: int | None = None) -> dict:
    """One generation, its session deleted at the end: {storage key: weakref} of its cache's
    storages, to see which of them outlive it (a cache pool)."""
    session = runner.session(path, case.total_len, bucket)
    session.prefill(ids, mask)
    for step in range(case.new_tokens if steps is None else steps):
        session.decode(tokens[step])
    storages = {storage_key(t): weakref.ref(t.untyped_storage()) for pair in storage_tensors(session) for t in pair}
    del session
    return storages


def warm_up(runner, path, case, bucket, ids, mask, tokens) -> dict:
    """A prefill and one decode step before measuring: lazily built state (kernel workspaces,
    cached constants, a cache pool) is made once here, not counted as a leak of the measured call.
    Returns the weak references of `generate`."""
    return generate(runner, path, case, bucket, ids, mask, tokens, steps=min(1, case.new_tokens))


def check_memory(runner, c: Context) -> list[str]:
    """The memory check of one case and path: the analytic properties (module doc), then, where
    `c.ceilings` is given (the pytest plugin gives the project's), its stored ceiling. The
    measurement is recorded first (`c.record`), so the report and --update-ceilings see failing
    cases too. Notes: where a stored ceiling could be tighter."""
    path = c.path or "concat"
    m = measure(runner, c.case, path, c.device, c.dtype, c.bucket, target=c.target)
    c.record("mpt_kv_memory", {**asdict(m), "problems": len(m.problems), "torch": str(torch.__version__)})
    if m.problems:
        raise PropertyFailure("\n".join(m.problems))
    return compare_stored(m, c.ceilings, path, c.record)
