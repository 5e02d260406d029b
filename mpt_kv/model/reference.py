"""The oracle: a small MPT with both KV cache paths, in the spirit of nanoGPT / gpt-fast.

Shapes: B batch, T query tokens this step, K key positions attended, H heads, hd head dim,
D = H * hd. Loads and exports transformers' `MptForCausalLM` state_dict, so every target
runs the same weights. The forward signature mirrors optimum-habana's GaudiMptForCausalLM
(`token_idx`, `cache_idx`), so reading one explains the other.
"""

from __future__ import annotations

import inspect
import math
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import nn

from mpt_kv.model.cache import ConcatCache, StaticCache, check_size
from mpt_kv.model.config import ModelConfig, check_fits_in_memory, check_state_dict
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
        check_fits_in_memory(cfg, "ReferenceMPT")  # before any parameter or the ALiBi buffer is allocated
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
        if self.validate:
            check_positions(token_idx, cache_idx, input_ids.device, cache)  # before _positions reads them
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
        """A ConcatCache, or a StaticCache of `max_len` slots (None: max_seq_len; 0 is an error, not None)."""
        if path not in ("concat", "static"):
            raise InputError(f"unknown cache path {path!r}: expected 'concat' or 'static'")
        batch = check_size("cache batch", batch)
        if path == "concat":
            return ConcatCache(self.cfg.n_layers)
        max_len = self.cfg.max_seq_len if max_len is None else check_size("static cache length max_len", max_len)
        if max_len > self.cfg.max_seq_len:
            raise InputError(f"static cache length {max_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        w = self.transformer.wte.weight
        return StaticCache(self.cfg.n_layers, batch, self.cfg.n_heads, max_len, self.cfg.head_dim,
                           w.dtype, w.device, fill)

    # --- weights in transformers' MptForCausalLM format -------------------------------------
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]):
        """Load `MptForCausalLM` weights. MPT ties lm_head to wte: an `lm_head.weight` that is
        not the same (V, D) values is refused, since the reference would silently ignore it."""
        check_state_dict(self.cfg, sd)
        head, wte = sd.get("lm_head.weight"), sd.get("transformer.wte.weight")
        if head is not None and wte is not None:
            if tuple(head.shape) != tuple(wte.shape):
                raise InputError(f"lm_head.weight shape {tuple(head.shape)}: expected {tuple(wte.shape)} "
                                 "(vocab_size, d_model), tied to transformer.wte.weight as in MPT")
            if head is not wte and not torch.equal(head, wte):
                diff = (head.float() - wte.float()).abs().max().item()
                raise InputError(f"lm_head.weight differs from transformer.wte.weight (max abs difference {diff:.3e}): "
                                 "MPT ties them, and the reference has no separate head to load untied values into")
        own = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied to wte
        self.load_state_dict(own, strict=True)
        return self

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = dict(self.state_dict())
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
        return sd


def check_inputs(cfg, dtype, input_ids, attention_mask, cache, token_idx, cache_idx, K):
    """Reject bad input with the value and the limit, before torch fails deep inside, and before
    any layer writes the cache: every layer of it, token_idx and cache_idx are checked here, so a
    rejected call leaves the cache as it was. The cache comes first: `K`, the number of keys, is
    derived from token_idx/cache_idx."""
    check_token_ids(input_ids, cfg.vocab_size, "input_ids")
    visible = K  # key positions the last query row can see (causality): the mask must leave it one
    if cache is not None:
        check_cache(cfg, dtype, input_ids, cache, token_idx, cache_idx)
        if isinstance(cache, StaticCache) and cache.prefilled[0]:
            visible = min(K, position(token_idx) + input_ids.shape[1] - 1)
    if K > cfg.max_seq_len:
        raise InputError(f"total length {K} exceeds max_seq_len={cfg.max_seq_len} (ALiBi is built only that far)")
    check_mask(attention_mask, (input_ids.shape[0], K), visible)


