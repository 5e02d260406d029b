"""ownmpt's own tests (unmarked: `pytest -m cpu` deselects them, so CI runs a plain `pytest` too)."""

import torch

from ownmpt import OwnMptConfig, OwnMptForCausalLM

CFG = OwnMptConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32, max_seq_len=16)


def model():
    torch.manual_seed(0)
    return OwnMptForCausalLM(CFG).eval()


def test_cached_decode_equals_the_full_forward_on_both_caches():
    m, ids = model(), torch.randint(0, CFG.vocab_size, (2, 6))
    full, _ = m(ids)
    for path in ("concat", "static"):
        cache, mask = m.new_cache(path, 2, 6), torch.ones(2, 6 if path == "static" else 4, dtype=torch.long)
        if path == "static":
            mask[:, 4:] = 0
        out, cache = m(ids[:, :4], past=cache, position=torch.tensor([0]), attention_mask=mask)
        for t in (4, 5):
            if path == "static":
                mask[:, t] = 1
            else:
                mask = torch.ones(2, t + 1, dtype=torch.long)
            step, cache = m(ids[:, t:t + 1], past=cache, position=torch.tensor([t]), attention_mask=mask)
            assert torch.allclose(step[:, 0], full[:, t], atol=1e-5), (path, t)


def test_the_state_dict_layout_is_transformers_mpt():
    names = set(model().state_dict())
    assert {"transformer.wte.weight", "transformer.blocks.1.attn.Wqkv.weight", "transformer.norm_f.weight"} <= names
