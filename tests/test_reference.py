"""The oracle itself: ALiBi and weights exactly as transformers' MPT, left padding, generation."""

import pytest
import torch

from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.checks.properties import Case
from mpt_kv.model.reference import ReferenceMPT, alibi_bias
from mpt_kv.targets import build


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16])
def test_alibi_matches_transformers(n_heads):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    cfg = ModelConfig(d_model=n_heads * 4, n_heads=n_heads, max_seq_len=24)
    torch.testing.assert_close(alibi_bias(cfg), build_mpt_alibi_tensor(n_heads, 24, 8), rtol=0, atol=0)


def test_weights_round_trip_through_transformers_format():
    from transformers import MptForCausalLM

    cfg = ModelConfig(n_layers=3, clip_qkv=2.0)
    sd = random_state_dict(cfg, seed=3)
    hf = MptForCausalLM(cfg.to_hf())
    hf.load_state_dict(sd, strict=True)
    exported = ReferenceMPT(cfg).load_hf_state_dict(hf.state_dict()).hf_state_dict()
    assert exported.keys() == hf.state_dict().keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, sd[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("path,bucket", [("concat", None), ("static", None), ("static", 4)])
def test_left_padded_row_generates_like_its_unpadded_twin(path, bucket):
    """A 5-token prompt alone, and left-padded to 8 beside a full row: same logits, same tokens."""
    cfg = ModelConfig(n_heads=3, d_model=24, n_layers=2, max_seq_len=32)
    runner = build("reference", cfg, random_state_dict(cfg, seed=1), "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    prompt, other = torch.randint(1, cfg.vocab_size, (5,), generator=g), torch.randint(1, cfg.vocab_size, (8,), generator=g)
    padded = torch.stack([torch.cat([torch.full((3,), 7), prompt]), other])   # pad id 7: any id works
    padded_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    with torch.inference_mode():
        alone, batched = runner.session(path, 5 + 6, bucket), runner.session(path, 8 + 6, bucket)
        a = alone.prefill(prompt[None], torch.ones(1, 5, dtype=torch.long))[:, -1]
        b = batched.prefill(padded, padded_mask)[:, -1]
        for step in range(6):
            torch.testing.assert_close(b[0], a[0], rtol=0, atol=2e-4, msg=f"step {step}")
            token = a.argmax(-1, keepdim=True)
            a, b = alone.decode(token), batched.decode(torch.cat([token, b[1:].argmax(-1, keepdim=True)]))


def test_greedy_generation_static_equals_concat_tokens():
    cfg = ModelConfig(n_heads=6, d_model=48, n_layers=2, max_seq_len=32)
    case = Case(cfg, (7, 2, 5), new_tokens=12, seed=4)
    runner = build("reference", cfg, random_state_dict(cfg, seed=4), "cpu", torch.float32)
    ids, mask = case.inputs("cpu")
    tokens = {}
    with torch.inference_mode():
        for path, bucket in [("concat", None), ("static", None), ("static", 8)]:
            session, out = runner.session(path, case.total_len, bucket), []
            logits = session.prefill(ids, mask)[:, -1]
            for _ in range(case.new_tokens):
                out.append(logits.argmax(-1, keepdim=True))
                logits = session.decode(out[-1])
            tokens[(path, bucket)] = torch.cat(out, 1)
    assert torch.equal(tokens[("static", None)], tokens[("concat", None)])
    assert torch.equal(tokens[("static", 8)], tokens[("concat", None)])
