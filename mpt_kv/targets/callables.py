"""A runner made of the callables a user supplies, for a model with its own forward signature
and its own caches (docs/targets.md, "A model with its own forward signature: CallableRunner").

    CallableRunner(model, device, cfg=cfg, logits=, new_cache=, step=, kv=, crop=None, reorder=None)

The protocol (the session does the bookkeeping; the callables only run the model):

    logits(input_ids (B, T), attention_mask (B, T)) -> (B, T, V)       uncached full forward
    new_cache(path, batch, max_len) -> cache                            once per generation, at the prefill
    step(cache, input_ids (B, k), attention_mask, position) -> (logits (B, k, V), cache)
    kv(cache) -> [(key, value) per layer], (B, H, L, hd), the stored tensors (not copies)
    crop(cache, n) -> cache       keep positions [0, n)              optional: absent = unsupported
    reorder(cache, index) -> cache   row b becomes row index[b]      optional: absent = unsupported

`step` is the prefill (the prompt, k = S, position 0) and every later cached call (a decode:
k = 1; an extend: k tokens). `position` is a (1,) int64 tensor on the device: the 0-based slot
the call's first token goes to (= the positions already written). A tensor, not an int: on the
static path a Python int changes every step, which a captured graph cannot replay (the
static-shape check fails it). `attention_mask` (1 = token, in the prompt mask's own dtype):

- concat: (B, position + k), the mask of every position so far, these k included;
- static: (B, max_len) on every call, the prefill's included: slots written so far and these k
  on, the rest off. Shapes then stay fixed from step to step; the cache must keep its storage
  and shapes too (preallocate `max_len` slots in `new_cache`, write in place), and `kv` must
  return the whole (B, H, max_len, hd) buffers.
"""

from __future__ import annotations

from typing import Callable

import torch

from mpt_kv.errors import AdapterError
from mpt_kv.model.session import Session, check_prompt, pad_right
from mpt_kv.targets import Capabilities, Runner
from mpt_kv.targets.wrappers import device_sync, model_limits, with_declared

__all__ = ["CallableRunner", "CallableSession"]


class CallableSession(Session):
    """One generation over a `CallableRunner`'s callables; keeps `mask` as `step` last saw it."""

    def __init__(self, runner: "CallableRunner", path: str, max_len: int):
        super().__init__(path, max_len, runner.max_seq_len, runner.vocab_size)
        self.runner, self.cache = runner, None

    def _step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        pos = torch.tensor([position], dtype=torch.int64, device=tokens.device)
        out = self.runner.step_fn(self.cache, tokens, self.mask, pos)
        if not (isinstance(out, tuple) and len(out) == 2):  # a bare logits tensor would lose the cache
            raise TypeError(f"{self.runner.name}: step() returned {type(out).__name__}; expected (logits, cache)")
        logits, self.cache = out
        B, k = tokens.shape
        if not torch.is_tensor(logits) or tuple(logits.shape[:2]) != (B, k) or logits.dim() != 3:
            raise TypeError(f"{self.runner.name}: step() logits shape {tuple(getattr(logits, 'shape', ()))}: "
                            f"expected ({B}, {k}, vocab), one row per token fed")
        self.runner.sync()
        return logits

    def _prefill(self, input_ids, attention_mask):
        B, S = input_ids.shape
        self.cache = self.runner.new_cache(self.path, B, self.max_len)
        if self.cache is None:  # step() would run with no cache: wrong logits, read as a value finding
            raise AdapterError(f"{self.runner.name}: the adapter's new_cache({self.path!r}, {B}, {self.max_len}) returned "
                            "None: it must return the fresh cache that step() fills (CallableRunner's protocol, "
                            "docs/targets.md); this is the adapter's error, not a finding about the model")
        # static: the mask over the whole preallocated cache, off past the prompt
        self.mask = attention_mask if self.path == "concat" else pad_right(attention_mask, self.max_len, 0)
        return self._step(input_ids, 0)

    def _extend(self, tokens):
        t, k = self.written, tokens.shape[1]
        if self.path == "concat":
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, k)], dim=1)
        else:
            self.mask[:, t:t + k] = 1  # in place: its storage and shape stay as the prefill made them
        return self._step(tokens, t)

    def _crop(self, n):
        if self.path == "concat":
            self.mask = self.mask[:, :n].clone()
        else:
            self.mask[:, n:] = 0  # the slots past n are masked again: the mask is the source of truth
        self.cache = self.runner.crop_fn(self.cache, n)
        self.runner.sync()

    def _reorder(self, index):
        self.mask = self.mask.index_select(0, index)
        self.cache = self.runner.reorder_fn(self.cache, index)
        self.runner.sync()

    def kv(self):
        return [(k, v) for k, v in self.runner.kv_fn(self.cache)]


