"""P3 (properties.aliasing_problems, check_no_aliasing): a cached key or value may live in a storage
of the cache's own (alone, stacked with its value, with every layer, a preallocated buffer that
persists) but not in mixed_qkv or in a per-step temporary. Failures name layer, tensor and bytes."""

import pytest
import torch

from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import properties as P
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.checks.storages import covered_bytes
from mpt_kv.model.config import ModelConfig, random_state_dict

B, T, H, hd = 2, 5, 3, 4
D, F32 = H * hd, 4


def split(qkv):
    """(q, k, v) as MPT makes them: (B, H, T, hd) views of a (B, T, 3D) buffer."""
    return tuple(t.reshape(B, T, H, hd).transpose(1, 2) for t in qkv.chunk(3, dim=2))


def test_stacked_and_one_allocation_storages_are_the_caches_own():
    stacked = [torch.zeros(2, B, H, T, hd) for _ in range(2)]
    everything = torch.zeros(2, 2, B, H, T, hd)  # (layers, K/V, ...)
    token_major = torch.zeros(B, T, H, hd)     # a transposed, non-contiguous view covers it all
    for kv in ([(s[0], s[1]) for s in stacked], [(everything[i, 0], everything[i, 1]) for i in range(2)],
               [(token_major.transpose(1, 2), torch.zeros(B, H, T, hd))]):
        problems, _ = P.aliasing_problems(kv, [None] * len(kv))  # the last step: nothing left undecided
        assert problems == []


def test_a_view_of_mixed_qkv_names_layer_tensor_and_bytes_pinned():
    qkv = torch.randn(B, T, 3 * D)
    _, k, v = split(qkv)
    problems, _ = P.aliasing_problems([(k, v.clone())], [qkv])
    held, key = B * T * 3 * D * F32, B * T * D * F32
    assert problems == [f"layer 0 key (2, 3, 5, 4) is a view of layer 0's mixed_qkv (2, 5, 36): its storage holds "
                        f"{held} bytes, the cached tensors in it {key}: {held - key} bytes pinned beyond the cache"]
    problems, _ = P.aliasing_problems([(k, v)], [qkv])  # both: the q third is what they pin
    assert problems[0].startswith("layer 0 key (2, 3, 5, 4) and layer 0 value (2, 3, 5, 4) are views of layer 0's")
    assert problems[0].endswith(f"{held - 2 * key} bytes pinned beyond the cache"), problems


def test_a_view_of_a_per_step_temporary_fails_when_the_next_step_drops_it():
    """Views of a copy of mixed_qkv (clip_qkv's clamp makes one): not the captured Wqkv output, so
    undecided after the step that made it, a failure once the next step has replaced it."""
    clamped = torch.randn(B, T, 3 * D).clamp(-1, 1)
    _, k, v = split(clamped)
    problems, seen = P.aliasing_problems([(k, v)], [None], {}, "prefill", last=False)
    assert problems == []
    problems, _ = P.aliasing_problems([(torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2))], [None],
                                      seen, 0, last=True)
    held, pinned = B * T * 3 * D * F32, B * T * D * F32
    assert problems == [f"layer 0 key (2, 3, 5, 4) and layer 0 value (2, 3, 5, 4) were views of a per-step temporary, "
                        f"made at step prefill and gone after the next: its storage holds {held} bytes, the cached "
                        f"tensors in it {held - pinned}: {pinned} bytes pinned beyond the cache"]


def test_a_preallocated_buffer_with_room_to_spare_is_the_caches_own_once_it_persists():
    buf = torch.zeros(2, B, H, 16, hd)  # room for 16 positions; kv() hands out the written ones
    problems, seen = P.aliasing_problems([(buf[0, :, :, :T], buf[1, :, :, :T])], [None], {}, "prefill", last=False)
    assert problems == []
    problems, _ = P.aliasing_problems([(buf[0, :, :, :T + 1], buf[1, :, :, :T + 1])], [None], seen, 0, last=True)
    assert problems == []
    # the same buffer seen at the last step only: nothing shows it persists, so it fails (fail closed)
    problems, _ = P.aliasing_problems([(buf[0, :, :, :T], buf[1, :, :, :T])], [None], {}, 3, last=True)
    assert len(problems) == 1 and "in a buffer made at the last step (3) that the cache does not fill" in problems[0]
    assert f"{2 * B * H * (16 - T) * hd * F32} bytes pinned beyond the cache" in problems[0]


@pytest.mark.parametrize("strided", [False, True])
def test_covered_bytes_counts_each_byte_once(strided):
    x = torch.zeros(4, 6)
    views = [x[:, ::2], x[:, 1::2]] if strided else [x[:2], x[1:3]]  # gaps filled by each other / overlap
    assert covered_bytes(x.untyped_storage().nbytes(), views) == (24 if strided else 18) * F32  # all 24; rows 0-2


def test_p3_kills_views_of_the_clamped_mixed_qkv():
    """kv_views_of_mixed_qkv with clip_qkv: the cached views are of the clamp's output, a per-step
    temporary the Wqkv hook never sees; P3 still fails it, one step later."""
    cfg = ModelConfig(d_model=12, n_heads=3, n_layers=1, vocab_size=32, max_seq_len=16, clip_qkv=0.5)
    case = P.Case(cfg, (4, 2), 2, seed=0)
    runner = VARIANTS["kv_views_of_mixed_qkv"].build(cfg, random_state_dict(cfg), torch.device("cpu"), torch.float32)
    with pytest.raises(PropertyFailure, match=r"P3 cache aliasing after step 0: layer 0 key \(2, 3, 4, 4\) and layer 0 "
                                              r"value \(2, 3, 4, 4\) were views of a per-step temporary, made at step "
                                              r"prefill .* 384 bytes pinned beyond the cache .*target=kv_views"):
        P.check_no_aliasing(runner, P.Context("kv_views_of_mixed_qkv", "cpu", torch.float32, case, "concat"))


def test_a_kv_in_another_axis_order_is_an_adapter_error_naming_the_shape_and_the_one_expected():
    """Issue 49: was a pass of P3/concat: a kv() that hands over a token-major cache as stored, (batch, seq, heads,
    head_dim), owns every byte of its storages (variants.kv_in_token_major_order). Now an AdapterError, one line."""
    from mpt_kv.errors import AdapterError

    cfg = ModelConfig(d_model=12, n_heads=3, n_layers=1, vocab_size=32, max_seq_len=16)
    case = P.Case(cfg, (5, 2), 2, seed=0)
    runner = VARIANTS["kv_in_token_major_order"].build(cfg, random_state_dict(cfg), torch.device("cpu"), torch.float32)
    with pytest.raises(AdapterError) as e:
        P.check_no_aliasing(runner, P.Context("kv_in_token_major_order", "cpu", torch.float32, case, "concat"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(
        "StoredOrderSession: kv() layer 0 key has shape (2, 5, 3, 4), expected (batch 2, heads 3, positions >= 5, "
        "head_dim 4): kv() hands the cache over as (batch, heads, seq, head_dim); this is (batch, seq, heads, "
        "head_dim): return the stored tensor's .transpose(1, 2)"), e.value
    P.check_no_aliasing(runner, P.Context("kv_in_token_major_order", "cpu", torch.float32, case, "static"))  # right order
