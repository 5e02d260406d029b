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
     (`model_state_problem`).

2. Stored ceilings (`Baseline`), for the config table `CONFIGS` only: per device kind a JSON
   file (`<project>/mpt_kv_ceilings/ceilings-<kind>.json`) maps a key (target and its implementing package's
   version, path, dtype, batch, max input, max new, model shape) to the measured `METRICS`.
   A run fails where a measurement exceeds its ceiling (cpu: by one byte; allocator devices:
   by more than `CEILING_SLACK`) or where the entry is missing; a lower measurement passes
   and says the ceiling can be tightened. `pytest --update-ceilings` rewrites the entries
   that ran and prints the diff; writing a higher value (loosening) also needs
   `--allow-looser-ceilings`. A missing or corrupt file is an error, never a pass.
   The versions are in the key because a different transformers is a different
   implementation (4.55 keeps views, 5.x does not); torch's version is only recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from mpt_kv.memory import analytic
from mpt_kv.versions import target_version  # noqa: F401  (public here before mpt_kv.versions)
from mpt_kv.errors import BaselineError, PropertyFailure, describe
from mpt_kv.model.config import ModelConfig
from mpt_kv.memory.meter import Meter, meter_for
from mpt_kv.checks.cases import Case, Context
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.targets.layouts import BlockGrowth, PagedLayout, QuantizedKV, layout_of, storage_tensors
from mpt_kv.targets import Runner

# --- the config table --------------------------------------------------------------------------------

# Tiny MPT: hd = 32 makes one layer's K+V (2*B*H*L*hd*s) larger than its score chain
# (B*H*L*(s+8)), so a decode step that copies a layer's cache stands out from the transients.
SHAPE = ModelConfig(d_model=128, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=96)


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

# --- limits ---------------------------------------------------------------------------------------------

# Allocator rounding per live storage (bytes): cuda rounds every block up to 512 bytes; the
# HPU allocator's granularity is not documented publicly, 4 KiB is an assumption (unchecked here).
ROUNDING = {"cpu": 0, "cuda": 512, "hpu": 4096}
# Eager code keeps more temporaries alive than the idealised count of `analytic.layer_transients`
# (e.g. `scores / sqrt(hd)`, `+ alibi` and `masked_fill` each make a score-sized copy).
# Measured on CONFIGS (cpu, fp32 and bf16), the largest decode step as a fraction of the bound:
# static 0.44 reference, 0.69 transformers 5.24, 0.64 optimum-habana; concat 0.48 reference,
# 0.39 transformers, 0.94 optimum-habana (its tuple cache holds the whole old and new caches).
TRANSIENT_SLACK = 2


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shape_of(cfg: ModelConfig) -> analytic.Shape:
    return analytic.Shape(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len)


def growth_block(session) -> int | None:
    """The block size of a session whose cache declares BlockGrowth, else None. No reference to the
    layout outlives the call: a paged layout's tensors (its lengths) would read as a leak."""
    layout = layout_of(session)
    return layout.block_size if isinstance(layout, BlockGrowth) else None


