"""ownmpt: a small in-house MPT with its own forward signature and its own caches.

    model(input_ids, past=None, position=None, attention_mask=None) -> (logits, past)

- `past=None`: an uncached full forward (returns `(logits, None)`);
- `past` a `ConcatCache`: the keys are the cached ones plus these tokens (`torch.cat`);
- `past` a `StaticCache`: (B, H, max_len, hd) buffers preallocated with zeros, these tokens
  written at slots `position + arange(T)` with `index_copy_`, every call attending over the
  whole buffer under `attention_mask` (B, max_len).

`position` is a (1,) int64 tensor: the 0-based slot of the first token fed. Weights load from
transformers' MptForCausalLM state-dict layout (lm_head tied to the embedding).

A seed bug can be planted for the demonstration (OWNMPT_KV_VIEWS=1 when the model is built):
the concat cache then keeps the prefill's K/V as views of the fused Wqkv output, pinning each
layer's whole (B, S, 3D) buffer; mpt-kv's P3 and memory checks name it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class OwnMptConfig:
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    max_seq_len: int
    alibi_bias_max: int = 8
    layer_norm_epsilon: float = 1e-5
    clip_qkv: float | None = None


class ConcatCache:
    """Per layer (key, value) (B, H, L, hd), grown with torch.cat."""

    def __init__(self, n_layers: int, views: bool = False):
        self.layers: list = [None] * n_layers
        self.views = views  # the planted bug: keep the prefill's K/V as views of mixed_qkv

    def length(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0][0].shape[2]

    def update(self, i, k, v, position):
        if self.layers[i] is None:
            self.layers[i] = (k, v) if self.views else (k.clone(), v.clone())
        else:
            self.layers[i] = (torch.cat([self.layers[i][0], k], 2), torch.cat([self.layers[i][1], v], 2))
        return self.layers[i]

    def kv(self):
        return self.layers

    # one layer at a time, each old pair dropped as its new one lands: never a second whole cache
    def crop(self, n: int):
        for i, (k, v) in enumerate(self.layers):
            self.layers[i] = (k[:, :, :n].clone(), v[:, :, :n].clone())
        return self

    def reorder(self, index):
        for i, (k, v) in enumerate(self.layers):
            self.layers[i] = (k.index_select(0, index), v.index_select(0, index))
        return self


class StaticCache:
    """Per layer (key, value) (B, H, max_len, hd), written in place: storage and shapes never change."""

    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, dtype, device):
        # zeros, not torch.empty: a masked slot still meets the second matmul as 0 * v
        self.layers = [tuple(torch.zeros(batch, n_heads, max_len, head_dim, dtype=dtype, device=device)
                             for _ in range(2)) for _ in range(n_layers)]

    def update(self, i, k, v, position):
        slots = position + torch.arange(k.shape[2], device=k.device)
        self.layers[i][0].index_copy_(2, slots, k)
        self.layers[i][1].index_copy_(2, slots, v)
        return self.layers[i]

    def kv(self):
        return self.layers

    def crop(self, n: int):
        return self  # the caller's mask switches slots n.. off and the next position rewrites them

    def reorder(self, index):
        for k, v in self.layers:
            k.copy_(k.index_select(0, index))
            v.copy_(v.index_select(0, index))
        return self


def alibi(cfg: OwnMptConfig) -> torch.Tensor:
    """(H, 1, max_seq_len) ALiBi bias, MPT's slopes (head counts that are not powers of two too)."""
    n = 2 ** math.ceil(math.log2(cfg.n_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1).float() * (cfg.alibi_bias_max / n))
    if n != cfg.n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[: cfg.n_heads]
    return slopes[:, None, None] * torch.arange(1 - cfg.max_seq_len, 1).float()


class Attention(nn.Module):
    def __init__(self, cfg: OwnMptConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.clip_qkv = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.clip_qkv
        self.Wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, mask, bias, past, i, position):
        B, T, D = x.shape
        mixed_qkv = self.Wqkv(x)
        if self.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        if past is not None:
            k, v = past.update(i, k, v, position)
        K = k.shape[2]
        # scores in float32 from the ALiBi bias on, as MPT: a bf16 bias rounds away its large values
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(self.head_dim) + bias[:, :, -K:]
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        out = F.softmax(scores, dim=-1).to(v.dtype) @ v
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, cfg: OwnMptConfig):
        super().__init__()
        self.norm_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.attn = Attention(cfg)
        self.norm_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.ffn = nn.ModuleDict(dict(up_proj=nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
                                      down_proj=nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)))

    def forward(self, x, mask, bias, past, i, position):
        x = x + self.attn(self.norm_1(x), mask, bias, past, i, position)
        return x + self.ffn.down_proj(F.gelu(self.ffn.up_proj(self.norm_2(x))))


class OwnMptForCausalLM(nn.Module):
    def __init__(self, config: OwnMptConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.d_model),
            blocks=nn.ModuleList(Block(config) for _ in range(config.n_layers)),
            norm_f=nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False),
        ))
        self.register_buffer("alibi", alibi(config), persistent=False)
        self.kv_views = os.environ.get("OWNMPT_KV_VIEWS") == "1"

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` leaves the ALiBi bias in float32 (see Attention.forward)."""
        super()._apply(fn, recurse)
        self.alibi = alibi(self.config).to(self.alibi.device)
        return self

    def load_state_dict(self, state_dict, strict=True, assign=False):
        own = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}  # tied
        return super().load_state_dict(own, strict=strict, assign=assign)

    def new_cache(self, path: str, batch: int, max_len: int):
        if path == "concat":
            return ConcatCache(self.config.n_layers, views=self.kv_views)
        w, cfg = self.transformer.wte.weight, self.config
        return StaticCache(cfg.n_layers, batch, cfg.n_heads, max_len, cfg.d_model // cfg.n_heads, w.dtype, w.device)

    def forward(self, input_ids, past=None, position=None, attention_mask=None):
        B, T = input_ids.shape
        device = input_ids.device
        if position is None:
            position = torch.zeros(1, dtype=torch.long, device=device)
        if isinstance(past, StaticCache):
            K = past.layers[0][0].shape[2]
        else:
            K = T + (past.length() if isinstance(past, ConcatCache) else 0)
        if attention_mask is None:
            attention_mask = torch.ones(B, K, dtype=torch.long, device=device)
        q_pos = position + torch.arange(T, device=device)                                   # (T,), a tensor
        future = torch.arange(K, device=device)[None, :] > q_pos[:, None]                   # (T, K)
        mask = future[None, None] | ~attention_mask[:, None, None, :K].bool()              # (B, 1, T, K)
        x = self.transformer.wte(input_ids)
        for i, block in enumerate(self.transformer.blocks):
            x = block(x, mask, self.alibi, past, i, position)
        return self.transformer.norm_f(x) @ self.transformer.wte.weight.T, past
