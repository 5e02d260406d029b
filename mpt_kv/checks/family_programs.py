"""family-ops' fixed programs (`mpt_kv.checks.family.check_operations` runs both, each on its own session):
a beam program (decode, reorder by a permutation, decode, reorder with a repeat, decode) and an assisted
program (extend 3, crop back 2, decode, extend 3), batch 3 (`OPS_PADS`), prompt `OPS_PROMPT`, each call judged
against transformers' uncached forward over each row's surviving history (`mpt_kv.checks.programs.History`),
and the rule for how many positions a call's logits may cover."""

from __future__ import annotations

import torch

from mpt_kv.checks.compare import Crash, PropertyFailure, assert_close, describe
from mpt_kv.checks.family_driver import OPS_PADS, OPS_PROMPT, FamilyContext, copy_of, observed, prompt, teacher_tokens
from mpt_kv.checks.programs import History, Op


def returned_positions(c: FamilyContext, what: str, logits: torch.Tensor, tokens: int, operation: str, step) -> int:
    """The positions a call's logits cover, held to the call: an extend or a decode one per token it fed
    (assisted decoding's verification reads every one of the k), a prefill the prompt's or its last alone
    (optimum-habana's --trim_logits, generate's next token: models/llama/modeling_llama.py:1477-1481;
    transformers' generate keeps the last too). Anything else fails the property, naming what came back."""
    got = 1 if logits.dim() == 2 else logits.shape[1]
    allowed = (tokens, 1) if operation == "prefill" else (tokens,)
    if got not in allowed:
        raise PropertyFailure(f"{what}: the implementation's {operation} of {tokens} tokens per row returned logits "
                              f"for {got} positions, expected {' or '.join(map(str, allowed))} "
                              f"[{describe(c.ctx(step=step, operation=operation))}]")
    return got


def last_positions(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, None] if logits.dim() == 2 else logits


def beam_program():
    ops = []
    for order in ((2, 0, 1), (1, 1, 0)):
        ops += [Op("decode"), Op("reorder", index=order)]
    return "beam", ("reorder",), ops + [Op("decode")]


def assisted_program():
    return "assisted", ("extend", "crop"), [Op("extend", 3), Op("crop", 2), Op("decode"), Op("extend", 3)]


def run_program(runner, c: FamilyContext, name: str, ops) -> None:
    """One fixed program on a fresh session: P1 after every logits-producing operation."""
    ids, mask = c.inputs(*prompt(c.config, c.seed, pads=OPS_PADS, length=OPS_PROMPT))
    tol = c.tol(f"logits:{c.session_path}")
    session = c.session(runner)
    history = History(ids, mask)
    out = copy_of(observed(c, session, "prefill", ids.shape[1], f"family-ops {name}", "prefill", session.prefill,
                           ids, mask))
    k = returned_positions(c, f"family-ops {name} prefill", out, ids.shape[1], "prefill", "prefill")
    out = out[:, None] if out.dim() == 2 else out
    assert_close(out, c.oracle(ids, mask)[:, -k:], tol, f"family-ops {name} prefill logits vs transformers' uncached "
                 "forward", c.ctx(program=name, step="prefill", operation="prefill"), where=mask.bool()[:, -k:, None])
    held = ["prefill"]  # each step is judged as it comes: a crash names those before it
    try:
        program_steps(c, name, ops, session, history, tol, held)
    except Crash as crash:
        raise crash.held(held)


def program_steps(c: FamilyContext, name: str, ops, session, history, tol, held: list) -> None:
    for i, op in enumerate(ops):
        what = f"family-ops {name} step {i} ({op.describe()})"
        tokens = c.inputs(teacher_tokens(c.config, c.batch, op.k, i)) if op.kind in ("decode", "extend") else None
        if op.kind == "decode":
            out = last_positions(copy_of(observed(c, session, "decode", tokens.shape[1], what, i, session.decode,
                                                  tokens)))
        elif op.kind == "extend":
            out = copy_of(observed(c, session, "extend", tokens.shape[1], what, i, session.extend, tokens))
            returned_positions(c, what, out, op.k, "extend", i)
        elif op.kind == "crop":
            length = session.written - op.k
            out = observed(c, session, "crop", length, what, i, session.crop, length)
        else:
            out = observed(c, session, "reorder", None, what, i, session.reorder,
                           torch.tensor(op.index, device=c.device))
        history.apply(op, tokens)
        if out is not None:
            full = c.oracle(history.ids, history.mask)
            assert_close(out, full[:, -op.k:], tol, f"{what}: logits vs transformers' uncached forward over each "
                         f"row's surviving history ({history.ids.shape[1]} positions)",
                         c.ctx(program=name, step=i, operation=op.kind))
            held.append(f"step {i} ({op.describe()})")  # a crop or reorder is judged by the next logits call
