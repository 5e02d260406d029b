"""A user target with a paged KV cache, written from docs/targets.md ("Cache layouts").

As vLLM serves MPT: per layer a key pool and a value pool of blocks, (num_blocks, H, 8, hd),
made once on the model and shared by every generation that runs on it; each generation has a
block table (B, max_blocks) naming the pool block that holds each row's positions
[8j, 8j + 8), and gives its blocks back when its cache is freed. Decode attention reads the
blocks in place, one at a time, as a paged attention kernel does. The session declares the
layout with `cache_layout()` -> `mpt_kv.PagedLayout(...)`, so P2 poisons the pool's
never-written slots, P3 and static-shape watch the pools, and memory counts the handed-out
blocks; the pool outlives a generation, which it declares: `Capabilities(cache_pool=True)`.

    pytest --pyargs mpt_kv.conformance --target examples.paged_mpt:build --only-targets -m cpu
"""

import math
import weakref

import torch
import torch.nn.functional as F

from mpt_kv import Capabilities, PagedLayout, ReferenceRunner
from mpt_kv.model import reference
from mpt_kv.targets.reference import ReferenceSession

BLOCK = 8


class Pool:
    def __init__(self, cfg, num_blocks, dtype, device):
        shape = (num_blocks, cfg.n_heads, BLOCK, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(cfg.n_layers)]
        self.free = list(range(num_blocks))

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(f"block pool exhausted ({self.kv[0][0].shape[0]} blocks)")
        return self.free.pop(0)


