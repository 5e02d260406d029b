"""A user target whose concat cache grows by blocks, written from docs/targets.md ("Cache layouts").

Each layer's key and value live in (B, H, capacity, hd) buffers that grow 8 positions at a time:
one allocation per block instead of a `torch.cat` per token. `kv()` hands out views of the
buffers, which hold up to a block more than the cached positions; the session declares it with
`cache_layout()` -> `mpt_kv.BlockGrowth(8)`, so P3 and the memory checks count that slack as the
cache's own (and only that much):

    pytest --pyargs mpt_kv.conformance --target examples.block_mpt:build --only-targets -m cpu
"""

import torch

from mpt_kv import BlockGrowth, ReferenceRunner
from mpt_kv.model import cache, reference
from mpt_kv.targets.reference import ReferenceSession

BLOCK = 8


class BlockCache(cache.ConcatCache):
    """The concat cache's protocol (`update` returns the keys and values to attend over), grown by blocks."""

    def __init__(self, n_layers):
        super().__init__(n_layers)
        self.buffers = [None] * n_layers  # per layer (key buffer, value buffer)

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        held, n = self.length(layer), k.shape[2]
        if self.buffers[layer] is None or self.buffers[layer][0].shape[2] < held + n:
            capacity = -(-(held + n) // BLOCK) * BLOCK
            grown = [torch.zeros(*t.shape[:2], capacity, t.shape[3], dtype=t.dtype, device=t.device) for t in (k, v)]
            if held:
                grown[0][:, :, :held], grown[1][:, :, :held] = self.kv[layer]
            self.kv[layer] = None  # the old block buffer is freed now, not after the step
            self.buffers[layer] = grown
        keys, values = self.buffers[layer]
        keys[:, :, held:held + n], values[:, :, held:held + n] = k, v  # copies: never views of mixed_qkv
        self.kv[layer] = (keys[:, :, :held + n], values[:, :, :held + n])
        return self.kv[layer]

    def crop(self, n):
        """Keep positions [0, n) in new buffers of n rounded up to a block (copies; the old buffer would
        pin the cropped tail, more than the one block declared), one layer at a time."""
        capacity = -(-n // BLOCK) * BLOCK
        for layer, pair in enumerate(self.kv):
            if pair is None:
                continue
            self.kv[layer] = self.buffers[layer] = None
            grown = [torch.zeros(*t.shape[:2], capacity, t.shape[3], dtype=t.dtype, device=t.device) for t in pair]
            grown[0][:, :, :n], grown[1][:, :, :n] = pair[0][:, :, :n], pair[1][:, :, :n]
            del pair
            self.buffers[layer] = grown
            self.kv[layer] = (grown[0][:, :, :n], grown[1][:, :, :n])

    def reorder(self, index):
        """Rows from `index` in place, one tensor at a time: the buffers (and kv()'s views) stay put."""
        for keys, values in (pair for pair in self.kv if pair is not None):
            keys.copy_(keys.index_select(0, index))  # the gathered copy is read whole before a row is written
            values.copy_(values.index_select(0, index))


class BlockMPT(reference.ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        return BlockCache(self.cfg.n_layers) if path == "concat" else super().new_cache(path, batch, max_len, fill)


class BlockSession(ReferenceSession):
    def cache_layout(self):
        return BlockGrowth(BLOCK) if self.path == "concat" else None  # the static path is the reference's


class BlockRunner(ReferenceRunner):
    name = "block-example"
    model_class = BlockMPT

    def session(self, path, max_len, bucket=None):
        return BlockSession(self.model, path, max_len, bucket, self.sync)


def build(cfg, state_dict, device, dtype):
    from mpt_kv.devices import sync

    return BlockRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))
