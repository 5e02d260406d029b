"""Cache layouts beyond contiguous tensors: how a session describes where its cache lives.

By default (`Session.cache_layout()` returns None) a session's `kv()` returns, per layer, the
(key, value) tensors (B, H, T, hd) as the target stores them, and the checks read their storage.
Other layouts are declared by returning one of these from `Session.cache_layout()`
(docs/targets.md, "Cache layouts"):

PagedLayout   a block pool and a block table, as vLLM (and the Gaudi vLLM plugin) serve MPT: per
              layer a key pool and a value pool (num_blocks, H, block_size, hd), a block table
              (B, max_blocks) of pool block ids (-1: no block), and each row's length. `kv()` then
              returns gathered copies (for the value checks); P2 poisons, P3, static-shape and
              memory read the pools and the table.
BlockGrowth   a contiguous cache that grows by `block_size` positions at a time (one allocation
              per block): `kv()` returns views of the cache's own block buffers, which may hold up
              to one block of positions beyond the cached ones.
QuantizedKV   a contiguous cache stored as int8 or fp8 codes with per-tensor, per-head or per-token
              scales (vLLM's kv_cache_dtype="fp8", INC's FP8 KVCache): `kv()` returns the
              DEQUANTIZED values (copies, in the model's dtype: what attention reads); the value
              checks judge them within a bound calibrated for the storage dtype; P2 poisons, P3,
              static-shape and memory read the stored codes and scales.

Slack beyond what a layout declares is a failure, like any other retained byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral
from typing import Sequence

import torch

from mpt_kv.errors import AdapterError, InputError, PropertyFailure


@dataclass(frozen=True)
class BlockGrowth:
    """A contiguous cache whose per-layer key and value buffers grow by `block_size` positions at a
    time, all rows together: each cached (B, H, T, hd) tensor may live in a buffer with room for
    up to `block_size` more positions (one block of slack per layer's key and value)."""

    block_size: int

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"BlockGrowth(block_size={self.block_size!r}): expected an int >= 1")

    def slack_bytes(self, t: torch.Tensor) -> int:
        """Bytes one block adds to a cached (B, H, T, hd) tensor: block_size positions of it."""
        B, H, _, hd = t.shape
        return B * H * self.block_size * hd * t.element_size()


@dataclass(frozen=True)
class PagedLayout:
    """A paged cache: per layer (key pool, value pool), each (num_blocks, H, block_size, hd); a
    block table (B, max_blocks) whose entry [b, j] is the pool block holding row b's positions
    [j * block_size, (j + 1) * block_size), -1 where the row has no block; `lengths` (B,), the
    positions each row holds (mpt-kv's rows are left-padded: every row's is `Session.written`).
    A row's handed-out blocks are its table entries >= 0; a pool block in no row's table is not
    handed out. One block table serves every layer (vLLM's).

    `copy_on_write`: rows may share pool blocks, as vLLM forks a sequence for beam search: after
    a reorder with repeats the beams point at the same blocks until one of them writes. A shared
    block sits at the same table index in every row that holds it (it holds the same positions
    of each), and the cache copies it before a row writes into it (the last row that holds it
    may write in place). Without the declaration a block in two table entries is a failure."""

    pools: Sequence[tuple[torch.Tensor, torch.Tensor]]
    block_table: torch.Tensor
    block_size: int
    lengths: torch.Tensor | Sequence[int]
    copy_on_write: bool = False

    def lengths_list(self) -> list[int]:
        """Each row's length, an int >= 0: int() of 2.5 would be 2, a wrong length read as a right one."""
        values = self.lengths.tolist() if torch.is_tensor(self.lengths) else list(self.lengths)
        bad = [n for n in values if isinstance(n, bool) or not isinstance(n, Integral) or n < 0]
        if bad:
            raise InputError(f"PagedLayout.lengths {values}: {bad} are not positions; expected ints >= 0 "
                             "(an integer tensor or a list of ints)")
        return [int(n) for n in values]

    def rows(self) -> list[list[int]]:
        """Each row's handed-out pool blocks, in table order."""
        return [[int(b) for b in row if b >= 0] for row in self.block_table.tolist()]

    def distinct_blocks(self) -> set[int]:
        """The pool blocks handed out to any row (a block rows share, once)."""
        return {b for row in self.rows() for b in row}

    def shared(self) -> dict[int, list[tuple[int, int]]]:
        """Pool block -> the (row, table index) entries holding it, for blocks in two or more entries."""
        entries: dict[int, list[tuple[int, int]]] = {}
        for b, row in enumerate(self.block_table.tolist()):
            for j, block in enumerate(row):
                if block >= 0:
                    entries.setdefault(int(block), []).append((b, j))
        return {block: e for block, e in entries.items() if len(e) > 1}

    def block_bytes(self) -> int:
        """Bytes one block takes in all layers' key and value pools together."""
        return sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in self.pools)

    def storage_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(pair) for pair in self.pools]


QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
QUANT_SCALES = {"tensor": "one scale per cached tensor (per layer, key and value)",
                "head": "one scale per row and head: (B, H, 1, 1)",
                "token": "one scale per row, head and position: (B, H, T, 1)"}


@dataclass(frozen=True)
class QuantizedKV:
    """A contiguous cache whose K and V are stored as `dtype` codes (B, H, T, hd) and `scale_dtype`
    scales (`scales`: QUANT_SCALES), value = code x scale. `codes` and `scale_tensors`: per layer
    the (key, value) codes and the (key, value) scales, as stored (the cache's own tensors, not
    copies: P2 poisons them, memory counts them). `kv()` returns the dequantized values."""

    dtype: torch.dtype
    scales: str
    scale_dtype: torch.dtype = torch.float32
    codes: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    scale_tensors: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()

    def __post_init__(self):
        if self.dtype not in QUANT_DTYPES:
            raise ValueError(f"QuantizedKV(dtype={self.dtype!r}): expected one of {QUANT_DTYPES} (the storage dtype "
                             "of the codes; a bf16 or fp32 cache declares no layout)")
        if self.scales not in QUANT_SCALES:
            raise ValueError(f"QuantizedKV(scales={self.scales!r}): expected one of {sorted(QUANT_SCALES)}")
        if not isinstance(self.scale_dtype, torch.dtype) or not self.scale_dtype.is_floating_point \
                or self.scale_dtype.itemsize < 2:
            raise ValueError(f"QuantizedKV(scale_dtype={self.scale_dtype!r}): expected a floating torch.dtype of "
                             "2 bytes or more (float32, bfloat16, float16)")
        for name in ("codes", "scale_tensors"):  # before len(): codes=5 is the adapter's error, named as such
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or any(not isinstance(pair, (list, tuple)) or len(pair) != 2
                                                           for pair in value):
                shown = (f"a {type(value).__name__} of {', '.join(type(x).__name__ for x in list(value)[:3])}"
                         if isinstance(value, (list, tuple)) else repr(value))
                raise TypeError(f"QuantizedKV({name}={shown}): expected a list of per-layer (key, value) pairs of "
                                f"tensors, the cache's own {'codes' if name == 'codes' else 'scales'} (B, H, T, "
                                f"{'hd' if name == 'codes' else '1'}), e.g. [(k_{name[:5]}, v_{name[:5]}) per layer]")
        if len(self.codes) != len(self.scale_tensors):
            raise ValueError(f"QuantizedKV: {len(self.codes)} layers of codes, {len(self.scale_tensors)} of scales")
        for layer, (codes, scales) in enumerate(zip(self.codes, self.scale_tensors)):
            for name, c, sc in zip(("key", "value"), codes, scales):
                where = f"QuantizedKV layer {layer} {name}"
                if not torch.is_tensor(c) or c.dim() != 4 or c.dtype != self.dtype:
                    raise ValueError(f"{where} codes {getattr(c, 'dtype', type(c).__name__)} "
                                     f"{tuple(getattr(c, 'shape', ()))}: expected (B, H, T, hd) of {self.dtype}")
                B, H, T, _ = c.shape
                want = {"tensor": (1,), "head": (B, H, 1, 1), "token": (B, H, T, 1)}[self.scales]
                if not torch.is_tensor(sc) or sc.dtype != self.scale_dtype or sc.numel() != math.prod(want) or \
                        (self.scales != "tensor" and tuple(sc.shape) != want):
                    raise ValueError(f"{where} scales {getattr(sc, 'dtype', type(sc).__name__)} "
                                     f"{tuple(getattr(sc, 'shape', ()))}: scales={self.scales!r} expects {want} of "
                                     f"{self.scale_dtype} ({QUANT_SCALES[self.scales]})")

    def storage_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [tuple(pair) for pair in self.codes]

    def stored(self) -> list[tuple[int, str, torch.Tensor]]:
        """(layer, what, tensor) for every tensor the cache is stored in: codes and scales."""
        return [(layer, f"{name}{what}", t) for layer, (codes, scales) in enumerate(zip(self.codes, self.scale_tensors))
                for what, pair in (("", codes), (" scales", scales)) for name, t in zip(("key", "value"), pair)]

    def cache_bytes(self, n_layers: int, batch: int, heads: int, length: int, head_dim: int) -> int:
        """The analytic size of this cache holding `length` positions: per layer, key and value,
        B x H x L x hd codes of the storage dtype and the scales of the declared granularity."""
        n_scales = {"tensor": 1, "head": batch * heads, "token": batch * heads * length}[self.scales]
        per_tensor = batch * heads * length * head_dim * self.dtype.itemsize + n_scales * self.scale_dtype.itemsize
        return 2 * n_layers * per_tensor

    def describe(self) -> str:
        return f"{str(self.dtype)[6:]} codes, scales={self.scales} ({str(self.scale_dtype)[6:]})"


