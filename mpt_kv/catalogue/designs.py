"""Legitimate designs that must pass every check: the suite's guard against false positives.

Each design is the reference with ONE change that real, correct KV-cache code makes (assembled
as in assembly.py), with where such a design comes from. `python -m mpt_kv killmatrix` runs
every check on every design beside the catalogue that must be killed (variants.py), and fails
if a check fails a design: a gate that fails correct code gets switched off, so a failing
design means the check is wrong, never the design.

Every design is also a target factory:

    pytest --target mpt_kv.catalogue.designs:stacked_kv --only-targets
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mpt_kv.catalogue.assembly import StaticOutputMPT, attention_forward, attention_with, model_with, runner_factory
from mpt_kv.errors import InputError
from mpt_kv.model.cache import ConcatCache, StaticCache, check_crop, check_reorder, check_size, write_slots
from mpt_kv.model.reference import Attention, ReferenceMPT
from mpt_kv.targets import Capabilities
from mpt_kv.targets.layouts import BlockGrowth, PagedLayout, QuantizedKV


@dataclass(frozen=True)
class Design:
    name: str
    what: str        # one line: what it does differently from the reference
    origin: str      # where such a design comes from
    build: Callable  # (cfg, state_dict, device, dtype) -> Runner
    dtype: torch.dtype | None = None  # the dtype the kill matrix runs the row in (None: the matrix's, fp32)


DESIGNS: dict[str, Design] = {}


def design(name, what, origin, model, capabilities=Capabilities(), dtype=None):
    """Register a design and return its factory (also a module attribute of the same name); `dtype`:
    the kill matrix runs its row in that dtype (a design that differs from the reference only there)."""
    build = runner_factory(name, model, capabilities=capabilities, module=__name__)
    DESIGNS[name] = Design(name, what, origin, build, dtype)
    return build


def static_cache(model, cache_class, batch, max_len, fill):
    """`cache_class(...)` with the arguments the reference's StaticCache takes."""
    c, w = model.cfg, model.transformer.wte.weight
    return cache_class(c.n_layers, batch, c.n_heads, max_len or c.max_seq_len, c.head_dim, w.dtype, w.device, fill)


# --- one storage for several cached tensors (P3 must tell them from views of mixed_qkv) ----------------

class StackedConcatCache(ConcatCache):
    """Each layer's K and V in one (2, B, H, T, hd) tensor; `kv` holds its two halves."""

    def __init__(self, n_layers):
        super().__init__(n_layers)
        self.stacked: list[torch.Tensor | None] = [None] * n_layers

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        new = torch.stack([k, v])  # a copy: never a view of mixed_qkv
        if self.stacked[layer] is not None:
            new = torch.cat([self.stacked[layer], new], dim=3)
        self.stacked[layer] = new
        self.kv[layer] = (new[0], new[1])
        return self.kv[layer]

    # the stacked buffer is the cache: crop and reorder it, one layer at a time (the old layer goes
    # before the next is made), and view its halves again
    def crop(self, n):
        self._replace(lambda s: s[:, :, :, :n].clone())

    def reorder(self, index):
        self._replace(lambda s: s.index_select(1, index))

    def _replace(self, new):
        for layer, s in enumerate(self.stacked):
            if s is not None:
                self.kv[layer] = None
                self.stacked[layer] = s = new(s)
                self.kv[layer] = (s[0], s[1])


class StackedStaticCache(StaticCache):
    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, dtype, device, fill=None):
        shape = (2, batch, n_heads, max_len, head_dim)
        self.stacked = [torch.full(shape, 0.0 if fill is None else fill, dtype=dtype, device=device)
                        for _ in range(n_layers)]
        self.kv = [(s[0], s[1]) for s in self.stacked]
        self.prefilled = [False] * n_layers
        self.max_len = max_len


class StackedMPT(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        if path == "concat":
            return StackedConcatCache(self.cfg.n_layers)
        return static_cache(self, StackedStaticCache, batch, max_len, fill)


stacked_kv = design(
    "stacked_kv",
    "each layer's K and V live in one stacked (2, B, H, T, hd) tensor (both paths): no byte wasted, "
    "but K and V are views of a buffer twice their size",
    "vLLM's FlashAttention backend keeps one (2, num_blocks, block_size, heads, head_size) cache per "
    "layer; TensorRT-Edge-LLM's KV cache puts the K/V split outermost the same way",
    StackedMPT)


class OneAllocationStaticCache(StaticCache):
    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, dtype, device, fill=None):
        shape = (n_layers, 2, batch, n_heads, max_len, head_dim)
        self.buffer = torch.full(shape, 0.0 if fill is None else fill, dtype=dtype, device=device)
        self.kv = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(n_layers)]
        self.prefilled = [False] * n_layers
        self.max_len = max_len


