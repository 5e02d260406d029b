"""Bad input gets an `InputError` that names the value and the limit: never silent corruption,
never a bare IndexError from deep inside torch.

Two layers: the reference model itself (`ReferenceMPT.forward` with a cache, `token_idx`,
`cache_idx`), and every target's adapter (`Session.prefill`/`decode`, `Runner.logits`), which
check in one place (session.py) before the target sees the input. Without those checks
transformers' MPT raises IndexError on an id past the vocabulary or a batch mismatch,
RuntimeError past max_seq_len, and silently accepts a short or float mask.
"""

from __future__ import annotations

import pytest
import torch

from mpt_kv.model.cache import StaticCache
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.errors import InputError
from mpt_kv.model.reference import ReferenceMPT
from mpt_kv.targets import build

CFG = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
CACHE_LEN = 6  # shorter than max_seq_len, so a cache limit and the model limit read differently


@pytest.fixture(scope="module")
def model() -> ReferenceMPT:
    return ReferenceMPT(CFG).load_hf_state_dict(random_state_dict(CFG)).eval()


def prompt(batch=2, length=3):
    return torch.randint(0, CFG.vocab_size, (batch, length)), torch.ones(batch, length, dtype=torch.long)


def prefilled_static(model, batch=2, length=3):
    """A static cache of CACHE_LEN after a prefill of `length` tokens: the next step is token_idx=length+1."""
    cache = model.new_cache("static", batch, CACHE_LEN)
    ids, mask = prompt(batch, length)
    model(ids, mask, cache)
    return cache


def one_token(batch=2):
    return torch.randint(0, CFG.vocab_size, (batch, 1))


# --- the reference: token_idx, cache_idx, lengths --------------------------------------------
@pytest.mark.parametrize("token_idx", [0, -1, CACHE_LEN + 1])
def test_reference_token_idx_outside_cache(model, token_idx):
    cache = prefilled_static(model)
    with pytest.raises(InputError, match=rf"token_idx={token_idx} outside 1\.\.{CACHE_LEN}"):
        model(one_token(), torch.ones(2, CACHE_LEN, dtype=torch.long), cache, torch.tensor([token_idx]))


@pytest.mark.parametrize("cache_idx", [CACHE_LEN + 1, 3])  # beyond the cache; before token_idx=4
def test_reference_cache_idx_outside_cache(model, cache_idx):
    cache = prefilled_static(model)
    with pytest.raises(InputError, match=rf"cache_idx={cache_idx} outside 4\.\.{CACHE_LEN}"):
        model(one_token(), torch.ones(2, cache_idx, dtype=torch.long), cache, torch.tensor([4]), cache_idx)


def test_reference_prefill_longer_than_static_cache(model):
    cache = model.new_cache("static", 2, CACHE_LEN)
    with pytest.raises(InputError, match=rf"prefill of 7 tokens exceeds the static cache length {CACHE_LEN}"):
        model(*prompt(2, 7), cache)


def test_reference_full_forward_beyond_max_seq_len(model):
    with pytest.raises(InputError, match=r"total length 9 exceeds max_seq_len=8"):
        model(*prompt(2, 9))


def test_reference_concat_decode_beyond_max_seq_len(model):
    cache = model.new_cache("concat", 2)
    model(*prompt(2, 8), cache)
    with pytest.raises(InputError, match=r"total length 9 exceeds max_seq_len=8"):
        model(one_token(), torch.ones(2, 9, dtype=torch.long), cache)


def test_reference_static_cache_longer_than_max_seq_len(model):
    with pytest.raises(InputError, match=r"static cache length 9 exceeds max_seq_len=8"):
        model.new_cache("static", 2, 9)


def test_reference_token_id_outside_vocab(model):
    ids, mask = prompt()
    ids[1, 2] = CFG.vocab_size
    with pytest.raises(InputError, match=r"token id out of range \[0, 16\): min \d+, max 16"):
        model(ids, mask)


# --- the reference: a cache that does not match the input -------------------------------------
def static_cache(batch=2, n_heads=CFG.n_heads, head_dim=CFG.head_dim, dtype=torch.float32, device="cpu",
                 n_layers=CFG.n_layers):
    return StaticCache(n_layers, batch, n_heads, CACHE_LEN, head_dim, dtype, device)


