"""The memory checks' byte accounting: what a session's cache may hold and what a step may allocate,
written once for the memory property (`mpt_kv.checks.ceilings`), the ops memory checks
(`mpt_kv.checks.operations`), the green-run rule's cache evidence (`mpt_kv.checks.running`) and the
family memory check (`mpt_kv.checks.family`).

Notation as in `mpt_kv.memory.analytic`: B batch, L cache length, n layers, H heads, hd head dim,
s itemsize; KV(L) = 2 * n * B * H * L * hd * s (`analytic.kv_cache_bytes`).

    expected_kv_bytes   KV(L), or a declared quantized cache's codes and scales
    decode_bound        what one decode step may allocate above the level before it (per layer,
                        never per cache), plus `step_allowance` for the way its attention reads
    retained            what a session holds at one point against what it may hold: the cache as
                        its layout stores it (paged blocks, block-growth slack, a quantized cache,
                        a pool kept from an earlier generation) and the session's bookkeeping
    explain_excess      where the bytes beyond that are: per layer, per session attribute, or elsewhere

(what the model and runner keep after every generation ended: `mpt_kv.checks.model_state`)

Bytes are read with `mpt_kv.memory.meter` (cpu: exact live storages; cuda/hpu: allocator statistics).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.memory import analytic
from mpt_kv.memory.meter import Meter, meter_for
from mpt_kv.model.config import ModelConfig
from mpt_kv.targets import Runner
from mpt_kv.targets.layouts import BlockGrowth, PagedLayout, QuantizedKV, layout_of, storage_tensors


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


def session_tensors(session) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the session references through attributes, lists, tuples and dicts, with its
    path ('session.cache.kv[0][1]'); models and runners are not entered (they hold the weights).
    The same walk as the model-state check's (`tensors_in`)."""
    return list(tensors_in(session, "session", 8))


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


def tensors_in(x, where, depth, seen=None):
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
        yield from tensors_in(v, w, depth - 1, seen)


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