def new_cache_length(length: int, block: int | None) -> int:
    """The positions a concat step's new cache holds: `length`, or for a cache declared to grow by
    blocks (BlockGrowth) its capacity, `length` rounded up to whole blocks (vLLM's 16, say)."""
    return -(-length // block) * block if block else length


def expected_kv_bytes(layout, cfg: ModelConfig, batch: int, length: int, s: int) -> int:
    """The cache's analytic bytes: KV(L), or for a declared quantized cache its codes and scales
    (`QuantizedKV.cache_bytes`): a cache that also keeps a full-precision copy is that much too many."""
    if isinstance(layout, QuantizedKV):
        return layout.cache_bytes(cfg.n_layers, batch, cfg.n_heads, length, cfg.head_dim)
    return analytic.kv_cache_bytes(shape_of(cfg), batch, length, s)


def step_allowance(session, cfg: ModelConfig, batch: int, length: int, s: int, q_len: int = 1) -> tuple[int, str]:
    """What a cached call may hold beyond `decode_bound` for the way its attention reads the cache:
    (bytes, the allowance in words; (0, "") for none). Per layer, never per cache: measured on the
    implementations named in docs/memory-model.md ("Transient allowances") with the cpu meter.
    N = B x H x length x hd, one layer's key (or value).

    - a declared quantized cache (QuantizedKV): one layer's K dequantized, to the model's dtype or to
      fp32 (the wider), while its V is dequantized out of place, `(codes.float() * scale).to(dtype)`:
      V's codes as fp32 and their fp32 product: (max(s, 4) + 8) x N. Covers an in-place dequantize
      (2 x s x N), an eager out-of-place one (transformers' Fp8QuantizedLayer, s + 8) and one that
      dequantizes to fp32 and attends there (12);
    - a model below float32 (bf16): one layer's q, K and V upcast to fp32 for attention (a common
      CPU choice for scaled_dot_product_attention): 4 x (B x H x q x hd + 2 x N).
    The larger applies (a quantized cache's covers the upcast of its own dequantized values). A whole
    cache dequantized or upcast, or one kept from step to step, is n_layers times that: it fails."""
    n = batch * cfg.n_heads * length * cfg.head_dim
    if isinstance(layout_of(session), QuantizedKV):
        allowance = (max(s, 4) + 8) * n
        return allowance, (f"one layer's K dequantized and V dequantized out of place (its codes as fp32 and their "
                           f"fp32 product) {allowance} (the allowance of a declared QuantizedKV)")
    if s < 4:
        allowance = 4 * (batch * cfg.n_heads * q_len * cfg.head_dim + 2 * n)
        return allowance, (f"one layer's q, K and V upcast to float32 for attention {allowance} (the allowance of a "
                           "model below float32)")
    return 0, ""


def decode_bound(cfg: ModelConfig, batch: int, length: int, s: int, path: str, block: int | None = None,
                 layout=None) -> int:
    """Most a decode step may allocate above what was allocated before it (see module doc); `block`:
    the block size of a BlockGrowth layout, whose new buffer is that capacity, not the tokens held;
    `layout`: a declared QuantizedKV, whose new concat cache is its codes and scales."""
    shape = shape_of(cfg)
    transients = TRANSIENT_SLACK * analytic.layer_transients(shape, batch, 1, length, s, softmax_itemsize=4)
    logits = analytic.logits_bytes(shape, batch, 1, trim=True, itemsize=s) * 2  # + an fp32 copy
    masks = batch * length * (2 * 8 + 4 + 1) + length  # old + new int64 mask, a float and a bool mask
    cache = new_cache_bytes(cfg, batch, length, s, block, layout) if path == "concat" else 0
    return transients + logits + masks + cache


def new_cache_bytes(cfg: ModelConfig, batch: int, length: int, s: int, block: int | None, layout) -> int:
    """The new cache a concat step may build next to the old one: KV of `length` positions (whole
    blocks of a BlockGrowth), or a declared quantized cache's codes and scales (not full precision: a
    step that keeps the old cache dequantized, or a full-precision one, does not fit)."""
    n = new_cache_length(length, block)
    return expected_kv_bytes(layout if isinstance(layout, QuantizedKV) else None, cfg, batch, n, s)


# --- measuring one generation ----------------------------------------------------------------------


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


# What the baseline stores and bounds per config.
METRICS = ("prefill_retained", "decode_transient", "allocated", "max_allocated")


def session_tensors(session) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the session references through attributes, lists, tuples and dicts, with its
    path ('session.cache.kv[0][1]'); models and runners are not entered (they hold the weights).
    The same walk as the model-state check's (`_tensors_in`)."""
    return list(_tensors_in(session, "session", 8))


def span_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Accounting:
    """What holds the bytes allocated at one point of a generation."""

    kv_storages: dict[int, tuple[int, list[tuple[int, str, torch.Tensor]]]]  # key -> (bytes, [(layer, name, t)])
    bookkeeping: dict[int, tuple[str, int]]  # key -> (where, bytes): the mask, counters, a paged block table
    others: dict[int, tuple[str, torch.Tensor]]  # tensors the session keeps that are neither
    layout: object = None  # the session's cache_layout(): None, BlockGrowth or PagedLayout

    @property
    def kv_total(self) -> int:
        return sum(b for b, _ in self.kv_storages.values())

    @property
    def bookkeeping_total(self) -> int:
        return sum(b for _, b in self.bookkeeping.values())


def account(session, preexisting: set[int]) -> Accounting:
    """Sort the storages a session holds into K/V, bookkeeping and others. Storages that
    existed before the generation (inputs, weights) are not part of its allocation. A paged
    cache's K/V storages are its pools, its block table and lengths are bookkeeping."""
    layout = layout_of(session)
    kv: dict = {}
    # a quantized cache is its codes and its scales (layouts.QuantizedKV.stored), not kv()'s copies
    stored = layout.stored() if isinstance(layout, QuantizedKV) else [
        (layer, name, t) for layer, pair in enumerate(storage_tensors(session)) for name, t in zip(("key", "value"), pair)]
    for layer, name, t in stored:
        key = storage_key(t)
        if key not in preexisting:
            kv.setdefault(key, (t.untyped_storage().nbytes(), []))[1].append((layer, name, t))
    books = {storage_key(session.mask)} if isinstance(session.mask, torch.Tensor) else set()
    if isinstance(layout, PagedLayout):
        books |= {storage_key(t) for t in (layout.block_table, layout.lengths) if torch.is_tensor(t)}
    bookkeeping, others = {}, {}
    for where, t in session_tensors(session):
        key = storage_key(t)
        if key in kv or key in preexisting or key in bookkeeping or key in others:
            continue
        if key in books or t.numel() <= 1:
            bookkeeping[key] = (where, t.untyped_storage().nbytes())
        else:
            others[key] = (where, t)
    return Accounting(kv, bookkeeping, others, layout)


class WeakQkvCapture:
    """Remembers each layer's `Wqkv` outputs (mixed_qkv) by a weak reference to their storage, so
    that a retained storage can be named as a mixed_qkv without holding one alive (which would
    change what is measured). A runner without '*Wqkv' modules remembers nothing."""

    def __init__(self, runner):
        import weakref

        self.seen: dict[int, tuple] = {}  # storage key -> (weakref to the storage, layer, shape)
        try:
            modules = runner.wqkv_modules()
        except Exception:  # noqa: BLE001  only explanations depend on it
            modules = []

        def hook_for(layer):
            def hook(module, args, output):
                if isinstance(output, torch.Tensor):
                    self.seen[storage_key(output)] = (weakref.ref(output.untyped_storage()), layer, tuple(output.shape))
            return hook

        self.handles = [m.register_forward_hook(hook_for(i)) for i, m in enumerate(modules)]

    def of(self, storage: torch.UntypedStorage) -> tuple[int, tuple] | None:
        """(layer, shape) if `storage` is a mixed_qkv the model made, else None."""
        entry = self.seen.get(storage._cdata)
        return (entry[1], entry[2]) if entry is not None and entry[0]() is storage else None

    def close(self):
        for h in self.handles:
            h.remove()
        self.seen.clear()


def block_slack(acc: Accounting, qkv: WeakQkvCapture | None) -> int:
    """BlockGrowth: the bytes of K/V storages beyond the cached tensors that the layout declares
    (up to one block per cached tensor); none for a storage that is a mixed_qkv."""
    if not isinstance(acc.layout, BlockGrowth):
        return 0
    out = 0
    for nbytes, tensors in acc.kv_storages.values():
        if qkv is not None and qkv.of(tensors[0][2].untyped_storage()) is not None:
            continue
        extra = nbytes - covered_bytes(nbytes, [t for _, _, t in tensors])
        out += min(extra, sum(acc.layout.slack_bytes(t) for _, _, t in tensors))
    return out


@dataclass
class PagedCount:
    """A paged cache's blocks at one point: what memory counts as the cache."""

    handed: int    # bytes of the handed-out blocks, every layer's key and value pool
    accepted: int  # of them, within one block of slack per row beyond the `length` positions
    pooled: int    # bytes of the handed-out blocks in pools allocated before this generation
    rows: list[tuple[int, int, int]]  # (row, blocks handed out, blocks allowed)
    length: int
    new_pools: list[tuple[int, str, torch.Tensor]]  # (layer, name, pool): pools this generation allocated


def paged_count(layout: PagedLayout, length: int, kept: dict) -> PagedCount:
    """Handed-out blocks per row, at most `length // block_size + 1` of them accepted (the last
    block partly filled, or one empty block ahead: one block of slack per row). A block rows share
    (`PagedLayout(copy_on_write=True)`) is counted once: its bytes exist once."""
    bs, per_block = layout.block_size, layout.block_bytes()
    allowed = length // bs + 1
    rows = [(b, len(blocks), allowed) for b, blocks in enumerate(layout.rows())]
    handed = len(layout.distinct_blocks())  # a block rows share (copy_on_write) is one block of memory
    pooled, new_pools = 0, []
    for layer, pair in enumerate(layout.pools):
        for name, pool in zip(("key", "value"), pair):
            st = pool.untyped_storage()
            if st._cdata in kept and kept[st._cdata]() is st:
                pooled += handed * pool[0].numel() * pool.element_size()
            else:
                new_pools.append((layer, name, pool))
    accepted = len(set().union(*(row[:allowed] for row in layout.rows())))  # each row's first blocks, once each
    return PagedCount(handed * per_block, accepted * per_block, pooled, rows, length, new_pools)


def explain_excess(acc: Accounting, excess: int, expected_kv: int, cfg: ModelConfig, batch: int,
                   qkv: WeakQkvCapture | None = None, paged: PagedCount | None = None) -> str:
    """Where the bytes beyond KV + bookkeeping are: per layer, per session attribute, or elsewhere."""
    parts = []
    kv_extra = acc.kv_total - expected_kv
    if paged is not None:
        kv_extra = explain_paged(acc, paged, parts)
    elif kv_extra:
        declared = acc.layout.block_size if isinstance(acc.layout, BlockGrowth) else None
        for nbytes, tensors in acc.kv_storages.values():
            own = covered_bytes(nbytes, [t for _, _, t in tensors])
            if nbytes > own:
                names = " and ".join(f"layer {layer} {name} {tuple(t.shape)}" for layer, name, t in tensors)
                made = qkv.of(tensors[0][2].untyped_storage()) if qkv is not None else None
                own_qkv = made is not None and made[0] == tensors[0][0] and made[1][-1:] == (3 * cfg.d_model,)
                if own_qkv:
                    what = (f"the size of mixed_qkv {made[1]}: it is that layer's Wqkv output, views of it pin "
                            "its q third")
                elif made is not None:
                    what = f"it is layer {made[0]}'s Wqkv output {made[1]}"
                else:
                    what = f"a buffer {nbytes - own} bytes larger than the cached tensors"
                    if declared:
                        allowed = sum(acc.layout.slack_bytes(t) for _, _, t in tensors)
                        what += (f"; BlockGrowth(block_size={declared}) declares up to {allowed}, "
                                 f"{max(0, nbytes - own - allowed)} beyond it")
                verb = "live" if len(tensors) > 1 else "lives"
                parts.append(f"{names} {verb} in a storage of {nbytes} bytes, {nbytes - own} more than "
                             f"{'they hold' if len(tensors) > 1 else 'it holds'} ({what})")
        if not parts:
            parts.append(f"the cache storages hold {acc.kv_total} bytes, the KV cache is {expected_kv} "
                         f"({kv_extra:+d}: a cache of another length or layout)")
    for where, t in acc.others.values():
        parts.append(f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} keeps "
                     f"{t.untyped_storage().nbytes()} bytes")
    rest = excess - kv_extra - sum(t.untyped_storage().nbytes() for _, t in acc.others.values())
    if rest:
        parts.append(f"{rest:+d} bytes held by nothing the session references (the model, a hook, a global?)")
    return "; ".join(parts)