@pytest.mark.parametrize("cache,match", [
    pytest.param(static_cache(batch=3), r"\(batch, heads, head_dim\) = \(3, 2, 4\) does not match the input's \(2, 2, 4\)",
                 id="batch"),
    pytest.param(static_cache(n_heads=1), r"= \(2, 1, 4\) does not match the input's \(2, 2, 4\)", id="heads"),
    pytest.param(static_cache(head_dim=8), r"= \(2, 2, 8\) does not match the input's \(2, 2, 4\)", id="head_dim"),
    pytest.param(static_cache(dtype=torch.float64), r"cache dtype torch.float64 does not match the model's torch.float32",
                 id="dtype"),
    # meta: the one other device every machine has; the check must fire before any kernel runs
    pytest.param(static_cache(device="meta"), r"cache is on meta but input_ids are on cpu", id="device"),
    pytest.param(static_cache(n_layers=2), r"cache has 2 layers, the model 1", id="layers"),
])
def test_reference_cache_mismatch_at_prefill(model, cache, match):
    with pytest.raises(InputError, match=match):
        model(*prompt(2, 3), cache)


def test_reference_cache_batch_mismatch_at_decode(model):
    cache = prefilled_static(model, batch=2)
    with pytest.raises(InputError, match=r"= \(2, 2, 4\) does not match the input's \(1, 2, 4\)"):
        model(one_token(1), torch.ones(1, CACHE_LEN, dtype=torch.long), cache, torch.tensor([4]))


def test_reference_concat_cache_batch_mismatch_at_decode(model):
    cache = model.new_cache("concat", 2)
    model(*prompt(2, 3), cache)
    with pytest.raises(InputError, match=r"= \(2, 2, 4\) does not match the input's \(3, 2, 4\)"):
        model(one_token(3), torch.ones(3, 4, dtype=torch.long), cache)


# --- the reference: the attention mask ------------------------------------------------------
BAD_MASKS = [  # (id, mask for a (2, 3) prompt, what the message must say)
    ("short", torch.ones(2, 2, dtype=torch.long), r"attention_mask shape \(2, 2\): expected \(2, 3\)"),
    ("long", torch.ones(2, 4, dtype=torch.long), r"attention_mask shape \(2, 4\): expected \(2, 3\)"),
    ("batch", torch.ones(1, 3, dtype=torch.long), r"attention_mask shape \(1, 3\): expected \(2, 3\)"),
    ("4d", torch.ones(2, 1, 1, 3, dtype=torch.bool), r"attention_mask shape \(2, 1, 1, 3\): expected \(2, 3\)"),
    ("float", torch.ones(2, 3), r"attention_mask dtype torch.float32: expected bool or integer"),
    ("all-masked-row", torch.tensor([[1, 1, 1], [0, 0, 0]]), r"attention_mask rows \[1\] mask every one of their 3 positions"),
]


@pytest.mark.parametrize("mask,match", [pytest.param(m, s, id=i) for i, m, s in BAD_MASKS])
def test_reference_bad_mask(model, mask, match):
    with pytest.raises(InputError, match=match):
        model(prompt(2, 3)[0], mask)


def test_reference_static_decode_mask_shorter_than_cache(model):
    cache = prefilled_static(model)
    with pytest.raises(InputError, match=rf"attention_mask shape \(2, 4\): expected \(2, {CACHE_LEN}\)"):
        model(one_token(), torch.ones(2, 4, dtype=torch.long), cache, torch.tensor([4]))


# --- every target's adapter -----------------------------------------------------------------
@pytest.fixture
def runner(target, device):
    return build(target, CFG, random_state_dict(CFG), device, torch.float32)


def open_session(runner, path, max_len):
    runner.require(path)
    return runner.session(path, max_len)


def on(device, ids, mask):
    return ids.to(device), mask.to(device)


BAD_PROMPTS = [  # (id, (ids, mask) for a (2, 4) prompt -> bad input, what the message must say)
    ("id-past-vocab", lambda ids, m: (ids.index_fill(1, torch.tensor([2]), 16), m),
     r"input_ids: token id out of range \[0, 16\): min \d+, max 16"),
    ("negative-id", lambda ids, m: (ids.index_fill(1, torch.tensor([0]), -1), m),
     r"input_ids: token id out of range \[0, 16\): min -1"),
    ("float-ids", lambda ids, m: (ids.float(), m), r"input_ids dtype torch.float32: expected an integer dtype"),
    ("1d-ids", lambda ids, m: (ids[0], m), r"input_ids shape \(4,\): expected \(batch, length\)"),
    ("mask-short", lambda ids, m: (ids, m[:, :3]), r"attention_mask shape \(2, 3\): expected \(2, 4\)"),
    ("mask-batch", lambda ids, m: (ids, m[:1]), r"attention_mask shape \(1, 4\): expected \(2, 4\)"),
    ("mask-float", lambda ids, m: (ids, m.float()), r"attention_mask dtype torch.float32: expected bool or integer"),
    ("mask-row-all-zero", lambda ids, m: (ids, m.index_fill(0, torch.tensor([1]), 0)),
     r"attention_mask rows \[1\] mask every one of their 4 positions"),
]
BAD_PROMPT_PARAMS = [pytest.param(f, s, id=i) for i, f, s in BAD_PROMPTS]


