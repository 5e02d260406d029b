"""One generation's cache state, driven the same way on every target.

A `Session` is what the properties talk to: `prefill` a left-padded prompt, `decode` one
token per row, look at the live cache tensors with `kv()`. `TokenIdxSession` drives a model
the way optimum-habana's generation does, which is the protocol of both the reference and
`GaudiMptForCausalLM`:

- concat: prefill the prompt, then each step feeds one token and a mask one longer;
- static: the prompt is right-padded to `max_len` and prefilled whole (static shapes), then
  step t feeds `token_idx = t + 1` (1-based) and the full-length mask with slot t switched on;
- static + `bucket`: prefill only the prompt into a cache preallocated to `max_len`; each step
  attends over the first `cache_idx` slots, `cache_idx` rounded up to a multiple of `bucket`.
"""

from __future__ import annotations

from numbers import Integral

import torch

from mpt_kv.errors import InputError
from mpt_kv.model.reference import check_mask, check_token_ids

PAD_ID = 0  # right padding of the static path; never attended, so any valid id does
PATHS = ("concat", "static")


class Session:
    """`prefill` and `decode` check their input here, once for every target, before the target
    sees it: transformers' MPT crashes deep inside torch on a token id past the vocabulary or a
    length past max_seq_len, and silently accepts a short or float mask. Subclasses implement
    `_prefill` and `_decode`."""

    path: str
    max_len: int       # cache length this generation was opened with
    max_seq_len: int   # the model's limit: ALiBi is built only that far
    vocab_size: int
    written: int       # positions [0, written) hold this generation's tokens
    mask: torch.Tensor | None  # (B, written) 1 = token, as the target last saw it (P2 reads it), in the
                               # dtype of the prefill's mask: bool, int64 and int32 reach the target as given

    def __init__(self, path: str, max_len: int, max_seq_len: int, vocab_size: int):
        if path not in PATHS:
            raise InputError(f"unknown cache path {path!r}: expected one of {PATHS}")
        if isinstance(max_len, bool) or not isinstance(max_len, Integral):
            raise InputError(f"cache length max_len={max_len!r} ({type(max_len).__name__}): must be an int in "
                             f"1..max_seq_len={max_seq_len}")
        max_len = int(max_len)
        if not 1 <= max_len <= max_seq_len:
            raise InputError(f"cache length max_len={max_len} outside 1..max_seq_len={max_seq_len} "
                             "(ALiBi is built only that far)")
        self.path, self.max_len, self.max_seq_len, self.vocab_size = path, max_len, max_seq_len, vocab_size
        self.written, self.mask = 0, None
        self.batch: int | None = None       # rows of the prefill: every decode step must match
        self.device: torch.device | None = None

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) left-padded prompt, mask 1 = token -> logits (B, S, V)."""
        if self.batch is not None:
            raise InputError("prefill called twice on one session: open a new session per generation")
        if attention_mask is None:  # the session keeps the mask (padding) for every later step: no default
            raise InputError(f"prefill attention_mask is None: pass the ({', '.join(map(str, getattr(input_ids, 'shape', ())))}) "
                             "mask of the prompt, 1 = token, 0 = left padding (torch.ones_like(input_ids) for none)")
        check_prompt(input_ids, attention_mask, self.vocab_size, self.max_seq_len, self.max_len)
        logits = self._prefill(input_ids, attention_mask)
        self.batch, self.device, self.written = input_ids.shape[0], input_ids.device, input_ids.shape[1]
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, 1) next token of every row -> logits (B, V)."""
        if self.batch is None:
            raise InputError("decode before prefill: the cache holds nothing yet")
        if self.written >= self.max_len:
            raise InputError(f"decode at position {self.written} is beyond the cache length max_len={self.max_len}")
        if tuple(tokens.shape) != (self.batch, 1):
            raise InputError(f"decode tokens shape {tuple(tokens.shape)}: expected ({self.batch}, 1), one token "
                             f"per row of the cache (batch {self.batch})")
        if tokens.device != self.device:
            raise InputError(f"decode tokens on {tokens.device} but the cache is on {self.device}")
        check_token_ids(tokens, self.vocab_size, "decode tokens")
        logits = self._decode(tokens)
        self.written += 1
        return logits

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The live cached (key, value) of every layer, (B, H, T, hd), as the target stores them."""
        raise NotImplementedError

    def cache_layout(self):
        """None: `kv()` returns the cache as stored. A paged cache returns `mpt_kv.PagedLayout`
        (pools, block table, block size, lengths), a cache growing by blocks `mpt_kv.BlockGrowth`
        (docs/targets.md, "Cache layouts")."""
        return None


def check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int, max_seq_len: int,
                 max_len: int | None = None) -> None:
    """A (B, S) prompt of valid ids within max_seq_len (and the cache length `max_len`, if
    any), with a (B, S) bool/integer mask that leaves every row something to attend to.
    Sessions check every prefill with it; adapters' uncached forwards call it too."""
    if not torch.is_tensor(input_ids):
        raise InputError(f"input_ids is a {type(input_ids).__name__}: expected a (batch, length) torch.Tensor")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise InputError(f"input_ids shape {tuple(input_ids.shape)}: expected (batch, length), both >= 1")
    B, S = input_ids.shape
    if S > max_seq_len:
        raise InputError(f"total length {S} exceeds max_seq_len={max_seq_len} (ALiBi is built only that far)")
    if max_len is not None and S > max_len:
        raise InputError(f"prompt length {S} exceeds the cache length max_len={max_len}")
    check_token_ids(input_ids, vocab_size, "input_ids")
    if not torch.is_tensor(attention_mask):
        raise InputError(f"attention_mask is {type(attention_mask).__name__}: expected a ({B}, {S}) tensor, "
                         "1 = token, 0 = padding")
    if attention_mask.device != input_ids.device:
        raise InputError(f"attention_mask on {attention_mask.device} but input_ids on {input_ids.device}")
    check_mask(attention_mask, (B, S))