def explain_paged(acc: Accounting, paged: PagedCount, parts: list[str]) -> int:
    """A paged cache's excess, named per row and per layer's pool: blocks beyond one block of slack
    per row, and blocks of a pool this generation allocated that no row holds. Returns its bytes."""
    layout, bs = acc.layout, acc.layout.block_size
    extra = 0
    for b, n, allowed in paged.rows:
        if n > allowed:
            per_layer = ", ".join(f"layer {i} {2 * (n - allowed) * k[0].numel() * k.element_size()} bytes"
                                  for i, (k, _) in enumerate(layout.pools))
            parts.append(f"row {b} holds {n} blocks of block_size {bs} for {paged.length} positions: {n - allowed} "
                         f"beyond the one block of slack a row may have ({per_layer} in its key and value pools)")
            extra += (n - allowed) * layout.block_bytes()
    handed = len(layout.distinct_blocks())
    for layer, name, pool in paged.new_pools:
        free, block = pool.shape[0] - handed, pool[0].numel() * pool.element_size()
        if free > 0:
            parts.append(f"layer {layer} {name} pool {tuple(pool.shape)}: {free} of its {pool.shape[0]} blocks are "
                         f"handed out to no row ({free * block} bytes), in a pool this generation allocated")
            extra += free * block
    return extra