class OneAllocationMPT(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        if path == "concat":
            return super().new_cache(path, batch, max_len, fill)
        return static_cache(self, OneAllocationStaticCache, batch, max_len, fill)


one_allocation_for_all_layers = design(
    "one_allocation_for_all_layers",
    "the static path allocates every layer's K and V in one (layers, 2, B, H, L, hd) buffer; each "
    "cached tensor is a view of it (the concat path is the reference's)",
    "TensorRT-LLM's KV cache packs all layers into each block of one pool; one allocation up front "
    "avoids fragmentation and is what a graph captures",
    OneAllocationMPT)


# --- a cache pool kept across generations (memory must judge growth, not the first level) -----------

class PoolMPT(ReferenceMPT):
    """Keeps the static cache on the model and hands it to the next generation of the same shape."""

    zero_on_reuse = True

    def new_cache(self, path, batch, max_len=None, fill=None):
        if path != "static":
            return super().new_cache(path, batch, max_len, fill)
        pool = getattr(self, "pool", None)
        if pool is None or pool.kv[0][0].shape[0] != batch or pool.max_len != (max_len or self.cfg.max_seq_len):
            self.pool = super().new_cache(path, batch, max_len, fill)  # a pool of another shape is freed
            return self.pool
        if self.zero_on_reuse:
            for k, v in pool.kv:
                k.zero_()
                v.zero_()
        pool.prefilled = [False] * self.cfg.n_layers  # the prefill writes from slot 0 again
        return pool


class UnzeroedPoolMPT(PoolMPT):
    zero_on_reuse = False  # stale slots are masked until written: the static path's mask covers them


POOL = Capabilities(cache_pool=True)

cache_pool_zeroed = design(
    "cache_pool_zeroed",
    "the static cache is kept on the model and reused, zeroed, by the next generation of the same "
    "shape (declared: Capabilities(cache_pool=True)); its bytes stay allocated between generations",
    "optimum-habana's --reuse_cache: allocate_kv_cache keeps one KVCache per layer on the model and "
    "KVCache.allocate reuses it with fill_(0) when the shape matches (models/llama/modeling_llama.py, 1.21)",
    PoolMPT, POOL)

cache_pool_not_zeroed = design(
    "cache_pool_not_zeroed",
    "the same pool reused without zeroing: every stale slot of the previous generation is masked "
    "until this generation writes it",
    "the fill_(0) of optimum-habana's KVCache.allocate is a saving to make when the mask covers "
    "every slot not yet written (the static path's mask does)",
    UnzeroedPoolMPT, POOL)


# --- copies, ALiBi, softmax, outputs ---------------------------------------------------------------

def copy_out(t: torch.Tensor) -> torch.Tensor:
    # .contiguous() copies only a tensor that is not contiguous; the (1, 1, H, hd) slice of a
    # one-token, one-row prompt is, and would stay a view (variants.contiguous_is_not_always_a_copy)
    return t.contiguous() if not t.is_contiguous() else t.clone()


class TokenMajorConcatCache(ConcatCache):
    """Keeps K and V as (B, T, H, hd) `.contiguous()` copies; attention and kv() get (B, H, T, hd) views."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H, hd) views of mixed_qkv
        if self.kv[layer] is None:
            k, v = copy_out(k), copy_out(v)
        else:
            old_k, old_v = (t.transpose(1, 2) for t in self.kv[layer])
            k, v = torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1)
        self.kv[layer] = (k.transpose(1, 2), v.transpose(1, 2))
        return self.kv[layer]


contiguous_copies = design(
    "contiguous_copies",
    "the concat path copies K and V with .contiguous() into a token-major (B, T, H, hd) cache; "
    "attention and kv() see transposed, non-contiguous views of it",
    "the `.transpose(1, 2).contiguous()` idiom of many attention modules; (B, T, H, hd) is the layout "
    "flash-attention style kernels read",
    model_with(concat=TokenMajorConcatCache))

class TransposedKeyConcatCache(ConcatCache):
    """Keeps K transposed, (B, H, hd, T), grown by torch.cat on its last dimension, V as (B, H, T, hd);
    attention and kv() get a (B, H, T, hd) view of the stored key (`q @ k.transpose(-1, -2)` then reads
    the stored (hd, T) matrix as it is)."""

    def _store(self, layer, key_t, v):
        self.kv[layer] = (key_t.transpose(2, 3), v)  # the only reference to the stored key: its view
        return self.kv[layer]

    def key_t(self, layer):
        """The stored (B, H, hd, T) key (the view's transpose is the stored tensor itself)."""
        return self.kv[layer][0].transpose(2, 3)

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:  # copies: k and v are views of mixed_qkv
            return self._store(layer, k.transpose(2, 3).clone(memory_format=torch.contiguous_format), v.clone())
        return self._store(layer, torch.cat([self.key_t(layer), k.transpose(2, 3)], dim=3),
                           torch.cat([self.kv[layer][1], v], dim=2))

    def crop(self, n):
        n = check_crop(n, self.length(), "TransposedKeyConcatCache.crop")
        for layer, pair in enumerate(self.kv):
            if pair is not None:  # the key along its positions, its last dimension
                self._store(layer, self.key_t(layer)[..., :n].clone(memory_format=torch.contiguous_format),
                            pair[1][:, :, :n].clone())

    def reorder(self, index):
        if self.kv[0] is not None:
            check_reorder(index, self.kv[0][0].shape[0], self.kv[0][0].device, "TransposedKeyConcatCache.reorder")
        for layer, pair in enumerate(self.kv):
            if pair is not None:  # one layer at a time
                self._store(layer, self.key_t(layer).index_select(0, index), pair[1].index_select(0, index))


transposed_key_cache = design(
    "transposed_key_cache",
    "the concat path stores K transposed, (B, H, hd, T), grown by torch.cat on its last dimension (V as "
    "(B, H, T, hd)); attention reads the stored key as it is and kv() hands the checks a (B, H, T, hd) view of it",
    "llm-foundry's attn_impl='torch' (llmfoundry/models/layers/attention.py, scaled_multihead_dot_product_attention: "
    "the key kept as (b, h, d, s) so q @ k needs no transpose), what the Hub's mosaicml/mpt-* remote code runs",
    model_with(concat=TransposedKeyConcatCache))

alibi_sliced_from_the_front = design(
    "alibi_sliced_from_the_front",
    "ALiBi is sliced from the front of the (H, 1, max_seq_len) bias, [:K] instead of [-K:]: every "
    "score of a query row moves by the same constant, which softmax ignores",
    "BLOOM (transformers' build_alibi_tensor) counts ALiBi positions from 0 up; MPT counts them "
    "from -(max_seq_len - 1) up and slices the end: the two differ by a per-row constant",
    model_with(attention=attention_with(bias_from_front=True)))


class ModelDtypeSoftmax(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, softmax_dtype=x.dtype)


softmax_in_model_dtype = design(
    "softmax_in_model_dtype",
    "softmax in the model's dtype instead of an fp32 upcast: bit-identical in an fp32 model "
    "(declared: bf16 unsupported, where it would be a different computation)",
    "optimum-habana's --attn_softmax_bf16 keeps softmax in the model dtype; in fp32 it is the "
    "reference's computation",
    model_with(attention=ModelDtypeSoftmax),
    Capabilities(unsupported={"bf16": "softmax in the model dtype is the reference's computation only in fp32"}))

graph_outputs_declared = design(
    "graph_outputs_declared",
    "every call returns its logits in one preallocated buffer per shape, overwritten by the next call of "
    "that shape, and declares it (Capabilities(graph_outputs=True))",
    "CUDA graphs and HPU graphs (optimum-habana's --use_hpu_graphs, wrap_in_hpu_graph): a replay "
    "returns the graph's static output tensor",
    StaticOutputMPT, Capabilities(graph_outputs=True))


# --- cache layouts beyond contiguous tensors (issue 16): a block pool, and blocks grown on demand -----

import math  # noqa: E402  (this section's own imports: the catalogue grows by appending)

import torch.nn.functional as F  # noqa: E402

from mpt_kv.targets.reference import ReferenceSession  # noqa: E402


def layout_design(name, what, origin, model, session, capabilities=Capabilities()):
    """Register a design whose session is its own (it declares a cache layout)."""
    build = runner_factory(name, model, session, capabilities=capabilities, module=__name__)
    DESIGNS[name] = Design(name, what, origin, build)
    return build


class BlockPool:
    """vLLM's KV cache: per layer a key pool and a value pool (num_blocks, H, block_size, hd),
    allocated once on the model and shared by the generations that run on it; blocks go out
    from a free list and come back when a generation's cache is freed."""

    def __init__(self, cfg, num_blocks, block_size, dtype, device):
        shape = (num_blocks, cfg.n_heads, block_size, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(cfg.n_layers)]
        self.block_size, self.num_blocks = block_size, num_blocks
        self.free = list(range(num_blocks))[::-1]  # popped from the end: block 0 first

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(f"block pool exhausted: all {self.num_blocks} blocks are handed out")
        return self.free.pop()

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


class PagedCache:
    """One generation's share of the pool: a block table (B, max_blocks) and each row's length.
    The session hands out blocks before each forward (host side, as vLLM's scheduler does);
    attention writes the new k, v into their slots and reads the blocks in place, one block at
    a time (as a paged attention kernel does), never gathering a layer's cache."""

    lookahead = 0  # blocks handed out beyond the ones the positions written need

    def __init__(self, pool: BlockPool, n_layers, batch, max_len, static, device):
        import weakref

        self.pool, self.static, self.max_len, self.block_size = pool, static, max_len, pool.block_size
        width = -(-max_len // pool.block_size) + self.lookahead
        self.table = torch.full((batch, width), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.blocks: list[int] = []  # every block this generation holds, given back when it is freed
        self.n_blocks = 0            # table entries filled per row
        self.filled = 0              # positions written per row (the static prefill: its padded length)
        self.prefilled = False
        self.kv = [None] * n_layers  # the reference's input check reads kv: a paged cache has no contiguous K/V
        weakref.finalize(self, pool.give_back, self.blocks)

    def reserve(self, upto: int) -> None:
        """Every row gets the blocks for positions [0, upto), rows interleaved in the pool."""
        need = min(-(-upto // self.block_size) + self.lookahead, self.table.shape[1])
        for j in range(self.n_blocks, need):
            for b in range(self.table.shape[0]):
                block = self.pool.take()
                self.blocks.append(block)
                self.table[b, j] = self.hand_out(b, j, block)
        self.n_blocks = max(self.n_blocks, need)

    def hand_out(self, row, j, block) -> int:
        return block

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        """The reference's cache interface: write the T new positions into each row's blocks (the
        prefill from slot 0; a cached call, a decode step or an extend of k tokens, from `filled`
        (concat) or token_idx - 1 (static)) and return the prefill's own k, v; a cached call's
        attention then reads the pool in place (PagedAttention)."""
        kp, vp = self.pool.kv[layer]
        bs, T = self.block_size, k.shape[2]
        if not self.prefilled:
            start = 0
        elif self.static:  # a tensor position: no host sync, the same ops every step
            start = (token_idx.reshape(1) - 1).to(self.table.device)
        else:
            start = self.filled
        positions = start + torch.arange(T, device=self.table.device)
        blocks, slots = self.table[:, positions // bs], positions % bs  # (B, T), (T,)
        kp[blocks, :, slots] = k.transpose(1, 2)  # (B, T, H, hd) into block, head, slot
        vp[blocks, :, slots] = v.transpose(1, 2)
        return k, v

    def crop(self, n: int) -> None:
        """Keep positions [0, n): the blocks past the ones n positions need go back to the pool (the
        session masks the cropped slots again; the next call is handed blocks as it needs them)."""
        keep = min(-(-n // self.block_size) + self.lookahead, self.table.shape[1])
        gone = [int(b) for b in self.table[:, keep:].flatten().tolist() if b >= 0]
        self.table[:, keep:] = -1
        self.release(gone)
        self.n_blocks, self.filled = min(self.n_blocks, keep), n
        self.lengths.fill_(n)

    def reorder(self, index: torch.Tensor) -> None:
        """Row b takes row index[b]'s blocks: a permutation of the block table's rows, no K/V moved.
        A row taken twice (two beams from one) gives its blocks to the first row that takes it and a
        copy in fresh blocks to each other one (copy-on-write done at once: a block is never in two
        places); the blocks of a row no one takes go back to the pool first, one block at a time."""
        old = self.table.clone()
        sources = index.tolist()
        self.release([int(b) for r in range(len(sources)) if r not in sources for b in old[r].tolist() if b >= 0])
        taken = set()
        for row, src in enumerate(sources):
            self.table[row] = old[src]
            if src in taken:
                for j, block in enumerate(old[src].tolist()):
                    if block >= 0:
                        fresh = self.pool.take()
                        self.blocks.append(fresh)
                        self.table[row, j] = fresh
                        for kp, vp in self.pool.kv:  # one block of one layer at a time
                            kp[fresh], vp[fresh] = kp[block], vp[block]
            taken.add(src)

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.blocks.remove(block)  # in place: the finalizer gives back what this list holds then
        self.pool.give_back(blocks)


def paged_attention(q, kp, vp, table, K, bs, bias, mask):
    """softmax(q k^T / sqrt(hd) + ALiBi, masked) v over the first K positions of each row's blocks,
    reading one block of the pool at a time (a block's copy, never a layer's cache)."""
    hd = q.shape[-1]
    nb = -(-K // bs)
    blocks = [table[:, j].clamp(min=0) for j in range(nb)]  # -1: no block yet; its slots are masked
    scores = torch.cat([q @ kp[blk].transpose(-1, -2) for blk in blocks], dim=-1)[..., :K] / math.sqrt(hd)
    scores = scores + bias[:, :, -K:]
    scores = scores.masked_fill(mask[:, :, :, :K], torch.finfo(q.dtype).min)
    weights = F.softmax(scores.float(), dim=-1)  # fp32, as MPT
    del scores
    out = None
    for j, blk in enumerate(blocks):  # each block's share in the model dtype, summed in fp32
        n = min(bs, K - j * bs)
        part = (weights[..., j * bs:j * bs + n].to(vp.dtype) @ vp[blk][:, :, :n]).float()
        out = part if out is None else out + part
    return out.to(q.dtype)


class PagedAttention(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        if not isinstance(cache, PagedCache):
            return super().forward(x, mask, bias, cache, layer, token_idx, cache_idx)
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        mixed_qkv = self.Wqkv(x)
        if self.cfg.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
        q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        prefill = not cache.prefilled
        cache.update(layer, k, v, token_idx, cache_idx)
        if prefill:  # the prompt attends over its own k, v (as the reference's static prefill)
            return super().forward(x, mask, bias, None, layer, token_idx, cache_idx)
        K = (int(cache_idx) if cache_idx is not None else cache.max_len) if cache.static else cache.filled + T
        kp, vp = cache.pool.kv[layer]
        out = paged_attention(q, kp, vp, cache.table, K, cache.block_size, bias, mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class PagedMPT(model_with(attention=PagedAttention)):
    """Both paths paged, from one pool on the model (static: the token_idx protocol over it)."""

    block_size = 4  # the kill matrix's cases (5-24 positions) cross several blocks
    cache_class = PagedCache

    def new_cache(self, path, batch, max_len=None, fill=None):
        max_len = max_len or self.cfg.max_seq_len
        need = batch * (-(-max_len // self.block_size) + self.cache_class.lookahead)
        pool = getattr(self, "block_pool", None)
        idle = pool is not None and len(pool.free) == pool.num_blocks
        if pool is None or (idle and pool.num_blocks < 2 * need):
            w = self.transformer.wte.weight  # room for two generations side by side (P2 runs concat and static)
            pool = self.block_pool = BlockPool(self.cfg, 2 * need, self.block_size, w.dtype, w.device)
        device = self.transformer.wte.weight.device
        return self.cache_class(pool, self.cfg.n_layers, batch, max_len, path == "static", device)

    def _positions(self, T, cache, token_idx, cache_idx):
        if not isinstance(cache, PagedCache):
            return super()._positions(T, cache, token_idx, cache_idx)
        if cache.static and cache.prefilled:
            start = token_idx.reshape(-1)[0] - 1 if torch.is_tensor(token_idx) else int(token_idx) - 1
            return start, int(cache_idx) if cache_idx is not None else cache.max_len
        return cache.filled, cache.filled + T


def gathered(pool: torch.Tensor, table: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H, T, hd): a copy of each row's first T positions, gathered through the block table."""
    blocks = pool[table.clamp(min=0)]  # (B, max_blocks, H, bs, hd)
    B, nb, H, bs, hd = blocks.shape
    # a copy of T positions exactly (a slice of the gathered blocks would hold the
    # last block's unwritten slots beyond them, which ops-P3 reads as a tail pinned by a crop)
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, hd)[:, :, :T].clone()


class PagedSession(ReferenceSession):
    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        first = self.cache is None
        if first:
            self.cache = self.model.new_cache(self.path, input_ids.shape[0], self.max_len)
            cache_idx = None  # the prefill attends over its own tokens
        # positions this call writes (the static prefill: the prompt padded to max_len; a cached call
        # of T tokens, a decode step or an extend: written + T) and holds
        writes = input_ids.shape[1] if first else self.written + input_ids.shape[1]
        holds = (int(token_idx.reshape(-1)[0]) if token_idx is not None else writes) if first else writes
        self.cache.reserve(writes)
        logits = self.model(input_ids, mask, self.cache, token_idx, cache_idx)
        self.cache.filled, self.cache.prefilled = max(self.cache.filled, writes), True
        self.cache.lengths.fill_(holds)
        return logits

    def kv(self):
        c = self.cache
        T = c.max_len if c.static else c.filled
        return [(gathered(k, c.table, T), gathered(v, c.table, T)) for k, v in c.pool.kv]

    def cache_layout(self):
        c = self.cache
        return None if c is None else PagedLayout(pools=c.pool.kv, block_table=c.table, block_size=c.block_size,
                                                  lengths=c.lengths)


paged_cache = layout_design(
    "paged_cache",
    "both paths keep K/V in a block pool on the model, (num_blocks, H, block_size 4, hd) per layer, shared by "
    "its generations; each generation holds a block table (B, max_blocks) and reads its blocks in place, one "
    "block at a time; kv() gathers copies and cache_layout() returns the PagedLayout (declared: cache_pool)",
    "vLLM's PagedAttention (and the Gaudi vLLM plugin serving MPT): a block pool allocated once per engine, a "
    "block table per sequence, blocks handed out as a sequence grows and freed when it finishes",
    PagedMPT, PagedSession, POOL)


class CopyOnWritePagedCache(PagedCache):
    """vLLM's fork of a sequence for beam search: a reorder points each row's block table at its
    source row's blocks (shared, counted by the table entries that hold them), no K/V moved; before
    a call writes positions into a block another row also holds, the writing row gets a fresh copy
    of it (copy-on-write, one block of every layer) and writes there; the last row holding a block
    writes in place. A block goes back to the pool when no row holds it. The table is kept on the
    host too (`host`, as vLLM's block manager keeps it): a decode step decides on it without a host
    sync, and writes the device table."""

    def __init__(self, pool, n_layers, batch, max_len, static, device):
        super().__init__(pool, n_layers, batch, max_len, static, device)
        self.host = [[-1] * self.table.shape[1] for _ in range(batch)]

    def hand_out(self, row, j, block) -> int:
        self.host[row][j] = block
        return block

    def held(self) -> set[int]:
        return {b for row in self.host for b in row if b >= 0}

    def reorder(self, index: torch.Tensor) -> None:
        held = self.held()
        self.host = [list(self.host[r]) for r in index.tolist()]
        self.table.copy_(torch.tensor(self.host, dtype=self.table.dtype))  # in place: the table keeps its address
        self.release(sorted(held - self.held()))

    def crop(self, n: int) -> None:
        keep = min(-(-n // self.block_size) + self.lookahead, self.table.shape[1])
        held = self.held()
        for row in self.host:
            row[keep:] = [-1] * (len(row) - keep)
        self.table[:, keep:] = -1
        self.release(sorted(held - self.held()))  # a block rows shared goes back once
        self.n_blocks, self.filled = min(self.n_blocks, keep), n
        self.lengths.fill_(n)

    def unshare(self, start: int, end: int) -> None:
        """Before a call writes positions [start, end): each row's table entry they fall in that
        another row also holds becomes a fresh copy of its block."""
        bs = self.block_size
        for j in range(start // bs, min(-(-end // bs), self.table.shape[1])):
            for b, row in enumerate(self.host):
                block = row[j]
                if block >= 0 and sum(r[j] == block for r in self.host) > 1:
                    fresh = self.pool.take()
                    self.blocks.append(fresh)
                    for kp, vp in self.pool.kv:  # one block of one layer at a time
                        kp[fresh].copy_(kp[block])
                        vp[fresh].copy_(vp[block])
                    row[j] = fresh
                    self.table[b, j] = fresh


class CopyOnWritePagedMPT(PagedMPT):
    cache_class = CopyOnWritePagedCache


class CopyOnWritePagedSession(PagedSession):
    copy_before_write = True

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.cache is not None and self.copy_before_write:  # a cached call writes [written, written + T)
            self.cache.unshare(self.written, self.written + input_ids.shape[1])
        return super()._forward(input_ids, mask, token_idx, cache_idx)

    def cache_layout(self):
        import dataclasses

        layout = super().cache_layout()
        return None if layout is None else dataclasses.replace(layout, copy_on_write=True)


paged_copy_on_write = layout_design(
    "paged_copy_on_write",
    "the paged cache's beam reorder shares blocks instead of copying them: rows forked from one row point at its "
    "blocks until one of them writes, and a write into a block another row holds first copies it for the writer; "
    "declared by cache_layout() as PagedLayout(copy_on_write=True)",
    "vLLM's fork of a sequence for beam search and parallel sampling (a block's reference count, copy-on-write "
    "before an append into a shared block); the prompt's blocks stay shared for the whole generation",
    CopyOnWritePagedMPT, CopyOnWritePagedSession, POOL)


class BlockGrowthConcatCache(ConcatCache):
    """Concat path: K and V of each layer in (B, H, capacity, hd) buffers that grow by `block_size`
    positions (one allocation per block, the old buffer copied then freed); kv() holds views."""

    block_size = 4
    blocks_ahead = 1  # capacity rounds up to this many blocks beyond the positions held, less one

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        self.buffers = getattr(self, "buffers", [None] * len(self.kv))
        T, n = self.length(layer), k.shape[2]
        buf, old = self.buffers[layer], self.kv[layer]
        if buf is None or buf[0].shape[2] < T + n:
            capacity = (-(-(T + n) // self.block_size) + self.blocks_ahead - 1) * self.block_size
            new = tuple(torch.empty(t.shape[0], t.shape[1], capacity, t.shape[3], dtype=t.dtype, device=t.device)
                        for t in (k, v))
            if old is not None:
                new[0][:, :, :T], new[1][:, :, :T] = old
            self.kv[layer] = old = None  # the old buffer's views go with it
            buf = self.buffers[layer] = new
            del new
        buf[0][:, :, T:T + n], buf[1][:, :, T:T + n] = k, v
        self.kv[layer] = (buf[0][:, :, :T + n], buf[1][:, :, :T + n])
        return self.kv[layer]

    def crop(self, n: int) -> None:
        """Keep positions [0, n): per layer, new buffers of the capacity n positions round up to (as
        `update` grows them) holding copies of them, the old ones freed before the next layer's are
        made. Keeping the old buffer would pin the cropped tail (ops-P3), up to a whole buffer beyond
        the one block declared."""
        capacity = (-(-n // self.block_size) + self.blocks_ahead - 1) * self.block_size
        for layer, pair in enumerate(self.kv):
            if pair is None:
                continue
            self.kv[layer] = self.buffers[layer] = None
            new = tuple(torch.empty(t.shape[0], t.shape[1], capacity, t.shape[3], dtype=t.dtype, device=t.device)
                        for t in pair)
            new[0][:, :, :n], new[1][:, :, :n] = pair[0][:, :, :n], pair[1][:, :, :n]
            del pair
            self.buffers[layer] = new
            self.kv[layer] = (new[0][:, :, :n], new[1][:, :, :n])

    def reorder(self, index: torch.Tensor) -> None:
        """Row b becomes row index[b] in place, layer by layer, tensor by tensor: the buffers stay
        where they are (the views in kv() with them) and the transient is one cached tensor."""
        for k, v in (pair for pair in self.kv if pair is not None):
            k.copy_(k.index_select(0, index))  # the gather is read whole before a row is written
            v.copy_(v.index_select(0, index))


class BlockGrowthSession(ReferenceSession):
    def cache_layout(self):
        return BlockGrowth(self.cache.block_size) if self.path == "concat" and self.cache is not None else None


cache_growing_in_blocks = layout_design(
    "cache_growing_in_blocks",
    "the concat path grows each layer's K and V buffers by blocks of 4 positions (one allocation per block, "
    "not per token, the old buffer copied then freed); kv() returns views of the buffers, declared by "
    "cache_layout() as BlockGrowth(4)",
    "amortized growth, as a growable array grows: one allocation per block of 16 or 64 slots instead of one "
    "torch.cat per token (transformers' DynamicCache); a block of 4 here, so the tiny cases grow often and on "
    "their last step",
    model_with(concat=BlockGrowthConcatCache), BlockGrowthSession)

class BlockGrowth16ConcatCache(BlockGrowthConcatCache):
    block_size = 16


cache_growing_in_blocks_of_16 = layout_design(
    "cache_growing_in_blocks_of_16",
    "the same growing cache with vLLM's default block of 16 positions (BlockGrowth(16)): a decode step that "
    "grows holds the old buffer and a new one up to 15 positions longer than the tokens it holds",
    "vLLM's default block_size of 16; transformers' and TensorRT-LLM's growable caches use blocks of 16-64",
    model_with(concat=BlockGrowth16ConcatCache), BlockGrowthSession)

# --- cache operations: extend, crop, reorder (the ops column, programs.py) -------------------------------

from mpt_kv.targets.reference import ReferenceSession  # noqa: E402  (the session designs below)

class InPlaceReorderConcat(ConcatCache):
    """Each layer's K and V reordered into their own storage: a gathered copy of one tensor at a time."""

    def reorder(self, index):
        for k, v in (pair for pair in self.kv if pair is not None):
            k.copy_(k.index_select(0, index))  # the gather is read whole before a row is written
            v.copy_(v.index_select(0, index))


in_place_per_layer_reorder = design(
    "in_place_per_layer_reorder",
    "the concat cache reorders its rows in place, layer by layer, tensor by tensor (the static path already "
    "does): the storage never moves and the transient is one tensor",
    "optimum-habana's llama `reorder_kv_cache` (reuse_cache): index_copy_ of a gathered copy into each layer's "
    "preallocated KVCache (models/llama/modeling_llama.py, 1.21)",
    model_with(concat=InPlaceReorderConcat))


class UntrackedStaticCache(StaticCache):
    """Keeps no count of its positions, as optimum-habana's MPT cache (a [key, value] list): where the
    next write goes is token_idx alone, so a crop is the session moving token_idx back and masking
    the cropped slots again."""

    written = property(lambda self: None, lambda self, value: None)

    def crop(self, n):
        pass  # nothing to do: the slots past n are masked by the session and overwritten by the next call


crop_by_moving_token_idx_back = design(
    "crop_by_moving_token_idx_back",
    "the static cache keeps no length: a crop is token_idx moved back and the cropped slots masked again; "
    "their stale K/V stay in the buffer until overwritten",
    "optimum-habana's static (token_idx) path, where the position lives in the generation loop; transformers' "
    "StaticLayer.crop moves cumulative_length back the same way without touching keys and values",
    model_with(static=UntrackedStaticCache))


class ChunkedPrefillSession(ReferenceSession):
    """The prompt goes in as two chunks: a prefill of the first half, then ONE cached call of the rest."""

    def _prefill(self, input_ids, attention_mask):
        S = input_ids.shape[1]
        # every row needs a token in the first chunk (left padding: a row all padding has nothing to attend)
        c = max(S // 2, int((~attention_mask.bool()).sum(dim=1).max()) + 1)
        if c >= S:
            return super()._prefill(input_ids, attention_mask)
        if self.path == "concat":
            first = self._forward(input_ids[:, :c], attention_mask[:, :c])
            rest = self._forward(input_ids[:, c:], attention_mask)
            self.mask = attention_mask
        else:
            # as the bucketed path: the first chunk prefilled into a cache of max_len slots, then the
            # rest at token_idx c + 1 over the whole buffer, under the full-length mask
            self.mask = torch.zeros(attention_mask.shape[0], self.max_len, dtype=attention_mask.dtype,
                                    device=attention_mask.device)
            self.mask[:, :S] = attention_mask
            first = self._forward(input_ids[:, :c], attention_mask[:, :c], torch.tensor([c], device=input_ids.device))
            rest = self._forward(input_ids[:, c:], self.mask, torch.tensor([c + 1], device=input_ids.device))
        self.sync()
        return torch.cat([first, rest], dim=1)


chunked_prefill = runner_factory("chunked_prefill", ReferenceMPT, ChunkedPrefillSession, module=__name__)
DESIGNS["chunked_prefill"] = Design(
    "chunked_prefill",
    "the prompt is prefilled in two chunks: a prefill of the first part, then one cached call of the rest "
    "(causal inside the chunk, over the first chunk's cache)",
    "chunked prefill (vLLM's enable_chunked_prefill, transformers' generate with prefill_chunk_size): long "
    "prompts in pieces, each a multi-token cached call",
    chunked_prefill)

# --- a quantized KV cache (int8 codes, a scale per token; declared QuantizedKV) -------------------------

def quant_max(dtype: torch.dtype) -> float:
    return float(torch.iinfo(dtype).max if not dtype.is_floating_point else torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None):
    """(codes of `dtype`, fp32 scales (B, H, T, 1)): each position's scale its own max |x| over
    head_dim / the dtype's max (`scale` given: those scales, a code beyond the range clipped)."""
    top = quant_max(dtype)
    if scale is None:
        scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / top
    q = (x.float() / scale).clamp(-top, top)
    return (q.round() if not dtype.is_floating_point else q).to(dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype).mul_(scales)  # in place: one (B, H, T, hd) tensor of the model's dtype per call


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """int8 and fp8 codes as uint8: index_copy_ has no fp8 kernel on CPU, a byte copy is the same."""
    return t.view(torch.uint8)


class QuantizedCache:
    """What both quantized paths share: `q[layer]` = ((key codes, value codes), (key scales, value
    scales)), `dequantized()` the values (copies, in the model's dtype: what the session's kv()
    returns). The prefill attends over its own k, v at full precision (vLLM's prefill reads the
    fresh k, v, not the cache); every cached call attends over the dequantized cache, one layer at
    a time."""

    storage = torch.int8

    @property
    def kv(self):
        """Per layer stand-ins of the dequantized (key, value): their shape, dtype and device, one
        element of storage each. The reference's input validation reads `cache.kv` before every
        call; dequantizing every layer there would hold the whole cache in full precision."""
        return [None if q is None else tuple(torch.zeros((), dtype=self.out_dtype, device=c.device).expand(c.shape)
                                             for c in q[0]) for q in self.q]

    def dequantized(self):
        return [None if q is None else tuple(dequantize(c, s, self.out_dtype) for c, s in zip(*q)) for q in self.q]

    def layout(self):
        return QuantizedKV(self.storage, "token", torch.float32, [q[0] for q in self.q if q is not None],
                           [q[1] for q in self.q if q is not None])

    def _quantize(self, x, layer, i, at):
        """Codes and scales of the new positions `x` (B, H, T, hd) written at position `at` of the
        cache (scales[layer][i]: the key's (0) or value's (1) scales so far, for a variant's bug)."""
        return quantize(x, self.storage)

    def _cached(self, layer) -> bool:
        """Whether a call to `update` for `layer` is a cached call (its prefill is done)."""
        return self.q[layer] is not None

    def _dequantized(self, layer, n=None):
        (kc, vc), (ks, vs) = self.q[layer]
        return tuple(dequantize(c[:, :, :n], s[:, :, :n], self.out_dtype) for c, s in ((kc, ks), (vc, vs)))


class QuantizedConcatCache(QuantizedCache, ConcatCache):
    def __init__(self, n_layers, dtype):
        self.q, self.out_dtype = [None] * n_layers, dtype

    def length(self, layer: int = 0) -> int:
        return 0 if self.q[layer] is None else self.q[layer][0][0].shape[2]

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        at = self.length(layer)
        new = [self._quantize(t, layer, i, at) for i, t in enumerate((k, v))]
        if self.q[layer] is None:
            self.q[layer] = ((new[0][0], new[1][0]), (new[0][1], new[1][1]))
            return k, v
        (kc, vc), (ks, vs) = self.q[layer]
        self.q[layer] = ((torch.cat([kc, new[0][0]], 2), torch.cat([vc, new[1][0]], 2)),
                         (torch.cat([ks, new[0][1]], 2), torch.cat([vs, new[1][1]], 2)))
        return self._dequantized(layer)

    def crop(self, n: int) -> None:
        self.q = [None if q is None else tuple(tuple(t[:, :, :n].clone() for t in pair) for pair in q) for q in self.q]

    def reorder(self, index: torch.Tensor) -> None:
        for layer, q in enumerate(self.q):  # one layer at a time: the transient is one layer's
            if q is not None:
                self.q[layer] = tuple(tuple(t.index_select(0, index) for t in pair) for pair in q)


class QuantizedStaticCache(QuantizedCache, StaticCache):
    def _cached(self, layer) -> bool:
        return self.prefilled[layer]

    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, dtype, device, fill=None):
        codes = lambda: torch.zeros(batch, n_heads, max_len, head_dim, dtype=self.storage, device=device)  # noqa: E731
        scales = lambda: torch.zeros(batch, n_heads, max_len, 1, dtype=torch.float32, device=device)  # noqa: E731
        self.q = [((codes(), codes()), (scales(), scales())) for _ in range(n_layers)]
        self.out_dtype, self.prefilled, self.max_len, self.written = dtype, [False] * n_layers, max_len, 0

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        (kc, vc), (ks, vs) = self.q[layer]
        if not self.prefilled[layer]:
            T = k.shape[2]
            for i, (t, c, s) in enumerate(((k, kc, ks), (v, vc, vs))):
                c[:, :, :T], s[:, :, :T] = self._quantize(t, layer, i, 0)
            self.prefilled[layer] = True
            return k, v
        if token_idx is None:
            raise ValueError("QuantizedStaticCache decode needs token_idx (1-based position of the new token)")
        slots = write_slots(token_idx, k.shape[2])
        for i, (t, c, s) in enumerate(((k, kc, ks), (v, vc, vs))):
            codes, scale = self._quantize(t, layer, i, slots)
            byte_view(c).index_copy_(2, slots, byte_view(codes))
            s.index_copy_(2, slots, scale)
        return self._dequantized(layer, cache_idx)

    def reorder(self, index: torch.Tensor) -> None:
        for q in self.q:
            for t in (*q[0], *q[1]):
                t.copy_(t.index_select(0, index))  # the copy is read whole before any row is written


class QuantizedMPT(ReferenceMPT):
    concat_class, static_class = QuantizedConcatCache, QuantizedStaticCache

    def new_cache(self, path, batch, max_len=None, fill=None):

        batch = check_size("cache batch", batch)  # the reference's checks, without its full-precision buffers
        if path == "concat":
            return self.concat_class(self.cfg.n_layers, self.transformer.wte.weight.dtype)
        if path != "static":
            raise InputError(f"unknown cache path {path!r}: expected 'concat' or 'static'")
        max_len = self.cfg.max_seq_len if max_len is None else check_size("static cache length max_len", max_len)
        if max_len > self.cfg.max_seq_len:
            raise InputError(f"static cache length {max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        return static_cache(self, self.static_class, batch, max_len, fill)


class QuantizedSession(ReferenceSession):
    def kv(self):
        return self.cache.dequantized()

    def cache_layout(self):
        return None if self.cache is None else self.cache.layout()


quantized_kv_int8 = layout_design(
    "quantized_kv_int8",
    "both paths store K and V as int8 codes with one fp32 scale per row, head and position (max abs(x) over head_dim "
    "/ 127), dequantized for attention; declared by cache_layout() as QuantizedKV(int8, scales='token'): its "
    "values within the int8 bound, its bytes the codes and scales",
    "vLLM's kv_cache_dtype='fp8' and SGLang's and TGI's fp8 KV caches, Intel Neural Compressor's FP8 KVCache on "
    "Gaudi; per-token int8 scales as KIVI, QServe and LMDeploy's kv int8",
    QuantizedMPT, QuantizedSession)


class Fp8QuantizedConcatCache(QuantizedConcatCache):
    storage = torch.float8_e4m3fn


class Fp8QuantizedStaticCache(QuantizedStaticCache):
    storage = torch.float8_e4m3fn


class Fp8QuantizedMPT(QuantizedMPT):
    concat_class, static_class = Fp8QuantizedConcatCache, Fp8QuantizedStaticCache


quantized_kv_fp8 = layout_design(
    "quantized_kv_fp8",
    "the same quantized cache with float8_e4m3fn codes (scale: max abs(x) / 448, no rounding step: e4m3 rounds "
    "to its 3 mantissa bits): QuantizedKV(float8_e4m3fn, scales='token')",
    "vLLM's kv_cache_dtype='fp8' (e4m3), Intel Neural Compressor's FP8 KVCache on Gaudi",
    Fp8QuantizedMPT, QuantizedSession)


def dequantize_out_of_place(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales).to(dtype)  # the codes as fp32, their fp32 product, then the model's dtype


class OutOfPlaceDequantize:
    """K, then V, dequantized out of place, as eager code commonly writes it (and transformers'
    Fp8QuantizedLayer._dequantize): while V is dequantized, K's dequantized values, V's codes as fp32
    and their fp32 product are alive at once."""

    def dequantized(self):
        return [None if q is None else tuple(dequantize_out_of_place(c, s, self.out_dtype) for c, s in zip(*q))
                for q in self.q]

    def _dequantized(self, layer, n=None):
        (kc, vc), (ks, vs) = self.q[layer]
        return tuple(dequantize_out_of_place(c[:, :, :n], s[:, :, :n], self.out_dtype) for c, s in ((kc, ks), (vc, vs)))


class OutOfPlaceQuantizedMPT(QuantizedMPT):
    concat_class = type("OutOfPlaceQuantizedConcatCache", (OutOfPlaceDequantize, QuantizedConcatCache), {})
    static_class = type("OutOfPlaceQuantizedStaticCache", (OutOfPlaceDequantize, QuantizedStaticCache), {})


quantized_kv_int8_out_of_place = layout_design(
    "quantized_kv_int8_out_of_place",
    "the int8 quantized cache (quantized_kv_int8) dequantized out of place, (codes.float() * scale).to(dtype), K "
    "then V: one layer's dequantized K beside V's codes as fp32 and their fp32 product during each cached call",
    "the way eager code commonly writes a dequantize, e.g. transformers' Fp8QuantizedLayer._dequantize "
    "((quant_tensor.float() * scale).to(dtype), cache_utils.py in 5.24) and KIVI-style reference code",
    OutOfPlaceQuantizedMPT, QuantizedSession)


# --- attention computed in fp32 in a bf16 model (one layer's q, K, V upcast) ----------------------------

class UpcastSdpaAttention(Attention):
    """q, K and V of this layer upcast to float32 for scaled_dot_product_attention (ALiBi and the mask
    as its float attn_mask), the output cast back: one layer's fp32 copies live during the call."""

    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        mixed_qkv = self.Wqkv(x)
        if self.cfg.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
        q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(layer, k, v, token_idx, cache_idx)
        K = k.shape[2]
        bias = bias[:, :, -K:].float().masked_fill(mask[:, :, :, :K], torch.finfo(torch.float32).min)
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias).to(x.dtype)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


attention_upcast_to_fp32 = design(
    "attention_upcast_to_fp32",
    "a bfloat16 model whose attention upcasts one layer's q, K and V to float32 for scaled_dot_product_attention "
    "(ALiBi and the mask as its float attn_mask): one layer's fp32 copies during each call (a bfloat16 row)",
    "a common CPU choice: bf16 matmuls and softmax are slow or inexact on CPUs without AMX, so eager and SDPA "
    "attention paths compute in fp32 (e.g. transformers' `upcast` / `attention_softmax_in_fp32` options, "
    "GPT-BigCode's and Bloom's fp32 softmax paths)",
    model_with(attention=UpcastSdpaAttention), dtype=torch.bfloat16)


# --- what a captured graph allows (issue 37): graph-capture must pass these -----------------------------

class DeviceGuardStaticCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.prefilled[layer]:  # checked on the device: an error surfaces later, the host never waits
            torch._assert_async(torch.isfinite(k).all(), "a non-finite key reached the static cache")
        return super().update(layer, k, v, token_idx, cache_idx)


nan_guard_on_the_device = design(
    "nan_guard_on_the_device",
    "the static decode step guards its write with torch._assert_async(torch.isfinite(k).all()): a device-side "
    "assert, no host read, so the step stays one graph (the guard host_sync_in_static_decode makes with bool())",
    "torch._assert_async, PyTorch's device-side assert: what graph-safe code uses where eager code writes "
    "`assert torch.isfinite(x).all()` (CUDA graphs and torch.compile keep it in the graph)",
    model_with(static=DeviceGuardStaticCache))


class CacheLengthSession(ReferenceSession):
    """The static path's decode steps pass cache_idx = the cache length as a Python int: the same
    value at every step of a generation."""

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.path == "static" and self.bucket is None and self.cache is not None:
            cache_idx = self.max_len
        return super()._forward(input_ids, mask, token_idx, cache_idx)


cache_length_as_python_int = layout_design(
    "cache_length_as_python_int",
    "the static path's decode steps hand the model cache_idx = the cache length as a Python int, the same at "
    "every step of a generation: a graph bakes it in once and no step recompiles",
    "optimum-habana passes cache_idx and kv_cache_len as Python ints, constant within a bucket (its bucketed "
    "generation compiles a new graph only when the bucket changes)",
    ReferenceMPT, CacheLengthSession)


# --- a constant the model builds on its first forward and keeps (issue 49: model state, not per-generation) ----

from torch import nn  # noqa: E402

from mpt_kv.model.reference import alibi_bias  # noqa: E402


class LazyAlibiMPT(ReferenceMPT):
    """ALiBi built on the first forward and kept on the model for every later call, as llm-foundry's
    MPTModel builds its attn_bias (`_attn_bias()`: built once when `_attn_bias_initialized` is False)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        del self._buffers["alibi"]  # not a buffer made with the weights: an attribute set by the first forward
        self.alibi = None

    def _apply(self, fn, recurse=True):
        nn.Module._apply(self, fn, recurse)  # not the reference's rebuild: the next forward builds it
        self.alibi = None
        return self

    def forward(self, input_ids, *args, **kwargs):
        if self.alibi is None:
            self.alibi = alibi_bias(self.cfg, input_ids.device)
        return super().forward(input_ids, *args, **kwargs)


alibi_built_on_first_forward = design(
    "alibi_built_on_first_forward",
    "the model builds its ALiBi bias on its first forward and keeps it on the model for every later call and "
    "generation: a constant made by the first (warm-up) generation, never rebuilt or changed",
    "llm-foundry's MPTModel (llmfoundry/models/mpt/modeling_mpt.py: `_attn_bias()` builds `self.attn_bias` once, "
    "`_attn_bias_initialized`), what the Hub's mosaicml/mpt-* run with trust_remote_code",
    LazyAlibiMPT)
