"""What a check runs on: a `Case` (one input: a model shape, a left-padded batch, tokens to
generate, the mask's dtype) and a `Context` (where the check runs, for its messages, and what it
compares with). Every check of the MPT index takes `(runner, c: Context)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpt_kv.checks.compare import tolerance
from mpt_kv.model.config import ModelConfig
from mpt_kv.targets import resolve_target

MASK_DTYPES = (torch.bool, torch.int64, torch.int32)  # what the targets' APIs accept (docs/targets.md)
LATER_NEW_TOKENS = 8  # generations 2 and 3 decode at most this many (+2): they look for stale state, not length


@dataclass(frozen=True)
class Case:
    """One drawn input: a model shape, a left-padded batch of prompts, tokens to generate, and
    the dtype of the attention mask."""

    cfg: ModelConfig
    prompt_lens: tuple[int, ...]
    new_tokens: int
    seed: int = 0
    mask_dtype: torch.dtype = torch.int64

    def __post_init__(self):
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError(f"prompt_lens={self.prompt_lens}: every row needs at least 1 token")
        if self.new_tokens < 1:
            raise ValueError(f"new_tokens={self.new_tokens}: must be >= 1")
        if self.total_len > self.cfg.max_seq_len:
            raise ValueError(f"prompt {self.prompt_len} + new {self.new_tokens} = {self.total_len} "
                             f"exceeds max_seq_len={self.cfg.max_seq_len}")
        if self.mask_dtype not in MASK_DTYPES:
            raise ValueError(f"mask_dtype={self.mask_dtype}: expected one of {MASK_DTYPES}")

    @property
    def batch(self) -> int:
        return len(self.prompt_lens)

    @property
    def prompt_len(self) -> int:
        return max(self.prompt_lens)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.new_tokens

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids and mask (of `mask_dtype`), rows shorter than S left-padded (mask 0)."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, self.cfg.vocab_size, (self.batch, self.prompt_len), generator=g)
        mask = torch.zeros(self.batch, self.prompt_len, dtype=self.mask_dtype)
        for b, n in enumerate(self.prompt_lens):
            mask[b, self.prompt_len - n:] = 1
        return ids.to(device), mask.to(device)

    def generations(self) -> tuple["Case", "Case", "Case"]:
        """This layout, then two more of the same batch size that the value checks run back to
        back on the same model instance: a longer prompt (as far as max_seq_len allows) with the
        rows' padding reversed, then a shorter prompt with a longer generation and the padding
        rotated. Other tokens (seed + 1, + 2); a padding pattern always other than the first's
        where the batch has two rows and a prompt of two tokens."""
        P, n, M = self.prompt_len, self.new_tokens, self.cfg.max_seq_len
        pads = [P - n_row for n_row in self.prompt_lens]
        n2 = min(n, LATER_NEW_TOKENS)
        P2 = P + min(max(1, P // 2), M - P - n2)          # == P when already at max_seq_len
        P3 = max(1, P // 2)
        n3 = min(n2 + 2, M - P3)
        second = other_padding(pads[::-1], pads, P2)
        third = other_padding(pads[1:] + pads[:1], pads, P3)
        return (self,
                dataclasses.replace(self, prompt_lens=tuple(P2 - p for p in second), new_tokens=n2, seed=self.seed + 1),
                dataclasses.replace(self, prompt_lens=tuple(P3 - p for p in third), new_tokens=n3, seed=self.seed + 2))

    def describe(self) -> str:
        c = self.cfg
        return (f"B={self.batch} prompt_lens={list(self.prompt_lens)} new={self.new_tokens} H={c.n_heads} "
                f"hd={c.head_dim} L={c.n_layers} clip_qkv={c.clip_qkv} max_seq_len={c.max_seq_len} "
                f"mask={str(self.mask_dtype).replace('torch.', '')} seed={self.seed} alibi_bias_max={c.alibi_bias_max} "
                f"eps={c.layer_norm_epsilon:g} vocab={c.vocab_size}")


def other_padding(pads: list[int], avoid: list[int], length: int) -> list[int]:
    """Left-padding amounts for a prompt of `length`: `pads` clipped to leave every row a token,
    shifted so the longest row is unpadded, and changed in its last row if it equals `avoid`."""
    pads = [min(p, length - 1) for p in pads]
    pads = [p - min(pads) for p in pads]
    if pads == avoid and len(pads) > 1 and length > 1:
        pads[-1] = (pads[-1] + 1) % length
        pads = [p - min(pads) for p in pads]
    return pads


@dataclass
class Context:
    """Where a check runs, for its messages, and what it compares with. The run layer
    (`mpt_kv.checks.running`) fills what a property needs besides the runner:

    fp32       the oracle of a lower-precision run: the same target built in float32 from the
               rounded weights (the fp32-twin rule); required when `dtype` is not float32
    reference  P0's oracle: the reference in float32 from the (rounded) weights
    program    the ops checks' program of cache operations (`mpt_kv.checks.programs.Program`), and
    fed        what records the input shapes fed to the target (on HPU each is a graph compile)
    operation  ops-memory's operation ("reorder" or "extend")
    ceilings   the memory check's stored ceilings (`mpt_kv.checks.ceilings.StoredCeilings`), or None
    record     where a check records measurements for the report: record(name, value)"""

    target: str
    device: str
    dtype: torch.dtype
    case: Case
    path: str | None = None
    bucket: int | None = None
    notes: list[str] = field(default_factory=list)
    fp32: object | None = None
    generation: int | None = None
    reference: object | None = None
    program: object | None = None
    fed: object | None = None
    operation: str | None = None
    ceilings: object | None = None
    record: Callable[[str, object], None] = lambda name, value: None

    def tol(self, quantity: str = "logits:static"):
        return tolerance(self.dtype, quantity)

    def tol_kv(self):
        return tolerance(self.dtype, "kv:static")

    def ctx(self, **more) -> dict:
        """The failure context (`mpt_kv.errors.describe`): target, device, dtype, path, bucket, case."""
        base = dict(target=self.target, device=self.device, dtype=str(self.dtype).replace("torch.", ""),
                    path=self.path, bucket=self.bucket,
                    generation=None if self.generation is None else f"{self.generation}/3",
                    case=self.case.describe())
        return {**base, **more}

    def for_generation(self, g: int, case: Case) -> "Context":
        return dataclasses.replace(self, case=case, generation=g)  # the notes list is shared


def rounded_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """The weights as a `dtype` model holds them, back in float32: what its fp32 twin loads."""
    return {k: v.to(dtype).to(torch.float32) if v.is_floating_point() else v for k, v in state_dict.items()}


# --- the oracles: the fp32-twin rule, P0's reference -----------------------------------------------------

def fp32_twin(target, cfg: ModelConfig, state_dict: dict, device, dtype: torch.dtype, caps=None):
    """The fp32-twin rule: the oracle of a `dtype` run is the same target (a spec, a factory or a
    ResolvedTarget) in float32, built from the weights rounded to `dtype`, so each path of a lower
    precision carries one rounding error, not two (bf16 against bf16 adds two of opposite signs);
    the reference's, where the target declares no float32 (`caps`, read from it when not given).
    None when `dtype` is float32: the target's own paths are the oracle."""
    if dtype == torch.float32:
        return None
    target, device = resolve_target(target), torch.device(device)
    caps = caps if caps is not None else target.capabilities(device, dtype)
    twin = target if caps.reason("fp32") is None else resolve_target("reference")
    return twin.build(cfg, rounded_state_dict(state_dict, dtype), device, torch.float32)


def reference_oracle(cfg: ModelConfig, state_dict: dict, device, dtype: torch.dtype):
    """P0's oracle: the reference in float32 from the weights rounded to `dtype` (the target's own
    rounding is then the whole error)."""
    return resolve_target("reference").build(cfg, rounded_state_dict(state_dict, dtype), torch.device(device),
                                             torch.float32)