_checked_meters: set[str] = set()


def checked_meter(device: torch.device) -> Meter:
    """The device's meter, self-checked once per process: a meter reading 0 must not pass."""
    meter = meter_for(device)
    if str(device) not in _checked_meters:
        import gc

        # pre-existing objects out of the self-check's three gc.collect()s (the process's first memory
        # case: 3.9 s -> see docs/cost.md); it allocates and frees one tensor, in no reference cycle
        frozen = gc.get_freeze_count() == 0 and (gc.freeze() or True)
        try:
            meter.self_check(device)
        finally:
            if frozen:
                gc.unfreeze()
        _checked_meters.add(str(device))
    return meter


def weights_bytes(model: nn.Module) -> int:
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


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
    import gc

    device = torch.device(device)
    target = target or runner.name
    cfg, B, s = case.cfg, case.batch, itemsize(dtype)
    ctx = dict(target=target, device=device.type, dtype=str(dtype).replace("torch.", ""), path=path,
               bucket=bucket, case=case.describe())
    meter = checked_meter(device)
    ids, mask = case.inputs(device)
    tokens = decode_tokens(case, device)
    preexisting = {storage_key(t) for t in [ids, mask, tokens, *runner.model.parameters(), *runner.model.buffers()]}
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
                last = generate(runner, path, case, bucket, ids, mask, tokens)
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
                                      slack_per_storage, ctx)
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


@dataclass
class Retained:
    """What a session holds at one point against what it may hold (`retained`)."""

    excess: int     # bytes allocated beyond the expected cache and bookkeeping (negative: too few)
    expected: str   # the expected bytes, in words
    kv_bytes: int   # the cache's storages (a paged cache: its handed-out blocks)
    acc: Accounting
    explain: Callable[[], str]  # where the excess is (per layer, per session attribute, or elsewhere)


