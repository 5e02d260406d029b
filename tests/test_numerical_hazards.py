"""Numerical hazards: the properties still hold, or the failure says what happened.

- NaN/inf planted in the weights (an embedding row the prompt uses, a Wqkv entry): P0-P2
  fail saying NaN/inf appeared, in which tensor, how many elements and the first index;
  never a pass, never an obscure crash.
- clip_qkv under large activations (Wqkv scaled up until mixed_qkv is far past clip_qkv, or an
  inf entry that only the clamp turns finite): the properties hold.
- lengths right at max_seq_len (prompt + new == max_seq_len), bf16 included: they hold; one
  past it: an InputError naming the length and the limit.
"""

from __future__ import annotations

import re

import pytest
import torch

from mpt_kv.checks import properties as P
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.errors import InputError
from mpt_kv.targets import build, resolve

CFG = ModelConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32, max_seq_len=16)
CASE = P.Case(CFG, prompt_lens=(4, 6), new_tokens=3, seed=1)


def with_weights(cfg, change) -> dict:
    """random_state_dict(cfg) with `change(sd)` applied; the lm_head stays tied to wte."""
    sd = {k: v.clone() for k, v in random_state_dict(cfg, seed=CASE.seed).items()}
    change(sd)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return sd


def runners(target, cfg, sd, device, dtype):
    return build(target, cfg, sd, device, dtype), build("reference", cfg, sd, device, dtype)


def run_property(name, runner, reference, ctx):
    """One property by name; None where the target lacks the path it needs."""
    if ctx.path in runner.unsupported:
        return None
    if name == "P0":
        return P.check_oracle(runner, reference, ctx)
    if name == "P1":
        return P.check_cached_equals_uncached(runner, ctx)
    return P.check_static_equals_concat(runner, ctx)


PROPERTIES = [pytest.param("P0", None, id="P0"), pytest.param("P1", "concat", id="P1-concat"),
              pytest.param("P1", "static", id="P1-static"), pytest.param("P2", "static", id="P2")]


def check_holds(target, device, dtype, case, sd):
    """P0, P1 (both paths) and P2, each where the target supports its path; raises PropertyFailure.
    bf16 is compared with fp32 from the bf16-rounded weights: the reference's (P0), the target's own (P1, P2)."""
    runner = build(target, case.cfg, sd, device, dtype)
    reference = build("reference", case.cfg, P.rounded_state_dict(sd, dtype), device, torch.float32)
    twin = P.fp32_twin(resolve(target), case.cfg, sd, device, dtype)
    for p in PROPERTIES:
        name, path = p.values
        run_property(name, runner, reference, P.Context(target, device.type, dtype, case, path, fp32=twin))


# --- NaN / inf in the weights ---------------------------------------------------------------
def nan_embedding_of_prompt_token(sd):
    ids, _ = CASE.inputs("cpu")
    sd["transformer.wte.weight"][ids[1, 3]] = float("nan")  # row 1, a real (unpadded) position


def inf_in_wqkv(sd):
    sd["transformer.blocks.0.attn.Wqkv.weight"][0, 0] = float("inf")  # first q feature of layer 0


@pytest.mark.parametrize("plant", [nan_embedding_of_prompt_token, inf_in_wqkv], ids=["nan-embedding", "inf-wqkv"])
@pytest.mark.parametrize("prop,path", [("P0", None), ("P1", "concat"), ("P2", "static")])
def test_non_finite_weights_are_reported(target, device, plant, prop, path):
    """fp32 only: NaN spreads the same way in every dtype."""
    dtype = torch.float32
    runner, reference = runners(target, CFG, with_weights(CFG, plant), device, dtype)
    ctx = P.Context(target, device.type, dtype, CASE, path)
    runner.require(path)
    with pytest.raises(PropertyFailure) as failure:
        run_property(prop, runner, reference, ctx)
    message = str(failure.value)
    assert f"{prop} " in message and "NaN/inf appeared" in message, message
    assert re.search(r"got: [1-9]\d* NaN, \d+ inf of \d+ compared elements, first at \(\d+, \d+, \d+\)", message), message
    assert f"target={target}" in message and "case=B=2" in message, message


