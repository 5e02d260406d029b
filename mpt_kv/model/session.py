"""One generation's cache state, driven the same way on every target.

A `Session` is what the properties talk to: `prefill` a left-padded prompt, `decode` one
token per row, `extend` k tokens per row in one cached call, `crop` back to n positions,
`reorder` the rows (beam search), look at the live cache tensors with `kv()`
(docs/operations.md). `TokenIdxSession` drives a model
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

from mpt_kv.errors import InputError, Unsupported
from mpt_kv.model.cache import check_crop, check_reorder
from mpt_kv.model.reference import check_mask, check_token_ids

PAD_ID = 0  # right padding of the static path; never attended, so any valid id does
PATHS = ("concat", "static")


class Session:
    """`prefill`, `decode`, `extend`, `crop` and `reorder` check their input here, once for every
    target, before the target sees it: transformers' MPT crashes deep inside torch on a token id
    past the vocabulary or a length past max_seq_len, and silently accepts a short or float mask.
    Subclasses implement `_prefill` and `_extend` (k tokens -> (B, k, V); `_decode` is its last
    position unless overridden), and `_crop` and `_reorder` where they support them."""

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
        self._check_cached_call(tokens, "decode")
        if tuple(tokens.shape) != (self.batch, 1):
            raise InputError(f"decode tokens shape {tuple(tokens.shape)}: expected ({self.batch}, 1), one token "
                             f"per row of the cache (batch {self.batch})")
        logits = self._decode(tokens)
        self.written += 1
        return logits

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, k) next k tokens of every row, k >= 1, in ONE cached call -> logits (B, k, V).
        What assisted decoding's verification step and a chunked prefill do: k new positions on
        a filled cache, causal inside the chunk."""
        self._require("extend")
        self._check_cached_call(tokens, "extend")
        if tokens.dim() != 2 or tokens.shape[0] != self.batch or tokens.shape[1] < 1:
            raise InputError(f"extend tokens shape {tuple(tokens.shape)}: expected ({self.batch}, k), k >= 1 tokens "
                             f"per row of the cache (batch {self.batch})")
        k = tokens.shape[1]
        if self.written + k > self.max_len:
            raise InputError(f"extend of {k} tokens at position {self.written} ends at {self.written + k}, beyond the "
                             f"cache length max_len={self.max_len} (max_seq_len={self.max_seq_len})")
        logits = self._extend(tokens)
        self.written += k
        return logits

    def crop(self, n: int) -> None:
        """Keep the first n positions, 1 <= n <= written (assisted decoding after a rejected
        candidate; `DynamicCache.crop`); `written` and `mask` follow."""
        self._require("crop")
        if self.batch is None:
            raise InputError("crop before prefill: the cache holds nothing yet")
        n = check_crop(n, self.written)
        self._crop(n)
        self.written = n

    def reorder(self, index: torch.Tensor) -> None:
        """Row b of the cache becomes row index[b] (beam search's `beam_idx`): a (B,) int64
        index on the cache's device, each entry in 0..B-1, repeats allowed; `mask` follows."""
        self._require("reorder")
        if self.batch is None:
            raise InputError("reorder before prefill: the cache holds nothing yet")
        check_reorder(index, self.batch, self.device)
        self._reorder(index)

    def _require(self, feature: str) -> None:
        """The `Unsupported` the checks raise, with the target's own reason, when the session's
        runner declares `feature` unsupported (its Capabilities) and it is called anyway, before
        anything reaches the target. A session without a `runner` declares nothing."""
        runner = getattr(self, "runner", None)
        reason = getattr(runner, "capabilities", None) and runner.capabilities.reason(feature)
        if reason:
            raise Unsupported(f"{getattr(runner, 'name', type(runner).__name__)}: {reason}")

    def _check_cached_call(self, tokens: torch.Tensor, what: str) -> None:
        if self.batch is None:
            raise InputError(f"{what} before prefill: the cache holds nothing yet")
        if self.written >= self.max_len:
            raise InputError(f"{what} at position {self.written} is beyond the cache length max_len={self.max_len}")
        if not torch.is_tensor(tokens):
            raise InputError(f"{what} tokens: expected a tensor, got {type(tokens).__name__}")
        if tokens.device != self.device:
            raise InputError(f"{what} tokens on {tokens.device} but the cache is on {self.device}")
        check_token_ids(tokens, self.vocab_size, f"{what} tokens")

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._extend(tokens)[:, -1]

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no _extend: implement it, or declare "
                                  "Capabilities(unsupported={'extend': <why>})")

    def _crop(self, n: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no _crop: implement it, or declare "
                                  "Capabilities(unsupported={'crop': <why>})")

    def _reorder(self, index: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no _reorder: implement it, or declare "
                                  "Capabilities(unsupported={'reorder': <why>})")

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

    def _extend(self, tokens):
        """k tokens in one call: concat feeds them with the mask k longer; static writes slots
        [t, t + k) at token_idx = t + 1 (optimum-habana: `token_idx` is where the chunk starts,
        the mask switched on for those slots), bucketed: over the first cache_idx slots, rounded up."""
        t, k = self.written, tokens.shape[1]
        if self.path == "concat":
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, k)], dim=1)
            logits = self._forward(tokens, self.mask)
        else:
            self.mask[:, t:t + k] = 1
            token_idx = torch.tensor([t + 1], device=tokens.device)
            if self.bucket is None:
                logits = self._forward(tokens, self.mask, token_idx)
            else:
                cache_idx = min(-(-(t + k) // self.bucket) * self.bucket, self.max_len)
                logits = self._forward(tokens, self.mask[:, :cache_idx], token_idx, cache_idx)
        self.sync()
        return logits

    def _crop(self, n):
        """The mask first (static: slots past n masked again, the mask is the source of truth),
        then the target's cache (`_crop_cache`)."""
        if self.path == "concat":
            self.mask = self.mask[:, :n].clone()
        else:
            self.mask[:, n:] = 0
        self._crop_cache(n)
        self.sync()

    def _reorder(self, index):
        self.mask = self.mask.index_select(0, index)
        self._reorder_cache(index)
        self.sync()

    def _crop_cache(self, n: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no _crop_cache")

    def _reorder_cache(self, index: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no _reorder_cache")


def pad_right(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """(B, S) -> (B, length), new columns filled with `value`."""
    out = torch.full((x.shape[0], length), value, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out
