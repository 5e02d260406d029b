"""owngqa's own tests: its caches against its own uncached forward, and mpt-kv's family checks in this
file too (`parametrize_with_checks`, docs/targets.md), beside the shipped suite its CI runs."""

import torch

import mpt_kv
from owngqa import OwnGqaConfig, OwnGqaForCausalLM
from owngqa.mpt_kv_target import build

CFG = OwnGqaConfig(vocab_size=32, hidden_size=16, n_heads=4, n_kv_heads=2, head_dim=4, n_layers=2,
                   intermediate_size=32, window=3)


def model():
    torch.manual_seed(0)
    return OwnGqaForCausalLM(CFG).eval()


def test_cached_decode_past_the_window_equals_the_full_forward_on_both_caches():
    m, ids = model(), torch.randint(0, CFG.vocab_size, (2, 8))
    full, _ = m(ids)
    for path in ("concat", "static"):
        cache = m.new_cache(path, 2, 8)
        mask = torch.ones(2, 8 if path == "static" else 4, dtype=torch.long)
        out, cache = m(ids[:, :4], cache=cache, position=torch.tensor([0]), attention_mask=mask)  # longer than the window
        assert torch.allclose(out, full[:, :4], atol=1e-5), path
        for t in range(4, 8):
            step, cache = m(ids[:, t:t + 1], cache=cache, position=torch.tensor([t]),
                            attention_mask=mask if path == "static" else torch.ones(2, t + 1, dtype=torch.long))
            assert torch.allclose(step[:, 0], full[:, t], atol=1e-5), (path, t)
        held = cache.kv()[0][0].shape[2]
        assert held == (CFG.window - 1 if path == "concat" else CFG.window), (path, held)


def test_a_crop_after_a_k_token_call_takes_back_what_it_evicted():
    m, ids = model(), torch.randint(0, CFG.vocab_size, (1, 8))
    full, _ = m(ids)
    for path in ("concat", "static"):
        mask = torch.ones(1, 8 if path == "static" else 4, dtype=torch.long)
        cache = m(ids[:, :4], cache=m.new_cache(path, 1, 8), position=torch.tensor([0]), attention_mask=mask)[1]
        _, cache = m(ids[:, 4:7], cache=cache, position=torch.tensor([4]),
                     attention_mask=mask if path == "static" else torch.ones(1, 7, dtype=torch.long))
        cache = cache.crop(5)  # back across the window's edge
        step, _ = m(ids[:, 5:6], cache=cache, position=torch.tensor([5]),
                    attention_mask=mask if path == "static" else torch.ones(1, 6, dtype=torch.long))
        assert torch.allclose(step[:, 0], full[:, 5], atol=1e-5), path


@mpt_kv.parametrize_with_checks([build], checks=["family-P0", "family-P3", "family-memory"])
def test_owngqa(check, target, device, dtype):
    check(target, device, dtype)
