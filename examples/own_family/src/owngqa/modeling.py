"""owngqa: a small in-house decoder with grouped-query attention and a sliding window on every layer
(Mistral's architecture: RMSNorm, rotary positions, a SiLU-gated MLP), with its own forward signature
and its own caches.

    model(input_ids, cache=None, position=None, attention_mask=None) -> (logits, cache)

- `cache=None`: an uncached full forward (returns `(logits, None)`);
- `cache` a `WindowCache` (concat): each layer keeps the latest `window - 1` positions it needs, the
  older ones dropped by a copy at each call (never a slice of a bigger buffer, which would keep it);
- `cache` a `RingCache` (static): each layer's (B, KV heads, S, hd) buffers of S = min(max_len, window)
  slots, preallocated, written in place at `position % S` with `index_copy_`.

Each call attends over what the cache holds before it plus the tokens fed, then writes them: a prompt
longer than the window needs nothing else. `position` is a (1,) int64 tensor, the 0-based slot of the
first token fed; `attention_mask` (B, positions so far) on concat, (B, max_len) on static. Weights load
from transformers' MistralForCausalLM state-dict layout.

Assisted decoding crops back after a k-token call: both caches keep what that call evicted until the
next call, and a crop restores it. A seed bug can be planted for the demonstration
(OWNGQA_WINDOW_SLICE=1 when the model is built): the concat cache then keeps each window as a slice of
the concatenation, pinning the positions it evicted, as transformers 5.24's DynamicSlidingWindowLayer
does; mpt-kv's family-P3 and family-memory checks name it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class OwnGqaConfig:
    vocab_size: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int
    intermediate_size: int
    window: int | None  # None: global attention
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_positions: int = 4096


class WindowCache:
    """concat: per layer (key, value) (B, KV heads, L, hd) of the latest positions a next query needs."""

    def __init__(self, n_layers: int, window: int | None, slice_bug: bool = False):
        self.layers: list = [None] * n_layers
        self.window, self.slice_bug = window, slice_bug
        self.end = 0          # positions written
        self.evicted = None   # what the last k-token call dropped, per layer: a crop restores it

    def held(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(key, value, their positions) of layer i, None before the prefill."""
        if self.layers[i] is None:
            return None
        k, v = self.layers[i]
        return k, v, torch.arange(self.end - k.shape[2], self.end, device=k.device)

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        """Append this call's K/V, then keep `window - 1` positions (a k-token call: also what it dropped)."""
        old = self.layers[i]
        k_all = k if old is None else torch.cat([old[0], k], 2)
        v_all = v if old is None else torch.cat([old[1], v], 2)
        keep = k_all.shape[2] if self.window is None else min(k_all.shape[2], self.window - 1)
        drop = k_all.shape[2] - keep
        if i == 0:
            self.evicted = [None] * len(self.layers) if position > 0 and k.shape[2] > 1 else None
        if self.evicted is not None and drop:
            self.evicted[i] = (k_all[:, :, :drop].clone(), v_all[:, :, :drop].clone())
        if self.slice_bug or not drop:
            self.layers[i] = (k_all[:, :, drop:], v_all[:, :, drop:])  # the bug: a slice keeps the whole buffer
        else:
            self.layers[i] = (k_all[:, :, drop:].clone(), v_all[:, :, drop:].clone())

    def advance(self, n: int) -> None:
        self.end += n

    def kv(self):
        return self.layers

    def crop(self, n: int):
        """Keep positions [0, n): what was dropped by the last k-token call comes back first."""
        for i, (k, v) in enumerate(self.layers):
            if self.evicted is not None and self.evicted[i] is not None:
                k, v = torch.cat([self.evicted[i][0], k], 2), torch.cat([self.evicted[i][1], v], 2)
            start = self.end - k.shape[2]  # the position of k's first slot
            need = 0 if self.window is None else max(0, n - (self.window - 1))
            if need < start:
                raise ValueError(f"crop to {n}: the cache holds positions from {start}, the window needs {need}")
            self.layers[i] = (k[:, :, need - start:n - start].clone(), v[:, :, need - start:n - start].clone())
        self.end, self.evicted = n, None
        return self

    def reorder(self, index):
        for i, (k, v) in enumerate(self.layers):
            self.layers[i] = (k.index_select(0, index), v.index_select(0, index))
        return self


