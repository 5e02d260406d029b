"""The oracle: a small MPT with both KV cache paths, in the spirit of nanoGPT / gpt-fast.

Shapes: B batch, T query tokens this step, K key positions attended, H heads, hd head dim,
D = H * hd. Loads and exports transformers' `MptForCausalLM` state_dict, so every target
runs the same weights. The forward signature mirrors optimum-habana's GaudiMptForCausalLM
(`token_idx`, `cache_idx`), so reading one explains the other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.config import ModelConfig
from mpt_kv.errors import InputError


def alibi_slopes(n_heads: int, alibi_bias_max: int = 8) -> torch.Tensor:
    """(H,) slopes exactly as MPT builds them, including head counts that are not powers of 2:
    take the slopes of the next power of two, odd positions first, then even, truncate."""
    n = 2 ** math.ceil(math.log2(n_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1).float() * (alibi_bias_max / n))
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def alibi_bias(cfg: ModelConfig, device=None) -> torch.Tensor:
    """(H, 1, max_seq_len): slope * (j - (max_seq_len - 1)) for key j. A step over K keys uses the
    last K columns. Only the key position matters: softmax is shift-invariant per query row."""
    pos = torch.arange(1 - cfg.max_seq_len, 1, device=device).float()
    return alibi_slopes(cfg.n_heads, cfg.alibi_bias_max).to(device)[:, None, None] * pos


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.Wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        mixed_qkv = self.Wqkv(x)                                        # (B, T, 3D)
        if self.cfg.clip_qkv:
            mixed_qkv = mixed_qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
        q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))  # (B, H, T, hd)
        if cache is not None:
            k, v = cache.update(layer, k, v, token_idx, cache_idx)      # (B, H, K, hd), owns its memory
        K = k.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)               # (B, H, T, K)
        scores = scores + bias[:, :, -K:]                               # ALiBi for the K keys attended
        scores = scores.masked_fill(mask[:, :, :, :K], torch.finfo(q.dtype).min)
        weights = F.softmax(scores.float(), dim=-1).to(v.dtype)        # softmax in fp32, as MPT
        # free the (B, H, T, K) tensors before the next allocations: held by local names they
        # would lift the peak above weights + cache + one layer's transients
        del scores
        out = weights @ v                                               # (B, H, T, hd)
        del weights
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))     # (B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.attn = Attention(cfg)
        self.norm_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False)
        self.ffn = nn.ModuleDict(dict(
            up_proj=nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
            down_proj=nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False),
        ))

    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        x = x + self.attn(self.norm_1(x), mask, bias, cache, layer, token_idx, cache_idx)
        return x + self.ffn.down_proj(F.gelu(self.ffn.up_proj(self.norm_2(x))))


class ReferenceMPT(nn.Module):
    """`forward(input_ids, attention_mask, cache, token_idx, cache_idx) -> logits (B, T, V)`.

    - no cache: a full forward over T tokens (the uncached oracle);
    - `ConcatCache`: keys are the past plus these T tokens;
    - `StaticCache`: the first call is the prefill (keys = its own T tokens); later calls are
      decode steps at 1-based position `token_idx`, attending over the whole buffer (or its
      first `cache_idx` positions).
    `attention_mask` (B, K): 1/True for real tokens, 0/False for padding, one entry per key
    position the step attends over (static decode: per cache slot). Causality is applied on
    top from absolute positions, so never-written future slots are masked either way.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            blocks=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers)),
            norm_f=nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_epsilon, bias=False),
        ))
        self.register_buffer("alibi", alibi_bias(cfg), persistent=False)
        self.validate = True  # off only where a host sync per step is unwanted (graph capture)

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` and friends leave ALiBi in float32, as transformers' MPT builds it: its
        values run to slope x max_seq_len, which bf16 rounds to steps of 0.5-8 past 64, and a bf16
        bias made the reference 15x further from fp32 than transformers at max_seq_len 2048
        (docs/calibration.md). The scores are float32 from the bias on, as in MPT."""
        super()._apply(fn, recurse)
        self.alibi = alibi_bias(self.cfg, self.alibi.device)
        return self

    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if input_ids.dim() != 2:
            raise InputError(f"input_ids shape {tuple(input_ids.shape)}: expected (batch, length)")
        B, T = input_ids.shape
        start, K = self._positions(T, cache, token_idx, cache_idx)     # first query position, keys
        if attention_mask is None:
            attention_mask = torch.ones(B, K, dtype=torch.bool, device=input_ids.device)
        if self.validate:
            check_inputs(self.cfg, self.transformer.wte.weight.dtype, input_ids, attention_mask, cache, token_idx, cache_idx, K)
        q_pos = start + torch.arange(T, device=input_ids.device)       # (T,) absolute positions
        k_pos = torch.arange(K, device=input_ids.device)               # (K,)
        future = k_pos[None, :] > q_pos[:, None]                        # (T, K) causal
        padding = ~attention_mask[:, :K].bool()                         # (B, K)
        mask = future[None, None] | padding[:, None, None, :]          # (B, 1, T, K) True = masked

        prefill = isinstance(cache, StaticCache) and not cache.prefilled[0]
        x = self.transformer.wte(input_ids)                            # (B, T, D)
        for i, block in enumerate(self.transformer.blocks):
            x = block(x, mask, self.alibi, cache, i, token_idx, cache_idx)
        if isinstance(cache, StaticCache):
            # the positions that now hold this generation's tokens. Read on the host only while
            # validating: under graph capture (validate off) a host sync is forbidden, so untracked
            if not self.validate:
                cache.written = None
            elif prefill:  # its token_idx: where a prompt right-padded to the cache length ends
                cache.written = T if token_idx is None else int(torch.as_tensor(token_idx).reshape(-1)[0])
            else:
                cache.written = int(start) + T
        x = self.transformer.norm_f(x)
        return x @ self.transformer.wte.weight.T                       # (B, T, V), lm_head tied

    def _positions(self, T, cache, token_idx, cache_idx):
        """(first query position, number of keys attended) for this call. A static cached call
        (a decode step, T = 1, or an extend of T tokens) must start where this generation's
        tokens end (`StaticCache.written`): one that starts earlier would silently overwrite them
        (crop first to rewrite them), one that starts later would leave slots never written."""
        if isinstance(cache, StaticCache) and cache.prefilled[0]:
            if token_idx is None:
                raise InputError("a cached call on a StaticCache needs token_idx (1-based position)")
            # a tensor position stays on the device: no host sync, which CUDA/HPU graph capture forbids
            start = token_idx.reshape(-1)[0] - 1 if torch.is_tensor(token_idx) else int(token_idx) - 1
            written = getattr(cache, "written", None)
            # a token_idx outside the cache is check_cache's message; inside it, it must be written + 1
            if self.validate and written is not None and 0 <= int(start) < cache.max_len and int(start) != written:
                raise InputError(f"token_idx={int(start) + 1} writes slot {int(start)}, but the static cache holds "
                                 f"{written} positions of this generation: a cached call must start at token_idx "
                                 f"= {written + 1} (written + 1; crop the cache first to rewrite earlier slots)")
            return start, int(cache_idx) if cache_idx is not None else cache.max_len
        past = cache.length() if isinstance(cache, ConcatCache) else 0
        return past, past + T

    # --- cache construction ---------------------------------------------------------------
    def new_cache(self, path: str, batch: int, max_len: int | None = None, fill: float | None = None):
        if path == "concat":
            return ConcatCache(self.cfg.n_layers)
        if path == "static":
            max_len = max_len or self.cfg.max_seq_len
            if max_len > self.cfg.max_seq_len:
                raise InputError(f"static cache length {max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
            w = self.transformer.wte.weight
            return StaticCache(self.cfg.n_layers, batch, self.cfg.n_heads, max_len, self.cfg.head_dim,
                               w.dtype, w.device, fill)
        raise InputError(f"unknown cache path {path!r}: expected 'concat' or 'static'")

    # --- weights in transformers' MptForCausalLM format -------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]):
        own = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied to wte
        self.load_state_dict(own, strict=True)
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = dict(self.state_dict())
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
        return sd


def check_inputs(cfg, dtype, input_ids, attention_mask, cache, token_idx, cache_idx, K):
    """Reject bad input with the value and the limit, before torch fails deep inside. The cache
    comes first: `K`, the number of keys, is derived from token_idx/cache_idx."""
    if cache is not None:
        check_cache(cfg, dtype, input_ids, cache, token_idx, cache_idx)
    if K > cfg.max_seq_len:
        raise InputError(f"total length {K} exceeds max_seq_len={cfg.max_seq_len} (ALiBi is built only that far)")
    check_token_ids(input_ids, cfg.vocab_size, "input_ids")
    check_mask(attention_mask, (input_ids.shape[0], K))


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"{what} dtype {ids.dtype}: expected an integer dtype")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InputError(f"{what}: token id out of range [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")


def check_mask(mask: torch.Tensor, shape: tuple[int, int]) -> None:
    """(B, K) bool or integer, 1 = attend, exactly one entry per key position; no row all masked."""
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InputError(f"attention_mask dtype {mask.dtype}: expected bool or integer (1 = attend)")
    if tuple(mask.shape) != tuple(shape):
        raise InputError(f"attention_mask shape {tuple(mask.shape)}: expected {tuple(shape)}, "
                         f"one entry per key position ({shape[1]} keys)")
    dead = (~mask.bool()).all(dim=1)
    if dead.any():
        raise InputError(f"attention_mask rows {dead.nonzero().flatten().tolist()} mask every one of their "
                         f"{shape[1]} positions: nothing to attend to")


def check_cache(cfg, dtype, input_ids, cache, token_idx, cache_idx) -> None:
    B, T = input_ids.shape
    if len(cache.kv) != cfg.n_layers:
        raise InputError(f"cache has {len(cache.kv)} layers, the model {cfg.n_layers}")
    k0 = cache.kv[0][0] if cache.kv[0] is not None else None
    if k0 is not None:
        want = (B, cfg.n_heads, cfg.head_dim)
        have = (k0.shape[0], k0.shape[1], k0.shape[3])
        if have != want:
            raise InputError(f"cache (batch, heads, head_dim) = {have} does not match the input's {want}")
        if k0.device != input_ids.device:
            raise InputError(f"cache is on {k0.device} but input_ids are on {input_ids.device}")
        if k0.dtype != dtype:
            raise InputError(f"cache dtype {k0.dtype} does not match the model's {dtype}")
    if not isinstance(cache, StaticCache):
        return
    if cache.prefilled[0]:
        pos = int(token_idx.reshape(-1)[0]) if torch.is_tensor(token_idx) else int(token_idx)
        if not 1 <= pos <= cache.max_len:
            raise InputError(f"token_idx={pos} outside 1..{cache.max_len} (the static cache length)")
        if cache_idx is not None and not pos <= int(cache_idx) <= cache.max_len:
            raise InputError(f"cache_idx={int(cache_idx)} outside {pos}..{cache.max_len} (token_idx..cache length)")
        end = int(cache_idx) if cache_idx is not None else cache.max_len
        if pos - 1 + T > end:
            raise InputError(f"a static cached call of {T} tokens at token_idx={pos} writes slots {pos - 1}..{pos + T - 2}, "
                             f"beyond the {end} slots it attends (cache_idx, or the static cache length)")
    else:
        if T > cache.max_len:
            raise InputError(f"prefill of {T} tokens exceeds the static cache length {cache.max_len}")
        if cache_idx is not None and not T <= int(cache_idx) <= cache.max_len:
            raise InputError(f"cache_idx={int(cache_idx)} outside {T}..{cache.max_len} (prompt length..cache length)")