def check_bucket(bucket, path: str) -> None:
    """A cache_idx bucket: None, or an int >= 1 on the static path."""
    if bucket is None:
        return
    if isinstance(bucket, bool) or not isinstance(bucket, Integral) or bucket < 1 or path != "static":
        raise InputError(f"bucket={bucket!r}: buckets need the static path (got {path!r}) and an int size >= 1")


class TokenIdxSession(Session):
    """Subclasses give `_forward(input_ids, mask, token_idx, cache_idx) -> logits (B, T, V)`."""

    def __init__(self, path: str, max_len: int, bucket: int | None = None, sync=lambda: None, *,
                 max_seq_len: int, vocab_size: int):
        super().__init__(path, max_len, max_seq_len, vocab_size)
        check_bucket(bucket, path)
        self.bucket, self.sync = bucket, sync

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None) -> torch.Tensor:
        raise NotImplementedError

    def _prefill(self, input_ids, attention_mask):
        S = input_ids.shape[1]
        mask = attention_mask  # its own dtype (bool, int64, int32), as the caller gave it: a target must read each
        token_idx = torch.tensor([S], device=input_ids.device)
        if self.path == "concat":
            self.mask = mask
            logits = self._forward(input_ids, mask)
        elif self.bucket is not None:
            self.mask = pad_right(mask, self.max_len, 0)
            logits = self._forward(input_ids, mask, token_idx, cache_idx=S)
        else:
            self.mask = pad_right(mask, self.max_len, 0)
            logits = self._forward(pad_right(input_ids, self.max_len, PAD_ID), self.mask, token_idx)[:, :S]
        self.sync()
        return logits

    def _decode(self, tokens):
        t = self.written
        if self.path == "concat":
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
            logits = self._forward(tokens, self.mask)
        else:
            self.mask[:, t] = 1
            token_idx = torch.tensor([t + 1], device=tokens.device)
            if self.bucket is None:
                logits = self._forward(tokens, self.mask, token_idx)
            else:
                cache_idx = min(-(-(t + 1) // self.bucket) * self.bucket, self.max_len)
                logits = self._forward(tokens, self.mask[:, :cache_idx], token_idx, cache_idx)
        self.sync()
        return logits[:, -1]


def pad_right(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """(B, S) -> (B, length), new columns filled with `value`."""
    out = torch.full((x.shape[0], length), value, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out
