"""A worked example of a user target: your own fused-QKV attention, checked by mpt-kv.

Say you ship an MPT whose attention calls `F.scaled_dot_product_attention` with ALiBi and the
mask folded into one additive bias. To run the suite against it, write a factory
`build(cfg, state_dict, device, dtype) -> Runner` and name it:

    pytest --pyargs mpt_kv.conformance --target examples.sdpa_mpt:build --only-targets -m cpu

Here the model reuses the reference's blocks and caches and swaps the attention
(`ReferenceRunner` with a `model_class`). A model with optimum-habana's forward signature
returns `mpt_kv.GaudiStyleRunner(model, device)`, a transformers-style one
`mpt_kv.TransformersRunner(model, device)`; docs/targets.md has each, and how to write a
Runner from scratch.
"""

import math

import torch
import torch.nn.functional as F

from mpt_kv import ReferenceRunner
from mpt_kv.model import reference


class SdpaAttention(reference.Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        mixed_qkv = self.Wqkv(x)                                         # (B, T, 3D)
        if self.cfg.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(-self.cfg.clip_qkv, self.cfg.clip_qkv)
        q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(layer, k, v, token_idx, cache_idx)
        K = k.shape[2]
        # one additive bias: ALiBi (H, 1, K) plus -inf-like where masked (B, 1, T, K)
        attn_bias = bias[:, :, -K:].to(q.dtype) + torch.zeros_like(mask[:, :, :, :K], dtype=q.dtype).masked_fill(
            mask[:, :, :, :K], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=1 / math.sqrt(hd))
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class SdpaBlock(reference.Block):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.attn = SdpaAttention(cfg)


class SdpaMPT(reference.ReferenceMPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.transformer.blocks = torch.nn.ModuleList(SdpaBlock(cfg) for _ in range(cfg.n_layers))


class SdpaRunner(ReferenceRunner):
    name = "sdpa-example"
    model_class = SdpaMPT


def build(cfg, state_dict, device, dtype):
    from mpt_kv.devices import sync

    return SdpaRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))