def retained(session, allocated: int, L: int, cfg: ModelConfig, B: int, s: int, preexisting: set[int], kept: dict,
             qkv: WeakQkvCapture | None) -> Retained:
    """`allocated` bytes (above the level before the session) against the analytic cache of L
    positions as the session's layout stores it (a paged cache's handed-out blocks, a block-grown
    one's declared slack, a quantized one's codes and scales; the storages in `kept`, allocated
    before, are a pool counted as the cache) and the session's bookkeeping: the memory checks'
    rule after prefill and every decode step, and ops-retained's after a reorder or a crop."""
    acc = account(session, preexisting)
    kv = expected_kv_bytes(acc.layout, cfg, B, L, s)
    paged = paged_count(acc.layout, L, kept) if isinstance(acc.layout, PagedLayout) else None
    if paged is not None:  # the cache is its handed-out blocks, at most one block of slack per row
        cache, pooled = paged.accepted, paged.pooled
    else:
        cache, pooled = kv + block_slack(acc, qkv), pool_bytes(session, kept)  # pooled: allocated before
    excess = allocated - (cache - pooled) - acc.bookkeeping_total
    pool = f" - {pooled} bytes of it kept from an earlier generation (a cache pool)" if pooled else ""
    if paged is not None:
        expected = (f"the paged cache's handed-out blocks, {paged.handed} bytes, counted up to {paged.accepted} "
                    f"({L} positions per row and at most one block of block_size {acc.layout.block_size} beyond "
                    f"them; KV({L}) is {kv})")
        pool = (f", less the {pooled} bytes of them in a pool kept from an earlier generation (a cache pool)"
                if pooled else "")
    else:
        expected = (f"the KV cache {kv} bytes (2 x {cfg.n_layers} layers x B {B} x H {cfg.n_heads} x L {L} x hd "
                    f"{cfg.head_dim} x {s} bytes)")
        if isinstance(acc.layout, BlockGrowth):
            expected += f" + {cache - kv} bytes of declared block slack"
        if isinstance(acc.layout, QuantizedKV):
            expected = (f"the quantized KV cache {kv} bytes (2 x {cfg.n_layers} layers x B {B} x H {cfg.n_heads} x "
                        f"L {L} x hd {cfg.head_dim} codes of {acc.layout.dtype.itemsize} byte and the "
                        f"scales={acc.layout.scales} scales of {acc.layout.scale_dtype.itemsize}, as declared: "
                        f"{acc.layout.describe()})")
    expected += (f"{pool} + {acc.bookkeeping_total} bytes of bookkeeping (the session's mask and counters"
                 f"{', the block table' if paged is not None else ''})")
    return Retained(excess, expected, paged.handed if paged is not None else acc.kv_total, acc,
                    lambda: explain_excess(acc, excess, kv, cfg, B, qkv, paged))


def model_state_tensors(runner, preexisting: set[int]) -> list[tuple[str, torch.Tensor]]:
    """Tensors the runner and its model reference that are neither its weights nor tensors that
    existed before the generations (`preexisting`): module attributes, registered buffers made
    since, runner attributes, with their paths ('model.transformer.blocks.0.attn.probs')."""
    out, seen = [], set()
    parameters = {storage_key(p) for p in runner.model.parameters()}

    def add(where, t):
        key = storage_key(t)
        if key not in seen and key not in preexisting and key not in parameters:
            seen.add(key)
            out.append((where, t))

    for name, module in runner.model.named_modules():
        prefix = f"model.{name}." if name else "model."
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_modules"):
                continue
            items = value.items() if attr == "_buffers" else [(attr, value)]
            for key, v in items:
                for where, t in _tensors_in(v, prefix + str(key), 6):
                    add(where, t)
    for attr, value in vars(runner).items():
        if attr != "model":
            for where, t in _tensors_in(value, f"runner.{attr}", 6):
                add(where, t)
    return out


def _tensors_in(x, where, depth, seen=None):
    """Tensors reachable from x through dicts, lists, tuples and plain objects' attributes (a kept
    session, a history list), not through modules (walked on their own) or runners."""
    seen = set() if seen is None else seen
    if isinstance(x, torch.Tensor):
        yield where, x
        return
    if not depth or id(x) in seen or isinstance(x, (nn.Module, Runner, type, str, bytes, int, float, bool)):
        return
    seen.add(id(x))
    if isinstance(x, dict):
        items = [(f"{where}[{k!r}]", v) for k, v in x.items()]
    elif isinstance(x, (list, tuple)):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(x)]
    elif hasattr(x, "__dict__") and not callable(x):
        items = [(f"{where}.{k}", v) for k, v in vars(x).items()]
    else:
        return
    for w, v in items:
        yield from _tensors_in(v, w, depth - 1, seen)