def poison_quantized(layout: QuantizedKV, written: int, value: float) -> None:
    """Fill the never-written slots (positions >= `written`) of a quantized cache with the largest
    value its storage can hold: codes at the dtype's max (int8 127, e4m3 448) and, where each
    position has its own scale ("token"), that scale at `value` (or the scale dtype's max): an
    attended slot then reads code x scale ~ 1e32, as the full-precision caches' 1e30. A shared scale
    ("head", "tensor") also scales written slots, so there the poison is the largest code."""
    top = torch.iinfo(layout.dtype).max if not layout.dtype.is_floating_point else torch.finfo(layout.dtype).max
    scale = min(value, torch.finfo(layout.scale_dtype).max)
    for codes, scales in zip(layout.codes, layout.scale_tensors):
        for c, sc in zip(codes, scales):
            c[:, :, written:] = top
            if layout.scales == "token":
                sc[:, :, written:] = scale


def layout_of(session) -> PagedLayout | BlockGrowth | QuantizedKV | None:
    """The session's declared layout (None: contiguous), checked against the session's own state:
    a malformed description is a ValueError (the adapter is wrong), a table that contradicts the
    cache (a block in two places, lengths other than what was written, a row whose blocks cannot
    hold its positions) a PropertyFailure."""
    method = getattr(session, "cache_layout", None)
    layout = method() if callable(method) else None
    if layout is None or isinstance(layout, (BlockGrowth, QuantizedKV)):
        return layout
    if not isinstance(layout, PagedLayout):
        raise ValueError(f"cache_layout() returned {type(layout).__name__}: expected None, "
                         "mpt_kv.PagedLayout, mpt_kv.BlockGrowth or mpt_kv.QuantizedKV")
    check_paged(layout, session)
    return layout