class RingCache:
    """static: per layer (key, value) (B, KV heads, S, hd) written in place; slot s holds position
    `positions[s]` (-1: none yet). Storage and shapes never change."""

    def __init__(self, n_layers, batch, n_kv_heads, slots, head_dim, dtype, device):
        self.layers = [tuple(torch.zeros(batch, n_kv_heads, slots, head_dim, dtype=dtype, device=device)
                             for _ in range(2)) for _ in range(n_layers)]
        self.positions = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.end, self.saved = 0, None  # saved: the slots the last k-token call overwrote (a crop restores them)

    def held(self, i: int):
        k, v = self.layers[i]
        return k, v, self.positions

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        slots = self.layers[i][0].shape[2]
        t = min(k.shape[2], slots)  # a prompt longer than the ring: its last `slots` positions
        where = torch.arange(position + k.shape[2] - t, position + k.shape[2], device=k.device) % slots
        if i == 0:
            self.saved = ([], where, self.positions[where].clone()) if position > 0 and k.shape[2] > 1 else None
        if self.saved is not None:
            self.saved[0].append((self.layers[i][0][:, :, where].clone(), self.layers[i][1][:, :, where].clone()))
        self.layers[i][0].index_copy_(2, where, k[:, :, -t:])
        self.layers[i][1].index_copy_(2, where, v[:, :, -t:])

    def advance(self, n: int) -> None:
        slots = self.positions.shape[0]
        written = torch.arange(max(self.end, self.end + n - slots), self.end + n, device=self.positions.device)
        self.positions[written % slots] = written
        self.end += n

    def kv(self):
        return self.layers

    def crop(self, n: int):
        """Keep positions [0, n): slots written past n get back what the last k-token call overwrote."""
        gone = self.positions >= n
        if bool(gone.any()):
            if self.saved is None:
                raise ValueError(f"crop to {n}: only the positions of the last k-token call can be taken back")
            old, where, positions = self.saved
            back = gone[where]
            for (k, v), (k_old, v_old) in zip(self.layers, old):
                k[:, :, where[back]] = k_old[:, :, back]
                v[:, :, where[back]] = v_old[:, :, back]
            self.positions[where[back]] = positions[back]
        self.end, self.saved = n, None
        return self

    def reorder(self, index):
        for k, v in self.layers:
            k.copy_(k.index_select(0, index))
            v.copy_(v.index_select(0, index))
        return self


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: OwnGqaConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, q_pos, mask, cache, i):
        cfg, (B, T, _) = self.cfg, x.shape
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys, values, k_pos = k, v, q_pos
        held = cache.held(i) if cache is not None else None
        if held is not None:  # what the cache holds before this call, then these tokens
            keys, values, k_pos = torch.cat([held[0], k], 2), torch.cat([held[1], v], 2), torch.cat([held[2], q_pos])
        if cache is not None:
            cache.write(i, k, v, int(q_pos[0]))
        # a query attends the keys at positions (q - window, q], written (position >= 0), not padding
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
        if cfg.window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - cfg.window
        allowed = allowed[None, None] & mask[:, None, None, k_pos.clamp(min=0)].bool()  # (B, 1, T, K)
        rep = cfg.n_heads // cfg.n_kv_heads
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = (q @ keys.transpose(-1, -2)) * cfg.head_dim ** -0.5
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = F.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype) @ values
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: OwnGqaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: OwnGqaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, q_pos, mask, cache, i):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, q_pos, mask, cache, i)
        return x + self.mlp(self.post_attention_layernorm(x))


class OwnGqaForCausalLM(nn.Module):
    def __init__(self, config: OwnGqaConfig):
        super().__init__()
        self.config = config
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(config.vocab_size, config.hidden_size),
            layers=nn.ModuleList(Layer(config) for _ in range(config.n_layers)),
            norm=RMSNorm(config.hidden_size, config.rms_norm_eps),
        ))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.slice_bug = os.environ.get("OWNGQA_WINDOW_SLICE") == "1"

    def new_cache(self, path: str, batch: int, max_len: int):
        cfg, w = self.config, self.lm_head.weight
        if path == "concat":
            return WindowCache(cfg.n_layers, cfg.window, self.slice_bug)
        slots = max_len if cfg.window is None else min(max_len, cfg.window)
        return RingCache(cfg.n_layers, batch, cfg.n_kv_heads, slots, cfg.head_dim, w.dtype, w.device)

    def rotary(self, q_pos, dtype):
        cfg = self.config
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=q_pos.device).float() / cfg.head_dim)
        angles = q_pos.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, cache=None, position=None, attention_mask=None):
        B, T = input_ids.shape
        if position is None:
            position = torch.zeros(1, dtype=torch.long, device=input_ids.device)
        q_pos = position + torch.arange(T, device=input_ids.device)
        if attention_mask is None:
            attention_mask = torch.ones(B, int(q_pos[-1]) + 1, dtype=torch.long, device=input_ids.device)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(q_pos, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, q_pos, attention_mask, cache, i)
        if cache is not None:
            cache.advance(T)
        return self.lm_head(self.model.norm(x)), cache