@pytest.mark.parametrize("path", ["concat", "static"])
@pytest.mark.parametrize("spoil,match", BAD_PROMPT_PARAMS)
def test_adapter_prefill_rejects_bad_prompt(runner, device, path, spoil, match):
    session = open_session(runner, path, 6)
    with pytest.raises(InputError, match=match):
        session.prefill(*on(device, *spoil(*prompt(2, 4))))
    assert session.written == 0, "a rejected prefill must leave the session empty"


@pytest.mark.parametrize("spoil,match", BAD_PROMPT_PARAMS)
def test_adapter_uncached_forward_rejects_bad_prompt(runner, device, spoil, match):
    with pytest.raises(InputError, match=match):
        runner.logits(*on(device, *spoil(*prompt(2, 4))))


def test_adapter_uncached_forward_beyond_max_seq_len(runner, device):
    with pytest.raises(InputError, match=r"total length 9 exceeds max_seq_len=8"):
        runner.logits(*on(device, *prompt(2, 9)))


@pytest.mark.parametrize("path", ["concat", "static"])
def test_adapter_session_longer_than_max_seq_len(runner, path):
    with pytest.raises(InputError, match=r"cache length max_len=9 outside 1\.\.max_seq_len=8"):
        open_session(runner, path, 9)


@pytest.mark.parametrize("path", ["concat", "static"])
def test_adapter_prompt_longer_than_cache(runner, device, path):
    session = open_session(runner, path, 4)
    with pytest.raises(InputError, match=r"prompt length 5 exceeds the cache length max_len=4"):
        session.prefill(*on(device, *prompt(2, 5)))


@pytest.mark.parametrize("path,max_len", [("concat", 5), ("static", 5), ("concat", 8), ("static", 8)])
def test_adapter_decode_beyond_cache(runner, device, path, max_len):
    """The adapter's token_idx runs out of cache: at max_len=8 also out of max_seq_len, where
    transformers' MPT would crash inside its ALiBi broadcast."""
    session = open_session(runner, path, max_len)
    session.prefill(*on(device, *prompt(2, 4)))
    for _ in range(max_len - 4):
        session.decode(one_token().to(device))
    with pytest.raises(InputError, match=rf"decode at position {max_len} is beyond the cache length max_len={max_len}"):
        session.decode(one_token().to(device))


@pytest.mark.parametrize("path", ["concat", "static"])
@pytest.mark.parametrize("tokens,match", [
    pytest.param(lambda: one_token(3), r"decode tokens shape \(3, 1\): expected \(2, 1\)", id="batch"),
    pytest.param(lambda: torch.zeros(2, 2, dtype=torch.long), r"decode tokens shape \(2, 2\): expected \(2, 1\)",
                 id="two-tokens"),
    pytest.param(lambda: torch.full((2, 1), 16), r"decode tokens: token id out of range \[0, 16\): min 16, max 16",
                 id="id-past-vocab"),
    pytest.param(lambda: torch.zeros(2, 1), r"decode tokens dtype torch.float32: expected an integer", id="float"),
])
def test_adapter_decode_rejects_bad_tokens(runner, device, path, tokens, match):
    session = open_session(runner, path, 6)
    session.prefill(*on(device, *prompt(2, 4)))
    with pytest.raises(InputError, match=match):
        session.decode(tokens().to(device))
    assert session.written == 4, "a rejected decode step must not advance the session"


def test_adapter_decode_on_another_device(runner, device):
    session = open_session(runner, "concat", 6)
    session.prefill(*on(device, *prompt(2, 4)))
    with pytest.raises(InputError, match=rf"decode tokens on meta but the cache is on {device.type}"):
        session.decode(torch.zeros(2, 1, dtype=torch.long, device="meta"))


def test_adapter_decode_before_prefill(runner):
    with pytest.raises(InputError, match=r"decode before prefill"):
        open_session(runner, "concat", 6).decode(one_token())


def test_adapter_prefill_twice(runner, device):
    session = open_session(runner, "concat", 6)
    session.prefill(*on(device, *prompt(2, 3)))
    with pytest.raises(InputError, match=r"prefill called twice on one session"):
        session.prefill(*on(device, *prompt(2, 3)))