TOKEN_DTYPES = (torch.int64, torch.int32)  # what torch.nn.Embedding takes as indices


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """int64 or int32 ids in [0, vocab_size). Other integer dtypes are refused rather than cast:
    nn.Embedding takes only these two, and uint8/int8/int16 cannot hold a real vocabulary's ids."""
    if not torch.is_tensor(ids):
        raise InputError(f"{what} is a {type(ids).__name__}: expected a torch.Tensor of token ids")
    if ids.dtype not in TOKEN_DTYPES:
        raise InputError(f"{what} dtype {ids.dtype}: expected an integer dtype, torch.int64 or torch.int32 "
                         "(what torch.nn.Embedding takes; cast with .long())")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InputError(f"{what}: token id out of range [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")


def check_mask(mask: torch.Tensor, shape: tuple[int, int], visible: int | None = None) -> None:
    """(B, K) bool or integer of 0 (padding) and 1 (attend), one entry per key position; no row
    without a 1 among its first `visible` positions (default all K: the ones causality lets the
    last query see; a static decode step sees slots up to its own, never a future one)."""
    if not torch.is_tensor(mask):
        raise InputError(f"attention_mask is {type(mask).__name__}: expected a ({shape[0]}, {shape[1]}) tensor, "
                         "1 = attend, 0 = padding")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise InputError(f"attention_mask dtype {mask.dtype}: expected bool or integer (1 = attend)")
    if tuple(mask.shape) != tuple(shape):
        raise InputError(f"attention_mask shape {tuple(mask.shape)}: expected {tuple(shape)}, "
                         f"one entry per key position ({shape[1]} keys)")
    if mask.dtype != torch.bool:
        bad = mask[(mask != 0) & (mask != 1)]
        if bad.numel():
            values = sorted(set(bad.unique().tolist()))
            raise InputError(f"attention_mask values {values[:5]}: expected 0 (padding) or 1 (attend) only; an "
                             "additive mask (0 / -10000) or a count is not a padding mask")
    visible = shape[1] if visible is None else visible
    dead = (~mask[:, :visible].bool()).all(dim=1)
    if dead.any():
        where = (f"every one of their {shape[1]} positions" if visible == shape[1] else
                 f"every one of the {visible} positions up to the current one (a 1 only on a future slot "
                 "attends to nothing: causality masks it)")
        raise InputError(f"attention_mask rows {dead.nonzero().flatten().tolist()} mask {where}: nothing to attend to")


def check_index(what: str, value, device, python_int: bool) -> int:
    """token_idx or cache_idx: one integer position, a 1-element int64/int32 tensor on `device`
    or, where `python_int`, an int -> its value."""
    if torch.is_tensor(value):
        if value.dtype not in TOKEN_DTYPES:
            raise InputError(f"{what} dtype {value.dtype}: expected torch.int64 or torch.int32")
        if value.numel() != 1:
            raise InputError(f"{what} shape {tuple(value.shape)}: expected one position (1 element), got "
                             f"{value.numel()}")
        if value.device != device:
            raise InputError(f"{what} on {value.device} but input_ids on {device}")
        return int(value.reshape(-1)[0])
    if python_int and isinstance(value, Integral) and not isinstance(value, bool):
        return int(value)
    why = "" if python_int else " (the reference's StaticCache writes with index_copy_, which takes a tensor index)"
    raise InputError(f"{what}={value!r} ({type(value).__name__}): expected a 1-element integer tensor, e.g. "
                     f"torch.tensor([4]){' or an int' if python_int else ''}{why}")


def position(value) -> int:
    """The value of a token_idx or cache_idx that check_positions accepted."""
    return int(value.reshape(-1)[0]) if torch.is_tensor(value) else int(value)


def check_positions(token_idx, cache_idx, device, cache=None) -> None:
    """token_idx and cache_idx, where given, are one well-formed position each (check_index).
    cache_idx may be an int (optimum-habana passes one); token_idx too, but only for a cache
    that writes its decode steps itself (a StaticCache subclass overriding `update`): the
    reference's own StaticCache.update needs a tensor."""
    if token_idx is not None:
        own_writes = cache is not None and getattr(type(cache), "update", None) is not StaticCache.update
        check_index("token_idx", token_idx, device, python_int=own_writes)
    if cache_idx is not None:
        check_index("cache_idx", cache_idx, device, python_int=True)


