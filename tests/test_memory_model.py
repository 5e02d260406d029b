"""The analytic memory model: formulas, the seed table, the CLI."""

from __future__ import annotations

import math

import pytest
import torch

from mpt_kv.cli import memory as memory_cli
from mpt_kv.memory.analytic import (
    PRESETS, SEED_TABLE, estimate, kv_cache_bytes, n_params, seed_comparison, seed_units,
    view_retention_bytes, weights_bytes,
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


def test_seed_comparison_rows():
    rows = seed_comparison()
    assert len(rows) == len(SEED_TABLE) == 8
    for c in rows:
        assert math.isfinite(c.allocated_error) and math.isfinite(c.max_error)
        assert c.note
        assert c.allocated_error == pytest.approx((c.model_allocated_gb - c.row.allocated_gb) / c.row.allocated_gb)
    # The views' extra explains three before/after pairs to the table's rounding;
    # the (16, 128, 1024) pair does not, and says so.
    misfits = [c.row for c in rows if "NOT fit" in c.note]
    assert [(r.version, r.batch, r.max_input, r.max_new) for r in misfits] == [("before", 16, 128, 1024)]


def test_seed_table_is_in_gib():
    units = seed_units()
    assert sorted(units["GiB"])[1] < 0.01  # 3 of 4 pairs exact when GB means GiB
    assert min(units["GB"]) > 0.05


def test_cli_prints_the_table(capsys):
    assert memory_cli.main(["memory", "--model", "mpt-7b", "--batch-size", "128", "--max-input-tokens", "128",
                        "--max-new-tokens", "128", "--dtype", "bf16", "--seed-table"]) == 0
    out = capsys.readouterr().out
    assert "6,649,286,656 params" in out
    assert "fixed (clones)" in out and "views of mixed_qkv" in out
    assert "16.00" in out  # the KV cache in GiB: 128 * 256 tokens * 0.5 MiB
    assert out.count("unmodelled:") == 8


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--batch-size", "-3"], "got -3"),
        (["--model", "mpt-1b"], "mpt-1b"),
        (["--max-input-tokens", "2000", "--max-new-tokens", "100"], "2100 exceeds mpt-7b's max_seq_len 2048"),
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
