"""tinympt: a small MPT port in the style of optimum-habana's GaudiMptForCausalLM.

The forward takes optimum-habana's arguments (`past_key_values`, `use_cache`, `token_idx`) but,
like its releases before bucketing, no `cache_idx`, and it has no `clip_qkv`. Its cache is a
per-layer [key, value] list: the concat path (no token_idx) grows it with torch.cat; the static
path (token_idx, 1-based) preallocates it in a prompt padded to the cache length and writes each
step with index_copy_.

It also keeps a real bug, on purpose, as a project would while a fix is under review: the concat
path's prefill caches k and v as views of mixed_qkv (optimum-habana before its "refine use cache
for mpt" PR), pinning each layer's whole fused buffer. mpt-kv's P3 and memory checks catch it;
mpt_kv_known_failures.json records it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TinyMptConfig:
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    max_seq_len: int
    alibi_bias_max: int = 8
    layer_norm_epsilon: float = 1e-5


@dataclass
class Output:
    logits: torch.Tensor
    past_key_values: list | None = None


def alibi(cfg: TinyMptConfig) -> torch.Tensor:
    """(H, 1, max_seq_len) ALiBi bias, MPT's slopes (head counts that are not powers of two too)."""
    n = 2 ** math.ceil(math.log2(cfg.n_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1).float() * (cfg.alibi_bias_max / n))
    if n != cfg.n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[: cfg.n_heads]
    return slopes[:, None, None] * torch.arange(1 - cfg.max_seq_len, 1).float()


class Attention(nn.Module):
    def __init__(self, cfg: TinyMptConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.Wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, mask, bias, past, token_idx):
        B, T, D = x.shape
        mixed_qkv = self.Wqkv(x)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
        if past is None:          # prefill
            past = [k.clone(), v.clone()] if token_idx is not None else [k, v]  # the bug: views of mixed_qkv
        elif token_idx is not None:  # static decode: write slot token_idx - 1 in place
            past[0].index_copy_(2, token_idx - 1, k)
            past[1].index_copy_(2, token_idx - 1, v)
        else:                     # concat decode
            past = [torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)]
        k, v = past
        K = k.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + bias[:, :, -K:]
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        out = F.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D)), past


class Block(nn.Module):
    def __init__(self, cfg: TinyMptConfig):
        super().__init__()
        self.norm_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.attn = Attention(cfg)
        self.norm_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.ffn = nn.ModuleDict(dict(up_proj=nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
                                      down_proj=nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)))

    def forward(self, x, mask, bias, past, token_idx):
        a, past = self.attn(self.norm_1(x), mask, bias, past, token_idx)
        x = x + a
        return x + self.ffn.down_proj(F.gelu(self.ffn.up_proj(self.norm_2(x)))), past


class TinyMptForCausalLM(nn.Module):
    """Weights in transformers' MptForCausalLM layout; lm_head tied to the embedding."""

    def __init__(self, config: TinyMptConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.d_model),
            blocks=nn.ModuleList(Block(config) for _ in range(config.n_layers)),
            norm_f=nn.LayerNorm(config.d_model, eps=config.layer_norm_epsilon, bias=False),
        ))
        self.register_buffer("alibi", alibi(config), persistent=False)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        own = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}  # tied
        return super().load_state_dict(own, strict=strict, assign=assign)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=False, token_idx=None):
        B, T = input_ids.shape
        if past_key_values is None:
            start, K = 0, T
        elif token_idx is not None:
            start, K = token_idx.reshape(-1)[0] - 1, past_key_values[0][0].shape[2]
        else:
            start, K = past_key_values[0][0].shape[2], past_key_values[0][0].shape[2] + T
        if attention_mask is None:
            attention_mask = torch.ones(B, K, dtype=torch.long, device=input_ids.device)
        q_pos = start + torch.arange(T, device=input_ids.device)
        future = torch.arange(K, device=input_ids.device)[None, :] > q_pos[:, None]           # (T, K)
        mask = future[None, None] | ~attention_mask[:, None, None, :K].bool()              # (B, 1, T, K)
        x = self.transformer.wte(input_ids)
        presents = []
        for i, block in enumerate(self.transformer.blocks):
            x, past = block(x, mask, self.alibi, None if past_key_values is None else past_key_values[i], token_idx)
            presents.append(past)
        logits = self.transformer.norm_f(x) @ self.transformer.wte.weight.T
        return Output(logits, presents if use_cache else None)