def takes_update(update) -> bool:
    """A callable that takes (layer, k, v, token_idx, cache_idx): the cache interface attention calls.
    A dict's or a set's builtin `update` has no such signature and is not one."""
    if not callable(update):
        return False
    try:
        inspect.signature(update).bind(0, None, None, None, None)
    except (TypeError, ValueError):
        return False
    return True


def check_cache(cfg, dtype, input_ids, cache, token_idx, cache_idx) -> None:
    """Every layer of the cache matches the input and the others (a later layer that is empty or
    shorter would give wrong logits, not an error); token_idx/cache_idx are well formed."""
    B, T = input_ids.shape
    if not isinstance(cache, (ConcatCache, StaticCache)):
        # a design's own cache (docs/targets.md, "Building one from the reference's pieces"): attention
        # only calls `cache.update(layer, k, v, token_idx, cache_idx)`, and the cache checks its own state
        if not takes_update(getattr(cache, "update", None)):
            raise InputError(f"cache is a {type(cache).__name__}: expected a ConcatCache or StaticCache "
                             "(ReferenceMPT.new_cache), or a cache object with a callable "
                             "update(layer, k, v, token_idx, cache_idx)")
        return
    if len(cache.kv) != cfg.n_layers:
        raise InputError(f"cache has {len(cache.kv)} layers, the model {cfg.n_layers}")
    want = (B, cfg.n_heads, cfg.head_dim)
    lengths = []
    for i, entry in enumerate(cache.kv):
        name = "cache" if i == 0 else f"cache layer {i}"
        if entry is None:
            lengths.append(0)
            continue
        k, v = entry
        have = (k.shape[0], k.shape[1], k.shape[3]) if k.dim() == 4 else tuple(k.shape)
        if have != want:
            raise InputError(f"{name} (batch, heads, head_dim) = {have} does not match the input's {want}")
        if tuple(v.shape) != tuple(k.shape):
            raise InputError(f"{name}: value shape {tuple(v.shape)} differs from key shape {tuple(k.shape)}")
        if k.device != input_ids.device:
            raise InputError(f"{name} is on {k.device} but input_ids are on {input_ids.device}")
        if k.dtype != dtype:
            raise InputError(f"{name} dtype {k.dtype} does not match the model's {dtype}")
        lengths.append(k.shape[2])
    if isinstance(cache, ConcatCache):
        if cache_idx is not None:  # a concat step attends over every position: the limit would be ignored silently
            raise InputError(f"cache_idx={position(cache_idx)} on a ConcatCache: only a StaticCache attends over its "
                             "first cache_idx slots; pass cache_idx=None")
        if any(x != lengths[0] for x in lengths):
            raise InputError(f"cache layers hold {lengths} positions (layer 0 first): every layer must hold "
                             "the same number (an empty or shorter later layer would give wrong logits)")
        return
    if any(x != cache.max_len for x in lengths) or len(set(cache.prefilled)) > 1:
        raise InputError(f"static cache layers of lengths {lengths} and prefilled {cache.prefilled}: every layer "
                         f"must have max_len={cache.max_len} slots and be prefilled together")
    # both already well formed (check_positions, before the forward read them)
    pos = None if token_idx is None else position(token_idx)
    limit = None if cache_idx is None else position(cache_idx)
    if cache.prefilled[0]:
        if not 1 <= pos <= cache.max_len:
            raise InputError(f"token_idx={pos} outside 1..{cache.max_len} (the static cache length)")
        if limit is not None and not pos <= limit <= cache.max_len:
            raise InputError(f"cache_idx={limit} outside {pos}..{cache.max_len} (token_idx..cache length)")
        end = limit if limit is not None else cache.max_len
        if pos - 1 + T > end:
            raise InputError(f"a static cached call of {T} tokens at token_idx={pos} writes slots {pos - 1}..{pos + T - 2}, "
                             f"beyond the {end} slots it attends (cache_idx, or the static cache length)")
    else:
        if T > cache.max_len:
            raise InputError(f"prefill of {T} tokens exceeds the static cache length {cache.max_len}")
        if limit is not None and not T <= limit <= cache.max_len:
            raise InputError(f"cache_idx={limit} outside {T}..{cache.max_len} (prompt length..cache length)")
