"""The reference's two KV caches. Both store per layer a key and a value of shape
(B, H, T, hd) that own their memory: never a view of `mixed_qkv`, which would pin the whole
fused (B, S, 3D) buffer, q third included (optimum-habana's PR "refine use cache for mpt model").
"""

from __future__ import annotations

from numbers import Integral, Real

import torch

from mpt_kv.errors import InputError
from mpt_kv.model.config import check_bytes_free


def check_size(what: str, value, low: int = 1) -> int:
    """An int >= low (not a bool, not a float that happens to be whole): a cache dimension."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise InputError(f"{what}={value!r} ({type(value).__name__}): must be an int >= {low}")
    if value < low:
        raise InputError(f"{what}={value} must be >= {low}")
    return int(value)


def check_crop(n, length: int, what: str = "crop") -> int:
    """crop(n): an int in 1..length, the positions held. -1 would slice off the last position
    and 100 keep everything, silently; 2.5 is no position."""
    if isinstance(n, bool) or not isinstance(n, Integral) or not 1 <= n <= length:
        raise InputError(f"{what} to n={n!r}: expected an int in 1..{length} (the positions written)")
    return int(n)


def check_reorder(index, batch: int, device=None, what: str = "reorder") -> None:
    """reorder(index): a (batch,) int64 tensor of source rows in 0..batch-1 (repeats allowed), on
    the cache's device (None: not checked). A float index or one out of range is no row."""
    if not torch.is_tensor(index) or index.dtype != torch.int64:
        raise InputError(f"{what} index {type(index).__name__ if not torch.is_tensor(index) else index.dtype}: "
                         "expected a torch.int64 tensor")
    if tuple(index.shape) != (batch,):
        raise InputError(f"{what} index shape {tuple(index.shape)}: expected ({batch},), one source row per "
                         "row of the cache")
    if device is not None and index.device != torch.device(device):
        raise InputError(f"{what} index on {index.device} but the cache is on {device}")
    if int(index.min()) < 0 or int(index.max()) >= batch:
        raise InputError(f"{what} index out of range [0, {batch}): min {int(index.min())}, max {int(index.max())}")


class ConcatCache:
    """Dynamic cache: prefill stores clones, each cached call `torch.cat`s its T positions on.

    The cat allocates a new (B, H, t+T, hd) tensor while the old one is still alive, so a
    decode step transiently holds the cache twice (the transformers issue "forward pass consumes 2x
    memory than required in Attention module when `use_cache=True`").

    `crop(n)` keeps the first n positions as copies (a slice would keep the cropped tail's
    storage alive); `reorder(index)` takes rows from `index` one layer at a time, so the
    transient is one layer's K and V, never a second whole cache (docs/operations.md)."""

    kind = "concat"

    def __init__(self, n_layers: int):
        n_layers = check_size("ConcatCache n_layers", n_layers)
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layers

    def length(self, layer: int = 0) -> int:
        return 0 if self.kv[layer] is None else self.kv[layer][0].shape[2]

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            self.kv[layer] = (k.clone(), v.clone())  # clone: k, v are views of mixed_qkv
        else:
            old_k, old_v = self.kv[layer]
            self.kv[layer] = (torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2))
        return self.kv[layer]

    def crop(self, n: int) -> None:
        """Keep positions [0, n) of every layer (transformers' `DynamicCache.crop`, but copied)."""
        n = check_crop(n, self.length(), "ConcatCache.crop")
        for layer, pair in enumerate(self.kv):
            if pair is not None:
                self.kv[layer] = (pair[0][:, :, :n].clone(), pair[1][:, :, :n].clone())

    def reorder(self, index: torch.Tensor) -> None:
        """Row b of the cache becomes row index[b] (beam search; repeats allowed), layer by layer."""
        if self.kv[0] is not None:
            check_reorder(index, self.kv[0][0].shape[0], self.kv[0][0].device, "ConcatCache.reorder")
        for layer, pair in enumerate(self.kv):
            if pair is not None:
                self.kv[layer] = (pair[0].index_select(0, index), pair[1].index_select(0, index))


