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
from mpt_kv.model import cache, reference
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
    """One generation's blocks: the reference's cache protocol (`update` at prefill returns the
    prompt's own k, v to attend over) plus a decode step that reads the pool in place."""

    def setup(self, pool, n_layers, batch, max_len, device):
        self.pool, self.max_len = pool, max_len
        self.table = torch.full((batch, -(-max_len // BLOCK)), -1, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.held: list[int] = []
        self.n_blocks, self.filled = 0, 0
        self.kv = [None] * n_layers  # no contiguous K/V (the reference's input checks read this)
        self.prefilled = [False] * n_layers
        weakref.finalize(self, pool.free.extend, self.held)  # the blocks go back with the cache

    def length(self, layer=0):
        return self.filled

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
        T = k.shape[2]
        for j in range(-(-T // BLOCK)):  # the prompt, block by block
            n = min(BLOCK, T - j * BLOCK)
            keys[self.table[:, j], :, :n] = k[:, :, j * BLOCK:j * BLOCK + n]
            values[self.table[:, j], :, :n] = v[:, :, j * BLOCK:j * BLOCK + n]
        self.prefilled[layer] = True
        return k, v

    def decode(self, layer, q, k, v, token_idx, bias, mask):
        keys, values = self.pool.kv[layer]
        if token_idx is not None:  # static: the position stays a tensor, the same ops every step
            pos = token_idx.reshape(1) - 1
            block = self.table.gather(1, (pos // BLOCK).expand(self.table.shape[0], 1)).squeeze(1)
            slot = pos % BLOCK
        else:
            block, slot = self.table[:, self.filled // BLOCK], self.filled % BLOCK
        keys[block, :, slot] = k[:, :, 0]
        values[block, :, slot] = v[:, :, 0]
        K = mask.shape[-1]
        blocks = [self.table[:, j].clamp(min=0) for j in range(-(-K // BLOCK))]  # -1: no block yet (masked)
        scores = torch.cat([q @ keys[b].transpose(-1, -2) for b in blocks], dim=-1)[..., :K] / math.sqrt(q.shape[-1])
        scores = (scores + bias[:, :, -K:]).masked_fill(mask, torch.finfo(q.dtype).min)
        weights = F.softmax(scores.float(), dim=-1)
        del scores
        # each block's share in the model dtype (as one matmul would compute it), summed in fp32
        out = sum((weights[..., j * BLOCK:(j + 1) * BLOCK].to(v.dtype) @ values[b][:, :, :min(BLOCK, K - j * BLOCK)])
                  .float() for j, b in enumerate(blocks))
        return out.to(q.dtype)


class PagedConcat(PagedBlocks, cache.ConcatCache):
    pass


class PagedStatic(PagedBlocks, cache.StaticCache):
    pass


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
        out = cache.decode(layer, q, k, v, token_idx, bias, mask)
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
        paged = PagedConcat.__new__(PagedConcat) if path == "concat" else PagedStatic.__new__(PagedStatic)
        paged.setup(self.pool, self.cfg.n_layers, batch, max_len, self.transformer.wte.weight.device)
        return paged


def gathered(pool, table, T):
    blocks = pool[table.clamp(min=0)]  # (B, max_blocks, H, BLOCK, hd)
    B, nb, H, _, hd = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * BLOCK, hd)[:, :, :T]


class PagedSession(ReferenceSession):
    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.cache is None:
            self.cache = self.model.new_cache(self.path, input_ids.shape[0], self.max_len)
            cache_idx = None  # the prefill attends over its own tokens
            writes = input_ids.shape[1]  # the static prefill writes the prompt padded to max_len
            holds = int(token_idx.reshape(-1)[0]) if token_idx is not None else writes
        else:
            writes = holds = self.written + 1
        self.cache.reserve(writes)
        logits = self.model(input_ids, mask, self.cache, token_idx, cache_idx)
        self.cache.filled = max(self.cache.filled, writes)
        self.cache.lengths.fill_(holds)
        return logits

    def kv(self):  # gathered copies, for the value checks
        c = self.cache
        T = c.max_len if isinstance(c, PagedStatic) else c.filled
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