class PagedBlocks:
    """One generation's blocks, a cache object of its own (docs/targets.md, "Building one from the
    reference's pieces"): `update` writes the new positions into their blocks and returns the
    prefill's own k, v to attend over; a cached call (a decode step, an extend of k tokens) reads
    the pool in place (`attend`). `crop` gives whole blocks back, `reorder` permutes the table."""

    def setup(self, pool, n_layers, batch, max_len, static, device):
        self.pool, self.max_len, self.static = pool, max_len, static
        self.table = torch.full((batch, -(-max_len // BLOCK)), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.held: list[int] = []
        self.n_blocks, self.filled = 0, 0
        self.prefilled = [False] * n_layers
        weakref.finalize(self, pool.free.extend, self.held)  # the blocks go back with the cache

    def reserve(self, positions: int):
        """Blocks for positions [0, positions) in every row, handed out before the forward."""
        for j in range(self.n_blocks, -(-positions // BLOCK)):
            for b in range(self.table.shape[0]):
                block = self.pool.take()
                self.held.append(block)
                self.table[b, j] = block
            self.n_blocks = j + 1

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        keys, values = self.pool.kv[layer]
        if not self.prefilled[layer]:
            start = 0  # the prompt, from slot 0
        elif self.static:  # the position stays a tensor: the same ops every step
            start = token_idx.reshape(1).to(self.table.device) - 1
        else:
            start = self.filled
        positions = start + torch.arange(k.shape[2], device=self.table.device)
        blocks, slots = self.table[:, positions // BLOCK], positions % BLOCK  # (B, T), (T,)
        keys[blocks, :, slots] = k.transpose(1, 2)  # (B, T, H, hd)
        values[blocks, :, slots] = v.transpose(1, 2)
        self.prefilled[layer] = True
        return k, v

    def attend(self, layer, q, bias, mask):
        keys, values = self.pool.kv[layer]
        K = mask.shape[-1]
        blocks = [self.table[:, j].clamp(min=0) for j in range(-(-K // BLOCK))]  # -1: no block (masked)
        scores = torch.cat([q @ keys[b].transpose(-1, -2) for b in blocks], dim=-1)[..., :K] / math.sqrt(q.shape[-1])
        scores = (scores + bias[:, :, -K:]).masked_fill(mask, torch.finfo(q.dtype).min)
        weights = F.softmax(scores.float(), dim=-1)
        del scores
        # each block's share in the model dtype (as one matmul would compute it), summed in fp32
        out = sum((weights[..., j * BLOCK:(j + 1) * BLOCK].to(values.dtype) @ values[b][:, :, :min(BLOCK, K - j * BLOCK)])
                  .float() for j, b in enumerate(blocks))
        return out.to(q.dtype)

    def crop(self, n: int):
        """Keep positions [0, n): the blocks past them go back to the pool (the session masks again)."""
        keep = -(-n // BLOCK)
        self.give_back([b for b in self.table[:, keep:].flatten().tolist() if b >= 0])
        self.table[:, keep:] = -1
        self.n_blocks, self.filled = min(self.n_blocks, keep), n
        self.lengths.fill_(n)

    def reorder(self, index: torch.Tensor):
        """Row b takes row index[b]'s blocks (a permutation of the table, no K/V moved); a row taken
        twice gets copies in fresh blocks (a block is never in two places), after the blocks of the
        rows no one takes went back."""
        old, sources = self.table.clone(), index.tolist()
        self.give_back([b for r in range(len(sources)) if r not in sources for b in old[r].tolist() if b >= 0])
        for row, src in enumerate(sources):
            self.table[row] = old[src]
            if src in sources[:row]:
                for j, block in enumerate(old[src].tolist()):
                    if block >= 0:
                        fresh = self.pool.take()
                        self.held.append(fresh)
                        self.table[row, j] = fresh
                        for keys, values in self.pool.kv:  # one block of one layer at a time
                            keys[fresh], values[fresh] = keys[block], values[block]

    def give_back(self, blocks):
        for block in blocks:
            self.held.remove(block)  # in place: the finalizer gives back what the list holds then
        self.pool.free.extend(blocks)


class PagedAttention(reference.Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        if not isinstance(cache, PagedBlocks) or not cache.prefilled[layer]:
            return super().forward(x, mask, bias, cache, layer, token_idx, cache_idx)  # uncached, or the prefill
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        mixed_qkv = self.Wqkv(x)
        if self.cfg.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(-self.cfg.clip_qkv, self.cfg.clip_qkv)
        q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        cache.update(layer, k, v, token_idx, cache_idx)
        out = cache.attend(layer, q, bias, mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class PagedMPT(reference.ReferenceMPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.transformer.blocks:
            block.attn.__class__ = PagedAttention
        self.pool = None

    def new_cache(self, path, batch, max_len=None, fill=None):
        max_len = max_len or self.cfg.max_seq_len
        need = 2 * batch * -(-max_len // BLOCK)  # two generations side by side (P2 runs concat and static)
        if self.pool is None or (len(self.pool.free) == self.pool.kv[0][0].shape[0] < need):
            w = self.transformer.wte.weight  # grown only while no generation holds a block
            self.pool = Pool(self.cfg, need, w.dtype, w.device)
        paged = PagedBlocks()
        paged.setup(self.pool, self.cfg.n_layers, batch, max_len, path == "static", self.transformer.wte.weight.device)
        return paged

    def _positions(self, T, cache, token_idx, cache_idx):
        if not isinstance(cache, PagedBlocks):
            return super()._positions(T, cache, token_idx, cache_idx)
        if cache.static and cache.prefilled[0]:  # as the reference's StaticCache: from token_idx, over the buffer
            start = token_idx.reshape(-1)[0] - 1
            return start, int(cache_idx) if cache_idx is not None else cache.max_len
        return cache.filled, cache.filled + T


def gathered(pool, table, T):
    blocks = pool[table.clamp(min=0)]  # (B, max_blocks, H, BLOCK, hd)
    B, nb, H, _, hd = blocks.shape
    # a copy of exactly T positions (a slice would keep the last block's unwritten slots with it)
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * BLOCK, hd)[:, :, :T].clone()


class PagedSession(ReferenceSession):
    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.cache is None:
            self.cache = self.model.new_cache(self.path, input_ids.shape[0], self.max_len)
            cache_idx = None  # the prefill attends over its own tokens
            writes = input_ids.shape[1]  # the static prefill writes the prompt padded to max_len
            holds = int(token_idx.reshape(-1)[0]) if token_idx is not None else writes
        else:
            writes = holds = self.written + input_ids.shape[1]  # a decode step, or an extend of k tokens
        self.cache.reserve(writes)
        logits = self.model(input_ids, mask, self.cache, token_idx, cache_idx)
        self.cache.filled = max(self.cache.filled, writes)
        self.cache.lengths.fill_(holds)
        return logits

    def kv(self):  # gathered copies, for the value checks
        c = self.cache
        T = c.max_len if c.static else c.filled
        return [(gathered(k, c.table, T), gathered(v, c.table, T)) for k, v in c.pool.kv]

    def cache_layout(self):
        c = self.cache
        return PagedLayout(pools=c.pool.kv, block_table=c.table, block_size=BLOCK, lengths=c.lengths)


class PagedRunner(ReferenceRunner):
    name = "paged-example"
    model_class = PagedMPT
    capabilities = Capabilities(cache_pool=True)  # the pool is the model's, kept across generations

    def session(self, path, max_len, bucket=None):
        return PagedSession(self.model, path, max_len, bucket, self.sync)


def build(cfg, state_dict, device, dtype):
    from mpt_kv.devices import sync

    return PagedRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))