class StaticCache:
    """Preallocated (B, H, max_len, hd) per layer, as optimum-habana's `token_idx` path.

    Prefill copies its T positions into [0, T) and attends over its own k, v. A cached call of
    T tokens (a decode step: T = 1; an extend, a chunk of a prompt: T = k) writes positions
    [token_idx - 1, token_idx - 1 + T) with `index_copy_` (no allocation, storage never moves:
    what HPU and CUDA graphs need) and attends over the whole buffer, or over its first
    `cache_idx` positions (bucketed lengths), under the attention mask.

    `written` counts the positions that hold this generation's tokens: the model sets it (the
    prefill to its token_idx, or T; each cached call to token_idx - 1 + T) and rejects a cached
    call that does not start there. `crop(n)` moves it back (the slots past n are masked again
    by the caller's mask: the mask is the source of truth); `reorder(index)` permutes the rows in
    place, one tensor at a time (storage never moves)."""

    kind = "static"

    def __init__(self, n_layers, batch, n_heads, max_len, head_dim, dtype, device, fill: float | None = None):
        n_layers, batch, n_heads, max_len, head_dim = (
            check_size(f"StaticCache {name}", value) for name, value in
            (("n_layers", n_layers), ("batch", batch), ("n_heads", n_heads), ("max_len", max_len), ("head_dim", head_dim)))
        if fill is not None and (isinstance(fill, bool) or not isinstance(fill, Real)):
            raise InputError(f"StaticCache fill={fill!r}: a number (the value of never-written slots) or None (zeros)")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InputError(f"StaticCache dtype={dtype!r}: must be a floating torch.dtype")
        shape = (batch, n_heads, max_len, head_dim)
        itemsize = torch.empty((), dtype=dtype).element_size()
        check_bytes_free(2 * n_layers * batch * n_heads * max_len * head_dim * itemsize, torch.device(device).type,
                         f"StaticCache of {n_layers} layers x (batch={batch}, n_heads={n_heads}, max_len={max_len}, "
                         f"head_dim={head_dim})", f"K and V in {dtype}")

        def alloc():
            # zeros, not torch.empty (optimum-habana's cache_idx path): a masked slot still
            # meets the second matmul as 0 * v, and a NaN left in fresh memory spreads from there
            return torch.full(shape, 0.0 if fill is None else fill, dtype=dtype, device=device)

        self.kv = [(alloc(), alloc()) for _ in range(n_layers)]
        self.prefilled = [False] * n_layers
        self.max_len = max_len
        self.written = 0

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        ck, cv = self.kv[layer]
        if not self.prefilled[layer]:
            T = k.shape[2]
            ck[:, :, :T] = k
            cv[:, :, :T] = v
            self.prefilled[layer] = True
            return k, v
        if token_idx is None:
            raise InputError("StaticCache decode needs token_idx (1-based position of the new token)")
        slots = write_slots(token_idx, k.shape[2])
        ck.index_copy_(2, slots, k)
        cv.index_copy_(2, slots, v)
        if cache_idx is not None:
            return ck[:, :, :cache_idx], cv[:, :, :cache_idx]
        return ck, cv

    def crop(self, n: int) -> None:
        # written is None only under graph capture (not tracked): the cache length is the limit then
        self.written = check_crop(n, self.max_len if self.written is None else self.written, "StaticCache.crop")

    def reorder(self, index: torch.Tensor) -> None:
        check_reorder(index, self.kv[0][0].shape[0], self.kv[0][0].device, "StaticCache.reorder")
        for ck, cv in self.kv:
            ck.copy_(ck.index_select(0, index))  # the copy is read whole before any row is written
            cv.copy_(cv.index_select(0, index))


def write_slots(token_idx, T: int) -> torch.Tensor:
    """The slots a cached call of T tokens at 1-based `token_idx` writes: [token_idx - 1, + T).
    A tensor token_idx stays on its device (no host sync: graph capture forbids one)."""
    if not torch.is_tensor(token_idx):
        token_idx = torch.tensor([int(token_idx)])
    start = token_idx.reshape(-1)[:1] - 1
    return start + torch.arange(T, device=token_idx.device)