# --- large activations with clip_qkv -----------------------------------------------------------
def max_abs_mixed_qkv(runner, case, device) -> float:
    """Largest |Wqkv output| (before the clamp) over a full forward of the case's prompt."""
    capture = P.WqkvCapture(runner.wqkv_modules())
    try:
        with torch.inference_mode():
            runner.logits(*case.inputs(device))
        return max(out.detach().abs().max().item() for out in capture.outputs)
    finally:
        capture.close()


CLIP = 2.0
CLIPPED = ModelConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32, max_seq_len=16, clip_qkv=CLIP)
CLIPPED_CASE = P.Case(CLIPPED, prompt_lens=(4, 6), new_tokens=3, seed=1)


def scale_wqkv(factor):
    def change(sd):
        for k in sd:
            if k.endswith("Wqkv.weight"):
                sd[k] *= factor
    return change


def inf_in_every_wqkv(sd):
    for k in sd:
        if k.endswith("Wqkv.weight"):
            sd[k][0, 0], sd[k][-1, 1] = float("inf"), float("-inf")  # a q feature and a v feature


@pytest.mark.parametrize("change,at_least", [(scale_wqkv(30.0), 10 * CLIP), (inf_in_every_wqkv, float("inf"))],
                         ids=["wqkv-x30", "inf-in-wqkv"])
def test_clip_qkv_keeps_the_properties_under_large_activations(target, device, dtype, change, at_least):
    if dtype != torch.float32 and change is not inf_in_every_wqkv:
        # Wqkv x30 saturates attention: bf16 vs its fp32 twin is then ill-conditioned, not buggy
        # (measured with the calibrated bounds: the cached keys 2.3 x the K/V bound; x5 passes).
        # The clamp itself is dtype-independent; bf16 clipping runs in the drawn cases (clip 0.5).
        pytest.skip("scaled Wqkv runs in fp32 only: in bf16 the comparison with fp32 is ill-conditioned")
    sd = with_weights(CLIPPED, change)
    runner = build(target, CLIPPED, sd, device, dtype)
    peak = max_abs_mixed_qkv(runner, CLIPPED_CASE, device)
    assert peak >= at_least, f"the hazard is not there: max |mixed_qkv| = {peak:.3g}, clip_qkv = {CLIP}"
    check_holds(target, device, dtype, CLIPPED_CASE, sd)


# --- lengths at max_seq_len --------------------------------------------------------------------
MAX = 24
AT_MAX = ModelConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32, max_seq_len=MAX)
FULL_CASE = P.Case(AT_MAX, prompt_lens=(MAX - 4, 11), new_tokens=4, seed=3)  # prompt + new == max_seq_len


def test_properties_hold_at_max_seq_len(target, device, dtype):
    assert FULL_CASE.total_len == AT_MAX.max_seq_len
    check_holds(target, device, dtype, FULL_CASE, random_state_dict(AT_MAX, seed=FULL_CASE.seed))


@pytest.mark.parametrize("path", ["concat", "static"])
def test_one_step_past_max_seq_len_is_an_input_error(target, device, dtype, path):
    runner = build(target, AT_MAX, random_state_dict(AT_MAX), device, dtype)
    runner.require(path)
    with pytest.raises(InputError, match=rf"cache length max_len={MAX + 1} outside 1\.\.max_seq_len={MAX}"):
        runner.session(path, MAX + 1)
    session = runner.session(path, MAX)
    ids, mask = FULL_CASE.inputs(device)
    with torch.inference_mode():
        logits = session.prefill(ids, mask)[:, -1]
        for _ in range(FULL_CASE.new_tokens):
            logits = session.decode(P.greedy(logits))
        assert session.written == MAX
        with pytest.raises(InputError, match=rf"decode at position {MAX} is beyond the cache length max_len={MAX}"):
            session.decode(P.greedy(logits))
        one_more = torch.cat([ids, torch.zeros_like(ids[:, :5])], dim=1)
        with pytest.raises(InputError, match=rf"total length {MAX + 1} exceeds max_seq_len={MAX}"):
            runner.logits(one_more, torch.ones_like(one_more))
