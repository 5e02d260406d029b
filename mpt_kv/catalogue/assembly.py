"""How the catalogues are assembled: the reference with one piece swapped.

Both catalogues (designs.py: must pass, variants.py: must be killed) are the reference with ONE
change, written as a few-line override of one piece: an `Attention` subclass, a cache class, the
session, or the model. Every entry is also a target factory, so the whole pytest suite can run
against it (`pytest --target mpt_kv.catalogue.variants:NAME --only-targets`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.reference import Attention, ReferenceMPT
from mpt_kv.targets import Capabilities
from mpt_kv.targets.reference import ReferenceRunner, ReferenceSession
from mpt_kv.devices import sync


def model_with(attention=Attention, concat=ConcatCache, static=StaticCache, base=ReferenceMPT):
    """A model (`base`, the reference by default) whose attention modules and caches are the given
    subclasses (same constructor and parameters, so the weights load unchanged)."""

    class Model(base):
        def __init__(self, cfg):
            super().__init__(cfg)
            for block in self.transformer.blocks:
                block.attn.__class__ = attention

        def new_cache(self, path, batch, max_len=None, fill=None):
            cache = super().new_cache(path, batch, max_len, fill)
            if type(cache) in (ConcatCache, StaticCache):  # leave a base model's own cache classes alone
                cache.__class__ = concat if path == "concat" else static
            return cache

    return Model


def runner_factory(name, model_class=ReferenceMPT, session_class=ReferenceSession,
                   capabilities: Capabilities = Capabilities(), module: str | None = None):
    """A target factory `build(cfg, state_dict, device, dtype) -> Runner` for the assembled model;
    `module`: the module that keeps it as its attribute `name`, so the target is named by the spec
    that loads it (`mpt_kv.catalogue.variants:static_cache_not_written`, what a rerun command needs)."""

    class AssembledRunner(ReferenceRunner):
        def session(self, path, max_len, bucket=None):
            return session_class(self.model, path, max_len, bucket, self.sync)

    AssembledRunner.name, AssembledRunner.model_class = name, model_class
    AssembledRunner.capabilities = capabilities

    def build(cfg, state_dict, device, dtype):
        return AssembledRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))

    build.__name__ = name
    if module:
        build.__module__ = module
    return build


def attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, *, clamp=True, bias_len=None,
                      bias_from_front=False, drop_mask=False, additive_mask=False, softmax_dtype=None,
                      window=None, sdpa_without_alibi=False):
    """`Attention.forward` of the reference with the knobs the catalogues turn. With no knob turned
    it computes exactly what the reference does (`variants.no_change` shows it)."""
    B, T, D = x.shape
    H, hd = self.cfg.n_heads, self.cfg.head_dim
    mixed_qkv = self.Wqkv(x)
    if self.cfg.clip_qkv and clamp:
        mixed_qkv = mixed_qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
    q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(layer, k, v, token_idx, cache_idx)
    K = k.shape[2]
    mask = mask[:, :, :, :K]
    if drop_mask:
        mask = torch.zeros_like(mask)
    if window is not None and T == 1:  # decode: keys more than `window` positions behind the query are dropped
        query = token_idx.reshape(-1)[0] - 1 if token_idx is not None else K - 1
        mask = mask | (torch.arange(K, device=x.device) <= query - window)
    if sdpa_without_alibi:  # the fused kernel: softmax(q k^T / sqrt(hd)) v under the mask, no bias input
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    bias_len = bias_len or K
    scores = scores + (bias[:, :, :bias_len] if bias_from_front else bias[:, :, -bias_len:])
    softmax_dtype = softmax_dtype or torch.float32
    if additive_mask:
        scores = scores + mask.to(scores.dtype) * -1e4
    else:  # the fill must survive the cast to softmax_dtype (fp32's min is -inf in bf16)
        scores = scores.masked_fill(mask, max(torch.finfo(q.dtype).min, torch.finfo(softmax_dtype).min))
    weights = F.softmax(scores.to(softmax_dtype), dim=-1).to(v.dtype)
    return self.out_proj((weights @ v).transpose(1, 2).reshape(B, T, D))


def attention_with(**knobs):
    """An `Attention` subclass whose forward is `attention_forward` with these knobs turned."""

    class Turned(Attention):
        def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
            return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, **knobs)

    return Turned


class StaticDecode(StaticCache):
    """StaticCache whose decode step is `_decode(ck, cv, k, v, token_idx) -> (ck, cv)`."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if not self.prefilled[layer]:
            return super().update(layer, k, v, token_idx, cache_idx)
        ck, cv = self.kv[layer] = self._decode(*self.kv[layer], k, v, token_idx)
        if cache_idx is not None:
            return ck[:, :, :cache_idx], cv[:, :, :cache_idx]
        return ck, cv


class StaticAt(StaticDecode):
    """StaticCache whose decode step writes the slot `_slot(token_idx)` (the reference: token_idx - 1)."""

    def _slot(self, token_idx):
        return token_idx - 1

    def _decode(self, ck, cv, k, v, token_idx):
        slot = self._slot(token_idx)
        return ck.index_copy_(2, slot, k), cv.index_copy_(2, slot, v)


class StaticOutputMPT(ReferenceMPT):
    """Returns its logits in one preallocated buffer per shape, which the next call of that shape
    overwrites: what a replayed CUDA graph or HPU graph returns (the graph's static output)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.outputs: dict[tuple, torch.Tensor] = {}

    def forward(self, *args, **kwargs):
        logits = super().forward(*args, **kwargs)
        key = (tuple(logits.shape), logits.dtype, logits.device)
        if key not in self.outputs:
            self.outputs[key] = torch.empty_like(logits)
        return self.outputs[key].copy_(logits)
