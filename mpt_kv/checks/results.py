"""The copy rule: every tensor a check receives from a target is copied at once, before the
target runs again.

A target may return a buffer that its next call overwrites: a CUDA graph or HPU graph replay
returns the graph's static output tensor (optimum-habana generates with `--use_hpu_graphs`).
Kept without a copy, P1's "cached" prefill logits and its "uncached" logits would be one
buffer compared with itself, and a cache bug inside such a target would pass. Every check
therefore talks to the target through `copied(runner)`; `assert_close` refuses two tensors
that share memory, so a forgotten copy fails loudly instead of passing.

Whether a target reuses its outputs is a property of its own (P4, `check_outputs_not_reused`):
allowed when it declares `Capabilities(graph_outputs=True)`.
"""

from __future__ import annotations

import torch


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy that owns its memory: what the target does to its buffer later cannot reach it."""
    return t.detach().clone()


class CopiedSession:
    """A session whose `prefill`, `decode` and `kv` return copies. `live` is the target's own
    session, for what must touch the real cache (P2 poisons unwritten static slots)."""

    def __init__(self, session):
        self.live = session

    def __getattr__(self, name):  # path, written, mask, max_len, ...: the live session's state
        return getattr(self.live, name)

    def prefill(self, input_ids, attention_mask):
        return snapshot(self.live.prefill(input_ids, attention_mask))

    def decode(self, tokens):
        return snapshot(self.live.decode(tokens))

    def kv(self):
        return [(snapshot(k), snapshot(v)) for k, v in self.live.kv()]


class CopiedRunner:
    """A runner whose uncached forwards and sessions hand back copies (see the module doc)."""

    def __init__(self, runner):
        self.live = runner

    def __getattr__(self, name):  # name, model, capabilities, require, wqkv_modules, ...
        return getattr(self.live, name)

    def logits(self, input_ids, attention_mask):
        return snapshot(self.live.logits(input_ids, attention_mask))

    def session(self, path, max_len, bucket=None):
        return CopiedSession(self.live.session(path, max_len, bucket))


def copied(runner):
    """`runner` as every value check sees it; idempotent."""
    return runner if isinstance(runner, CopiedRunner) or runner is None else CopiedRunner(runner)