def model_state_problem(runner, held: int, pool: dict, preexisting: set[int], slack_per_storage: int,
                        ctx: dict) -> str | None:
    """After every generation ended and its session is gone, the model holds its weights and its
    declared cache pool (`pool`: the storages of the last generations, kept by a target that
    declares Capabilities(cache_pool=True)) and nothing else: `held` bytes above the level before
    the warm-up, less the pool, must be 0 (exact on cpu). Otherwise: what is held, by name."""
    alive = {key: ref() for key, ref in pool.items() if ref() is not None}
    pooled = sum(st.nbytes() for st in alive.values())
    # one-sided: less is fine (a pool made before this measurement, as when a runner serves several
    # generations, is not counted in `held`; memory freed is not state kept)
    excess = held - pooled
    if excess <= slack_per_storage * 4:
        return None
    found = [(where, t) for where, t in model_state_tensors(runner, preexisting) if storage_key(t) not in alive]
    named = "; ".join(f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} keeps "
                      f"{t.untyped_storage().nbytes()} bytes" for where, t in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    rest = excess - sum(t.untyped_storage().nbytes() for _, t in found)
    return (f"memory: after the generations ended and their sessions were deleted, the model and runner hold {held} "
            f"bytes above the level before the warm-up generation{f' ({pooled} of them the declared cache pool)' if pooled else ''}"
            f": {excess} bytes of per-generation state kept on the model or runner. "
            f"{named + more if named else 'No tensor attribute of the model or runner holds them'}"
            f"{f'; {rest:+d} bytes held by nothing found there (a hook, a global?)' if found and rest else ''} "
            f"[{describe(ctx)}]")


# Generations measured for leaks, after the warm-up: allocation must not grow from one to the next
# (as PyTorch's CUDA leak checks judge a test: by net growth, not by a level). Exact on cpu, so
# two show a leak of one byte; on an allocator a leak grows by the same amount every generation.
LEAK_GENERATIONS = 2


def generate(runner, path, case, bucket, ids, mask, tokens, steps: int | None = None) -> dict:
    """One generation, its session deleted at the end: {storage key: weakref} of its cache's
    storages, to see which of them outlive it (a cache pool)."""
    import weakref

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


def pool_bytes(session, kept: dict) -> int:
    """Bytes of the session's cache storages that were allocated before its generation (kept from
    an earlier one: a cache pool)."""
    storages = {storage_key(t): t.untyped_storage() for pair in storage_tensors(session) for t in pair}
    return sum(st.nbytes() for key, st in storages.items() if key in kept and kept[key]() is st)


def decode_bound_text(cfg, batch, length, s, path, block: int | None = None, layout=None) -> str:
    shape = shape_of(cfg)
    lt = analytic.layer_transients(shape, batch, 1, length, s, softmax_itemsize=4)
    text = (f"{TRANSIENT_SLACK} x one layer's transients {lt} at q=1, kv={length} + logits and masks")
    if path == "concat":
        n = new_cache_length(length, block)
        grown = f", {length} positions in whole blocks of {block} (BlockGrowth)" if block else ""
        quantized = isinstance(layout, QuantizedKV)
        text += (f" + the new {'quantized ' if quantized else ''}cache {'' if quantized else f'KV({n}) '}"
                 f"{new_cache_bytes(cfg, batch, length, s, block, layout)} next to the old one{grown}")
    return text


def quantized_layout(session) -> QuantizedKV | None:
    """The session's declared QuantizedKV without its tensors (what it declares, for the bounds), else
    None: a reference to the codes kept across the next step would be measured as part of the cache."""
    layout = layout_of(session)
    return dataclasses.replace(layout, codes=(), scale_tensors=()) if isinstance(layout, QuantizedKV) else None


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


# --- stored ceilings ---------------------------------------------------------------------------------

SCHEMA = 1
ENV_DIR = "MPT_KV_CEILINGS_DIR"
# A project's own folder, relative to the current directory; the pytest plugin resolves it against
# the project's rootdir (or its ini option mpt_kv_ceilings_dir). This repo's: <repo>/mpt_kv_ceilings.
DEFAULT_DIR = Path("mpt_kv_ceilings")
# How far above its ceiling a measurement may read: cpu is exact; an allocator's peak can move
# by a block when the order of frees changes (1% and a few 512-byte blocks).
CEILING_SLACK = {"cpu": (0.0, 0), "cuda": (0.01, 4 * 512), "hpu": (0.01, 4 * 4096)}
METRIC_TEXT = {
    "prefill_retained": "bytes allocated after prefill",
    "decode_transient": "largest decode-step peak above the bytes allocated before the step",
    "allocated": "bytes allocated after generation (Memory allocated)",
    "max_allocated": "peak over the generation (Max memory allocated)",
}




@dataclass(frozen=True)
class StoredCeilings:
    """Where a project keeps its memory ceilings, and which targets must have them.

    directory  holds ceilings-<device kind>.json
    required   target names whose missing entries fail ("*": every target). Any target that already
               has an entry in the file must have all of its entries, listed here or not
    update     --update-ceilings: measure only; the plugin writes the file at the end of the run
    """

    directory: Path
    required: tuple[str, ...] = ()
    update: bool = False

    def file(self, kind: str) -> Path:
        return baseline_path(kind, self.directory)

    def requires(self, target: str) -> bool:
        return "*" in self.required or target in self.required


