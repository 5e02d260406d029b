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

import torch

from .errors import InputError

PAD_ID = 0  # right padding of the static path; never attended, so any valid id does


class Session:
    path: str
    written: int  # positions [0, written) hold this generation's tokens

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S) left-padded prompt, mask 1 = token -> logits (B, S, V)."""
        raise NotImplementedError

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, 1) next token of every row -> logits (B, V)."""
        raise NotImplementedError

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The live cached (key, value) of every layer, (B, H, T, hd), as the target stores them."""
        raise NotImplementedError


class TokenIdxSession(Session):
    """Subclasses give `_forward(input_ids, mask, token_idx, cache_idx) -> logits (B, T, V)`."""

    def __init__(self, path: str, max_len: int, bucket: int | None = None, sync=lambda: None):
        if path not in ("concat", "static"):
            raise InputError(f"unknown cache path {path!r}: expected 'concat' or 'static'")
        if bucket is not None and (path != "static" or bucket < 1):
            raise InputError(f"bucket={bucket}: buckets need the static path and a size >= 1")
        self.path, self.max_len, self.bucket, self.sync = path, max_len, bucket, sync
        self.written = 0
        self.mask: torch.Tensor | None = None

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, input_ids, attention_mask):
        B, S = input_ids.shape
        if S > self.max_len:
            raise InputError(f"prompt length {S} exceeds the cache length max_len={self.max_len}")
        mask = attention_mask.to(torch.long)
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
        self.written = S
        self.sync()
        return logits

    def decode(self, tokens):
        t = self.written
        if t >= self.max_len:
            raise InputError(f"decode at position {t} is beyond the cache length max_len={self.max_len}")
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
        self.written = t + 1
        self.sync()
        return logits[:, -1]


def pad_right(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """(B, S) -> (B, length), new columns filled with `value`."""
    out = torch.full((x.shape[0], length), value, dtype=x.dtype, device=x.device)
    out[:, : x.shape[1]] = x
    return out