# the callables every CallableRunner needs, and what each is (the module doc's protocol)
REQUIRED = {
    "logits": "logits(input_ids, attention_mask) -> (B, T, V), the uncached forward",
    "new_cache": "new_cache(path, batch, max_len) -> a fresh cache, once per generation",
    "step": "step(cache, input_ids, attention_mask, position) -> (logits, cache)",
    "kv": "kv(cache) -> [(key, value) per layer], the stored tensors",
}


class CallableRunner(Runner):
    """A target from callables (the module docstring has the protocol).

    model         the nn.Module, on its device and dtype, in eval mode (the memory checks count
                  its weights; P3 hooks its `*Wqkv` modules)
    device        where it runs: queued work is synchronized before results are read
    cfg           the factory's ModelConfig (max_seq_len, vocab_size), if the model has no
                  `.config` with them
    logits, new_cache, step, kv, crop, reorder   the callables; crop/reorder None: that
                  operation is declared unsupported, with that reason
    name, capabilities, sync   as `GaudiStyleRunner`; buckets (cache_idx) are always unsupported
    """

    name = "callables"

    def __init__(self, model, device=None, *, logits: Callable, new_cache: Callable, step: Callable, kv: Callable,
                 crop: Callable | None = None, reorder: Callable | None = None, cfg=None, name: str | None = None,
                 capabilities: Capabilities | None = None, sync: Callable[[], None] | None = None):
        for what, fn in (("logits", logits), ("new_cache", new_cache), ("step", step), ("kv", kv),
                         ("crop", crop), ("reorder", reorder)):
            if fn is None and what in REQUIRED:  # at construction: not a failure at the first check that calls it
                raise AdapterError(f"CallableRunner {what}=None: expected a callable, {REQUIRED[what]}; logits, "
                                "new_cache, step and kv are required (crop and reorder may be None: unsupported)")
            if fn is not None and not callable(fn):
                raise AdapterError(f"CallableRunner {what}={fn!r} ({type(fn).__name__}): expected a callable"
                                + (f", {REQUIRED[what]}" if what in REQUIRED else ""))
        self.model, self.name = model, name or self.name
        self.logits_fn, self.new_cache, self.step_fn, self.kv_fn = logits, new_cache, step, kv
        self.crop_fn, self.reorder_fn = crop, reorder
        self.sync = sync or device_sync(device)
        self.max_seq_len, self.vocab_size = model_limits(model, cfg)
        detected = {"bucket": "CallableRunner has no cache_idx buckets"}
        detected.update({op: f"CallableRunner: no {op}= callable given" for op, fn in
                         (("crop", crop), ("reorder", reorder)) if fn is None})
        self.capabilities = with_declared(detected, capabilities)

    def logits(self, input_ids, attention_mask):
        check_prompt(input_ids, attention_mask, self.vocab_size, self.max_seq_len)  # before the model crashes inside
        out = self.logits_fn(input_ids, attention_mask)
        self.sync()
        return out

    def session(self, path, max_len, bucket=None):
        self.require(path, "bucket" if bucket else None)
        return CallableSession(self, path, max_len)