def compare_stored(m: Measurement, store: StoredCeilings | None, path: str, record=lambda name, value: None) -> list[str]:
    """Compare a measurement with its stored ceiling (notes: where it could be tighter).

    Fail-closed where a ceiling is expected: a corrupt file always, and a missing entry (or
    file) for a target that `store` requires or that already has entries in the file
    (BaselineError: an error, not a property failure). A target never recorded and not
    required rests on the analytic checks; the report says how to record it."""
    if store is None or store.update:
        return []
    file = store.file(m.device)
    entries = load_baseline(file, m.device) if file.exists() or store.requires(m.target) else {}
    key = key_of(m)
    recorded = any(k.split("|", 1)[0].split(" (", 1)[0] == m.target for k in entries)
    if key not in entries and not (recorded or store.requires(m.target)):
        record("mpt_kv_unrecorded", {"target": m.target, "device": m.device, "file": str(file)})
        return []
    failures, notes = compare(m, entries, file)
    if key not in entries:
        raise BaselineError(failures[0])
    if failures:
        raise PropertyFailure("\n".join(failures) + f" [{m.target}, {m.device}, {m.dtype}, {path}]")
    return notes


def baseline_path(kind: str, directory: str | Path | None = None) -> Path:
    """`<dir>/ceilings-<kind>.json`; dir: the argument, else $MPT_KV_CEILINGS_DIR, else ./mpt_kv_ceilings."""
    directory = directory or os.environ.get(ENV_DIR) or DEFAULT_DIR
    return Path(directory) / f"ceilings-{kind}.json"


def key_of(m: Measurement | dict) -> str:
    """'target (versions)|path|dtype|B-in-new|shape': one ceiling entry."""
    m = m if isinstance(m, dict) else asdict(m)
    c = m["cfg"]
    target = m["target"] + (f" ({m['target_version']})" if m["target_version"] else "")
    path = m["path"] + ("" if m["bucket"] is None else f"+bucket{m['bucket']}")
    shape = f"d{c['d_model']}-h{c['n_heads']}-l{c['n_layers']}-v{c['vocab_size']}-s{c['max_seq_len']}"
    return f"{target}|{path}|{m['dtype']}|B{m['batch']}-in{m['max_input']}-new{m['max_new']}|{shape}"


def load_baseline(path: Path, kind: str) -> dict[str, dict]:
    """The entries of a baseline file; BaselineError saying what is wrong and how to fix it."""
    if not path.exists():
        raise BaselineError(f"memory ceilings baseline {path} does not exist: record it with "
                            f"`pytest --pyargs mpt_kv.conformance -k memory --update-ceilings` and commit it")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaselineError(f"memory ceilings baseline {path} is corrupt ({type(e).__name__}: {e}); restore it "
                            "from version control, or delete it and re-record with --update-ceilings") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("device") != kind \
            or not isinstance(data.get("entries"), dict):
        raise BaselineError(f"memory ceilings baseline {path} is malformed: expected an object with schema={SCHEMA}, "
                            f"device={kind!r} and 'entries'; restore it or re-record with --update-ceilings")
    for key, entry in data["entries"].items():
        bad = [k for k in METRICS if not isinstance(entry, dict) or type(entry.get(k)) is not int or entry[k] < 0]
        if bad:
            raise BaselineError(f"memory ceilings baseline {path}: entry {key!r} lacks non-negative integer "
                                f"{bad}; restore it or re-record with --update-ceilings")
    return data["entries"]


def exceeded(kind: str, measured: int, ceiling: int) -> bool:
    rel, blocks = CEILING_SLACK.get(kind, (0.01, 4 * 4096))
    return measured > ceiling + rel * ceiling + blocks


def compare(m: Measurement | dict, entries: dict[str, dict], path: Path) -> tuple[list[str], list[str]]:
    """(failures, notes): measurements above their ceiling or without one; ceilings that could be tighter."""
    m = m if isinstance(m, dict) else asdict(m)
    key = key_of(m)
    if key not in entries:
        same = sorted(k for k in entries if k.split("|", 1)[1] == key.split("|", 1)[1])
        hint = f" (stored for this config: {', '.join(k.split('|')[0] for k in same)})" if same else ""
        return [f"memory ceilings: no entry {key!r} in {path}{hint}: record it with --update-ceilings "
                "and review the diff"], []
    failures, notes = [], []
    for metric in METRICS:
        got, ceiling = m[metric], entries[key][metric]
        if exceeded(m["device"], got, ceiling):
            failures.append(f"memory ceiling exceeded: {metric} ({METRIC_TEXT[metric]}) measured {got} bytes, "
                            f"{got - ceiling} bytes above its ceiling {ceiling} ({key} in {path}); if intended, "
                            "accept it with --update-ceilings --allow-looser-ceilings")
        elif got < ceiling:
            notes.append(f"{key}: {metric} {got} is {ceiling - got} bytes below its ceiling {ceiling} "
                         "(tighten with --update-ceilings)")
    return failures, notes


