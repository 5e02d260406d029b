"""Greedy generation over a `Session`: the loop optimum-habana's and transformers' `generate`
run, without sampling, stopping criteria or streaming.

The session owns the cache protocol (static padding, `token_idx`, the growing mask); this loop
only feeds each row its argmax back. N new tokens take N forwards: the prefill gives the first,
each decode step one more, and the last token is never fed back (nothing would read its K/V).
"""

from __future__ import annotations

from typing import Callable

import torch

from mpt_kv.errors import InputError
from mpt_kv.model.session import Session

# on_step(step, tokens): called after the forward that produced token `step` of every row
# (step 0 = the prefill, then 1..N-1 the decode steps), tokens (B,) on the device.
OnStep = Callable[[int, torch.Tensor], None]


@torch.inference_mode()
def greedy_generate(session: Session, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    max_new_tokens: int, on_step: OnStep | None = None) -> torch.Tensor:
    """(B, S) left-padded prompt, mask 1 = token -> (B, max_new_tokens) greedy tokens."""
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    # Only the last position's logits are needed; taking the argmax and letting the (B, S, V)
    # prefill logits go before the first decode step keeps them out of its memory.
    token = session.prefill(input_ids, attention_mask)[:, -1].argmax(-1)   # (B,)
    tokens = [token]
    if on_step:
        on_step(0, token)
    for step in range(1, max_new_tokens):
        token = session.decode(token[:, None]).argmax(-1)                 # (B,)
        tokens.append(token)
        if on_step:
            on_step(step, token)
    return torch.stack(tokens, dim=1)
