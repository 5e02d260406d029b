"""The analytic memory model: formulas, the seed table, the CLI."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpt_kv.cli import memory as memory_cli
from mpt_kv.memory.analytic import (
    GiB, PRESETS, SEED_TABLE, TOLERANCE, estimate, gaudi_seed_terms, kv_cache_bytes, leave_one_out,
    n_params, scratch_multiple, seed_comparison, seed_units, untied_lm_head_bytes, view_retention_bytes,
    weights_bytes,
)
from mpt_kv.memory.meter import CpuMeter

TINY, MPT7B = PRESETS["tiny"], PRESETS["mpt-7b"]


def test_kv_cache_by_hand():
    # tiny: 2 layers, 4 heads of 16; batch 3, 10 positions, bf16:
    # 2 (k, v) * 2 layers * 3 * 4 * 10 * 16 * 2 bytes
    assert kv_cache_bytes(TINY, batch=3, length=10, itemsize=2) == 15360
    # mpt-7b bf16: 2 * 32 layers * 4096 * 2 bytes = 0.5 MiB per token
    assert kv_cache_bytes(MPT7B, 1, 1, 2) == 512 * 1024


def test_mpt7b_weights():
    assert n_params(MPT7B) == 6_649_286_656  # "6.7B"
    assert weights_bytes(MPT7B, 2) == pytest.approx(6.65e9 * 2, rel=1e-3)


def test_param_count_matches_transformers():
    from transformers import MptConfig, MptForCausalLM

    cfg = MptConfig(d_model=TINY.d_model, n_heads=TINY.n_heads, n_layers=TINY.n_layers,
                    vocab_size=TINY.vocab_size, max_seq_len=TINY.max_seq_len)
    model = MptForCausalLM(cfg)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # lm_head is tied
    assert sum(unique.values()) == n_params(TINY)


def test_views_keep_one_unit_per_layer_more():
    # q third: half of what k + v take
    assert view_retention_bytes(MPT7B, 8, 256, 2) * 2 == kv_cache_bytes(MPT7B, 8, 256, 2)
    fixed = estimate(MPT7B, 8, 128, 128, 2, fixed=True)
    views = estimate(MPT7B, 8, 128, 128, 2, fixed=False)
    assert views.allocated_after - fixed.allocated_after == view_retention_bytes(MPT7B, 8, 256, 2)
    assert fixed.max_allocated > fixed.allocated_after > fixed.weights


@pytest.mark.parametrize("keep_views", [False, True])
def test_model_matches_tracker_on_a_fused_qkv_cache(keep_views):
    # Hand-rolled MPT cache fill: Wqkv output -> chunk(3) -> (B, H, L, hd) views.
    B, L, D, H = 2, 16, TINY.d_model, TINY.n_heads
    m = CpuMeter()
    with torch.inference_mode(), m:
        cache = []
        for _ in range(TINY.n_layers):
            mixed_qkv = torch.randn(B, L, 3 * D)
            q, k, v = (t.reshape(B, L, H, D // H).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
            cache.append((k, v) if keep_views else (k.clone(), v.clone()))
            del mixed_qkv, q, k, v
        expected = kv_cache_bytes(TINY, B, L, 4)
        if keep_views:
            expected += view_retention_bytes(TINY, B, L, 4)
        assert m.allocated() == expected


# --- the Gaudi model of the seed run ---------------------------------------------------------


def _unique_bytes(model) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def test_untying_mpt_costs_one_vocab_matrix():
    # The size of the lm_head term, on transformers' own MPT: when Module._apply does not update a
    # parameter in place it gives each module a new Parameter (torch/nn/modules/module.py), so the
    # tied wte/lm_head pair ends up as two matrices, what Habana's weight-sharing wrapper exists to
    # undo. Forced on CPU with overwrite_module_params_on_conversion; fp64 makes new tensors.
    from transformers import MptConfig, MptForCausalLM

    cfg = MptConfig(d_model=TINY.d_model, n_heads=TINY.n_heads, n_layers=TINY.n_layers,
                    vocab_size=TINY.vocab_size, max_seq_len=TINY.max_seq_len)
    tied, untied = MptForCausalLM(cfg), MptForCausalLM(cfg)
    tied.to(torch.float64)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        untied.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert _unique_bytes(tied) == weights_bytes(TINY, 8)
    assert _unique_bytes(untied) == weights_bytes(TINY, 8) + untied_lm_head_bytes(TINY, 8)


def test_gaudi_terms_by_hand():
    # before, B 128, 128 + 128 tokens, mpt-7b bf16 (0.5 MiB of K/V per token):
    t = gaudi_seed_terms(SEED_TABLE[0])
    assert t.cache == t.graph_cache == 128 * 256 * (GiB // 2048) * 3 // 2  # k, v and the pinned q third
    assert t.probs == 128 * 32 * 256 * 256 * 2  # B * H * L^2 * bf16
    assert t.untied_lm_head == 50432 * 4096 * 2
    assert t.prefill_logits == 128 * 256 * 50432 * 2 and t.next_token_logits == t.graph_logits == 128 * 50432 * 2
    after = gaudi_seed_terms(SEED_TABLE[1])
    assert t.cache - after.cache == view_retention_bytes(MPT7B, 128, 256, 2)


def test_terms_depend_on_the_config_only():
    row = SEED_TABLE[0]
    other = dataclasses.replace(row, allocated_gb=1.0, max_allocated_gb=2.0, throughput=1.0)
    assert gaudi_seed_terms(other) == gaudi_seed_terms(row)


@pytest.mark.parametrize("held_out", range(len(SEED_TABLE)))
def test_leave_one_out_derives_k_from_the_other_rows_only(held_out):
    # The held-out row's own measurements, pushed to either extreme, must not move its
    # prediction. (A median that included the row would shift between the two.)
    def predict(scale):
        rows = list(SEED_TABLE)
        r = rows[held_out]
        rows[held_out] = dataclasses.replace(r, allocated_gb=r.allocated_gb * scale,
                                             max_allocated_gb=r.max_allocated_gb * scale)
        return leave_one_out(rows)[held_out]

    high, low, real = predict(10.0), predict(0.1), leave_one_out(SEED_TABLE)[held_out]
    for c in (high, low):
        assert (c.k, c.model_allocated_gb, c.model_max_gb) == (real.k, real.model_allocated_gb, real.model_max_gb)


def test_scratch_multiple_needs_rows():
    with pytest.raises(ValueError, match="at least one row"):
        scratch_multiple([])


def test_seed_rows_within_tolerance_or_explained():
    rows = seed_comparison()
    assert len(rows) == len(SEED_TABLE) == 8
    for c in rows:
        assert c.allocated_error == pytest.approx((c.model_allocated_gb - c.row.allocated_gb) / c.row.allocated_gb)
        off = max(abs(c.allocated_error), abs(c.max_error)) > TOLERANCE
        assert bool(c.note) == off, c
    # docs/memory-model.md and the README claim 7 of 8 rows within tolerance
    assert sum(bool(c.note) for c in rows) <= 1


def test_seed_table_is_in_gib():
    units = seed_units()
    assert sorted(units["GiB"])[1] < 0.01  # 3 of 4 pairs exact when GB means GiB
    assert min(units["GB"]) > 0.05


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_prints_the_table(capsys):
    assert memory_cli.main(["memory", "--model", "mpt-7b", "--batch-size", "128", "--max-input-tokens", "128",
                            "--max-new-tokens", "128", "--dtype", "bf16", "--seed-table"]) == 0
    out = capsys.readouterr().out
    assert "6,649,286,656 params" in out
    assert "fixed (clones)" in out and "views of mixed_qkv" in out
    assert "16.00" in out  # the KV cache in GiB: 128 * 256 tokens * 0.5 MiB
    flagged = [c for c in seed_comparison() if c.note]
    assert out.count("unexplained") == sum(c.note.startswith("unexplained") for c in flagged)
    assert "leave-one-out:" in out


@pytest.mark.parametrize(
    "max_seq_len, given, expected",
    [
        (2048, (None, None), (128, 128)),
        (64, (None, None), (32, 32)),  # tiny: half each
        (64, (60, None), (60, 4)),  # new tokens take what the prompt leaves
        (64, (None, 50), (14, 50)),  # and the other way round
        (64, (100, None), (100, 0)),  # given input is kept: the CLI rejects it
    ],
)
def test_default_tokens(max_seq_len, given, expected):
    max_input, max_new, note = memory_cli.default_tokens(max_seq_len, *given)
    assert (max_input, max_new) == expected
    assert bool(note) == (expected != (128, 128) and None in given)


@pytest.mark.parametrize("model", sorted(PRESETS))
def test_cli_defaults_fit_every_preset(model, capsys):
    assert memory_cli.main(["--model", model]) == 0
    out = capsys.readouterr().out
    length = PRESETS[model].max_seq_len
    if length < 256:
        assert f"cache length {length}" in out and f"max_seq_len is {length}" in out
    else:
        assert "input 128 + new 128 = cache length 256" in out and "note:" not in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--batch-size", "-3"], "got -3"),
        (["--model", "mpt-1b"], "mpt-1b"),
        (["--max-input-tokens", "2000", "--max-new-tokens", "100"],
         "--max-input-tokens 2000 + --max-new-tokens 100 = 2100 exceeds mpt-7b's max_seq_len 2048"),
        (["--model", "tiny", "--max-input-tokens", "100"], "--max-input-tokens 100 exceeds tiny's max_seq_len 64"),
        (["--model", "tiny", "--max-new-tokens", "64"], "--max-new-tokens 64 leaves no room for a prompt in tiny's max_seq_len 64"),
        (["--model", "tiny", "--max-input-tokens", "40", "--max-new-tokens", "30"], "= 70 exceeds tiny's max_seq_len 64"),
    ],
)
def test_cli_rejects_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        memory_cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_max_seq_len_override(capsys):
    assert memory_cli.main(["--max-input-tokens", "2000", "--max-new-tokens", "100", "--max-seq-len", "4096"]) == 0
    assert "cache length 2100" in capsys.readouterr().out