@dataclass
class Change:
    key: str
    metric: str
    old: int | None
    new: int

    @property
    def kind(self) -> str:
        return "new" if self.old is None else "looser" if self.new > self.old else "tighter"

    def __str__(self) -> str:
        if self.old is None:
            return f"{self.metric} {self.new}"
        return f"{self.metric} {self.old} -> {self.new} ({self.new - self.old:+d}, {self.kind})"


def diff_lines(changes: list[Change]) -> list[str]:
    """One line per entry: '+' new, '-' tighter, '!' looser (any metric)."""
    by_key: dict[str, list[Change]] = {}
    for c in changes:
        by_key.setdefault(c.key, []).append(c)
    lines = []
    for key, cs in by_key.items():
        mark = "+" if cs[0].kind == "new" else "!" if any(c.kind == "looser" for c in cs) else "-"
        lines.append(f"  {mark} {key}  " + ", ".join(map(str, cs)))
    return lines


def update_baseline(path: Path, kind: str, measured: list[dict], allow_looser: bool) -> tuple[list[Change], list[Change]]:
    """Merge measurements into the baseline file: (written changes, refused loosenings).

    Entries that did not run are kept. A key measured more than once keeps its largest value.
    Without `allow_looser`, an entry whose new value exceeds its stored one keeps its old values
    (all metrics of it), and its changes are returned as refused. A corrupt file is not
    overwritten (BaselineError); a missing one is created."""
    entries = load_baseline(path, kind) if path.exists() else {}
    new: dict[str, dict] = {}
    for m in measured:
        k, vals = key_of(m), {metric: m[metric] for metric in METRICS}
        new[k] = {metric: max(v, new.get(k, {}).get(metric, 0)) for metric, v in vals.items()}
        new[k]["torch"] = str(m.get("torch", torch.__version__))
    written, refused = [], []
    merged = dict(entries)
    for k, vals in sorted(new.items()):
        old = entries.get(k)
        changes = [Change(k, metric, None if old is None else old[metric], vals[metric]) for metric in METRICS
                   if old is None or old[metric] != vals[metric]]
        if any(c.kind == "looser" for c in changes) and not allow_looser:
            refused += changes
            continue
        written += changes
        merged[k] = vals
    if written or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"schema": SCHEMA, "device": kind,
                "about": "memory ceilings (bytes above the level before a generation) per config; "
                         "see mpt_kv/checks/ceilings.py and docs/memory-model.md. Rewrite with pytest --update-ceilings.",
                "entries": dict(sorted(merged.items()))}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)  # atomic: a crash never leaves half a file
    return written, refused


# --- the report ------------------------------------------------------------------------------------

def kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def table(records: list[dict]) -> list[str]:
    """The seed PR's memory columns, per target, path and config (KiB, weights included as in the seed)."""
    head = (f"{'target':<22} {'device':<6} {'dtype':<8} {'path':<14} {'batch':>5} {'max input':>9} {'max new':>7} | "
            f"{'Memory allocated':>16} {'Max memory allocated':>20} | {'KV cache':>8} {'analytic min':>12} | "
            f"{'prefill excess':>14} | outcome")
    lines = [head]
    for r in sorted(records, key=lambda r: (r["target"], r["device"], r["dtype"], r["path"], r["bucket"] or 0,
                                            r["batch"], r["max_input"], r["max_new"])):
        target = r["target"] + (f" {r['target_version'].split(', ')[0].split(' ')[-1]}" if r["target_version"] else "")
        path = r["path"] + ("" if r["bucket"] is None else f"+b{r['bucket']}")
        w = r["weights"]
        lines.append(f"{target:<22} {r['device']:<6} {r['dtype']:<8} {path:<14} {r['batch']:>5} {r['max_input']:>9} "
                     f"{r['max_new']:>7} | {kib(w + r['allocated']):>16} {kib(w + r['max_allocated']):>20} | "
                     f"{kib(r['kv_bytes']):>8} {kib(w + r['kv_analytic']):>12} | "
                     f"{excess_text(r.get('prefill_excess')):>14} | {r.get('outcome', '?')}")
    lines.append("  KiB. Memory allocated: weights + what the generation still holds after its last step; Max memory "
                 "allocated: weights + its peak; KV cache: the live storages of the cache at the end; analytic min: "
                 "weights + 2 x layers x B x H x (input + new) x hd x itemsize, the least Memory allocated can be; "
                 "prefill excess: what the prefill retained beyond its analytic cache and bookkeeping (a cache that "
                 "pins mixed_qkv shows it here even when the first decode step copies it away and Memory allocated "
                 "reads the same as the fixed model's).")
    return lines


def excess_text(n: int | None) -> str:
    """+KiB beyond the analytic cache after prefill ('0.0' for none; '-' for a report without it)."""
    return "-" if n is None else ("+" if n > 0 else "") + kib(n)