def check_paged(layout: PagedLayout, session) -> None:
    bs, table = layout.block_size, layout.block_table
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
        raise ValueError(f"PagedLayout.block_size={bs!r}: expected an int >= 1")
    if not layout.pools:
        raise ValueError("PagedLayout.pools is empty: expected one (key pool, value pool) per layer")
    first = layout.pools[0][0]
    for layer, pair in enumerate(layout.pools):
        if len(pair) != 2:
            raise ValueError(f"PagedLayout.pools[{layer}]: expected a (key pool, value pool) pair")
        for name, pool in zip(("key", "value"), pair):
            if not torch.is_tensor(pool) or pool.dim() != 4 or pool.shape[2] != bs:
                raise ValueError(f"PagedLayout layer {layer} {name} pool of shape "
                                 f"{tuple(getattr(pool, 'shape', ()))}: expected (num_blocks, H, block_size={bs}, hd)")
            if pool.shape[0] != first.shape[0]:
                raise ValueError(f"PagedLayout layer {layer} {name} pool has {pool.shape[0]} blocks, layer 0's key "
                                 f"pool {first.shape[0]}: one block table indexes every pool")
    if not torch.is_tensor(table) or table.dim() != 2 or table.dtype.is_floating_point or table.dtype == torch.bool:
        raise ValueError(f"PagedLayout.block_table {type(table).__name__} {tuple(getattr(table, 'shape', ()))}: "
                         "expected an integer (B, max_blocks) tensor")
    B, num_blocks = table.shape[0], first.shape[0]
    lengths = layout.lengths_list()
    if len(lengths) != B:
        raise ValueError(f"PagedLayout.lengths has {len(lengths)} rows, the block table {B}")
    if table.numel() and (int(table.min()) < -1 or int(table.max()) >= num_blocks):
        raise ValueError(f"PagedLayout.block_table holds ids outside -1..{num_blocks - 1} "
                         f"(min {int(table.min())}, max {int(table.max())}; the pool has {num_blocks} blocks)")
    if not isinstance(layout.copy_on_write, bool):
        raise ValueError(f"PagedLayout.copy_on_write={layout.copy_on_write!r}: expected True or False")
    owner: dict[int, tuple[int, int]] = {}
    for b, row in enumerate(table.tolist()):
        for j, block in enumerate(row):
            if block < 0:
                continue
            if block in owner:
                ob, oj = owner[block]
                if layout.copy_on_write and oj == j and ob != b:
                    continue  # rows sharing a block of the same positions: legitimate while nobody writes it
                hint = ("" if layout.copy_on_write or oj != j else
                        "; rows forked from one sequence may share blocks that nobody writes: declare "
                        "PagedLayout(copy_on_write=True)")
                raise PropertyFailure(f"paged cache: pool block {block} is row {ob}'s block {oj} and row {b}'s block "
                                      f"{j}: one block holds positions of two places [block table "
                                      f"{tuple(table.shape)}, block_size {bs}{hint}]")
            owner[block] = (b, j)
    written = getattr(session, "written", None)
    for b, n in enumerate(lengths):
        if written is not None and n != written:
            raise PropertyFailure(f"paged cache: the layout says row {b} holds {n} positions, the session wrote "
                                  f"{written} (rows are left-padded: every row holds them all)")
        row = table[b].tolist()
        missing = [j for j in range(-(-n // bs)) if j >= len(row) or row[j] < 0]
        if missing:
            raise PropertyFailure(f"paged cache: row {b} holds {n} positions but has no block for table entries "
                                  f"{missing} (block_size {bs}): its positions are nowhere in the pool")


def held_blocks(layout) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """A copy-on-write paged cache's handed-out blocks as they are now (per block, every layer's key
    and value slice, copied), to compare after the next operation (`shared_block_writes`); None for
    any other layout."""
    if not isinstance(layout, PagedLayout) or not layout.copy_on_write:
        return None
    return {block: [(k[block].clone(), v[block].clone()) for k, v in layout.pools] for block in layout.distinct_blocks()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # bytes: NaN == NaN, -0.0 != 0.0


def first_change(layout: PagedLayout, block: int, was) -> tuple[int, str, list[int]] | None:
    """(layer, "key"/"value", the block's slots that changed) of the first pool whose `block` differs
    from `was` (`held_blocks`' copy of it), or None."""
    for layer, ((k, v), (k0, v0)) in enumerate(zip(layout.pools, was)):
        for name, now, old in (("key", k[block], k0), ("value", v[block], v0)):
            slots = (_bytes(now) != _bytes(old)).reshape(now.shape[0], now.shape[1], -1).any(-1).any(0)
            if slots.any():
                return layer, name, slots.nonzero().flatten().tolist()
    return None


def shared_block_writes(before: dict | None, layout, step) -> list[str]:
    """What `step` wrote into blocks rows share, in a cache declared `PagedLayout(copy_on_write=True)`:
    every block two or more rows hold after it must hold the bytes it held before it (a write into
    a shared block reaches every row that holds it: copy-on-write copies the block first), and no
    block rows share may be one that no row held before (a fresh block handed to two rows at once,
    both writing into it). `before`: `held_blocks` before the step (None: nothing to compare)."""
    if before is None or not isinstance(layout, PagedLayout) or not layout.copy_on_write:
        return []
    problems = []
    for block, entries in sorted(layout.shared().items()):
        rows = " and ".join(f"row {b}" for b, _ in entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4
                                                                   else "")
        if block not in before:
            problems.append(f"pool block {block} (table index {entries[0][1]}) was handed to {rows} at once by step "
                            f"{step}: no row held it before, and a block rows share is never written")
            continue
        changed = first_change(layout, block, before[block])
        if changed:
            layer, name, slots = changed
            j = entries[0][1]
            positions = ", ".join(str(j * layout.block_size + s) for s in slots[:4])
            problems.append(f"step {step} wrote into pool block {block}, which {rows} share (table index {j}): layer "
                            f"{layer} {name} position{'s' if len(slots) > 1 else ''} {positions} changed in every row "
                            f"that holds it. A block rows share is read-only: copy-on-write copies it into a fresh "
                            f"block for the row that writes")
    return problems


def kv_axes(session, cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`session.kv()`, each tensor checked against the order every layout's kv() hands over (module doc):
    (batch, heads, positions, head_dim), at least the positions written. Another order, such as the
    (batch, seq, heads, head_dim) a token-major cache stores, is the adapter's error, in one line naming
    the shape it got and the one expected: the checks that read storages would pass it, P2 would compare
    its axes crossed. (A cache whose positions equal its heads cannot be told apart by shape.)"""
    pairs = list(session.kv())
    B, H, hd, written = session.batch, cfg.n_heads, cfg.head_dim, session.written
    runner = getattr(session, "runner", None)
    who = getattr(runner, "name", None) or type(session).__name__
    for layer, pair in enumerate(pairs):
        for name, t in zip(("key", "value"), pair):
            shape = tuple(t.shape)
            if len(shape) == 4 and shape[0] == B and shape[1] == H and shape[2] >= written and shape[3] == hd:
                continue
            seq_first = len(shape) == 4 and shape[0] == B and shape[2] == H and shape[3] == hd
            raise AdapterError(
                f"{who}: kv() layer {layer} {name} has shape {shape}, expected (batch {B}, heads {H}, positions >= "
                f"{written}, head_dim {hd}): kv() hands the cache over as (batch, heads, seq, head_dim)"
                + ("; this is (batch, seq, heads, head_dim): return the stored tensor's .transpose(1, 2)"
                   if seq_first else "") + " (docs/targets.md, 'Cache layouts')")
    return pairs


def storage_tensors(session) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the tensors the cache lives in: the pools of a paged layout, the codes of a
    quantized one, else `kv()`."""
    layout = layout_of(session)
    return layout.storage_tensors() if isinstance(layout, (PagedLayout, QuantizedKV)) else list(session.kv())


def handed_out(layout: PagedLayout, *others: PagedLayout) -> set[int]:
    """Pool blocks in the block table of `layout` or of `others` (sessions sharing its pool)."""
    out = {b for row in layout.rows() for b in row}
    pool = layout.pools[0][0].untyped_storage()._cdata
    for other in others:
        if isinstance(other, PagedLayout) and other.pools[0][0].untyped_storage()._cdata == pool:
            out |= {b for row in other.rows() for b in row}
    return out


def poison_paged(layout: PagedLayout, written: int, value: float, *others: PagedLayout) -> int:
    """Fill every never-written slot of a paged cache with `value`: in each row's handed-out blocks
    the slots at positions >= `written`, and every pool block in no table (of this session or of the
    `others` sharing its pool, whose blocks are theirs). Returns the number of slots filled per pool."""
    bs = layout.block_size
    slots: list[tuple[int, int]] = []  # (block, first slot in it to fill)
    for b, row in enumerate(layout.block_table.tolist()):
        for j, block in enumerate(row):
            if block >= 0 and (j + 1) * bs > written:
                slots.append((block, max(0, written - j * bs)))
    taken = handed_out(layout, *others)
    num_blocks = layout.pools[0][0].shape[0]
    slots += [(block, 0) for block in range(num_blocks) if block not in taken]
    for k, v in layout.pools:
        for block, start in slots:
            k[block, :, start:] = value
            v[block, :, start:] = value
    return sum(bs - start for _, start in slots)
