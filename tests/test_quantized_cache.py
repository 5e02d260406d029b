"""A declared quantized KV cache (mpt_kv.QuantizedKV, docs/targets.md "A quantized cache"): a correct
one passes P1, P2 and memory, a wrong scale is killed by P1 under the calibrated int8 bound
(mpt_kv/checks/quantized.py, docs/calibration.md "Quantized caches"), bad declarations are refused,
P2's poison fits the codes and still catches an attended never-written slot, memory counts the
codes and scales exactly, and the bound of every target that declares nothing is unchanged."""

import pytest
import torch

import mpt_kv
from mpt_kv.catalogue import designs, variants
from mpt_kv.catalogue.assembly import attention_with, model_with, runner_factory
from mpt_kv.checks import ceilings as C
from mpt_kv.checks import properties as P
from mpt_kv.checks.compare import TOLERANCES, PropertyFailure, tolerance
from mpt_kv.checks.quantized import QUANTIZED, widened
from mpt_kv.checks.strategies import HEAD_COUNTS
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets.layouts import poison_quantized
from mpt_kv.targets.reference import build as reference_build

CPU, F32, BF16 = torch.device("cpu"), torch.float32, torch.bfloat16
CASE = P.Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32), (5, 3), 5, seed=1)
WIDE = P.Case(ModelConfig(d_model=64, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=24), (18, 11), 6, seed=4)


def context(build, case, path, dtype=F32, bucket=None):
    sd = random_state_dict(case.cfg, seed=case.seed)
    runner = build(case.cfg, sd, CPU, dtype)
    twin = P.fp32_twin(build, case.cfg, sd, "cpu", dtype)
    return runner, P.Context(build.__name__, "cpu", dtype, case, path, bucket, fp32=twin)


CHECKS = {"P1": lambda r, c: P.check_cached_equals_uncached(r, c),
          "P2": lambda r, c: P.check_static_equals_concat(r, c),
          "memory": lambda r, c: C.check_memory(r, c)}


@pytest.mark.parametrize("design", ["quantized_kv_int8", "quantized_kv_fp8"])
@pytest.mark.parametrize("check,path,bucket,dtype", [
    ("P1", "concat", None, F32), ("P1", "static", None, F32), ("P1", "static", 4, F32), ("P1", "static", None, BF16),
    ("P2", "static", None, F32), ("P2", "static", 4, F32), ("P2", "static", None, BF16),
    ("memory", "concat", None, F32), ("memory", "static", None, F32)])
@pytest.mark.parametrize("case", [CASE, WIDE], ids=["3-heads", "hd-32"])
def test_a_correct_quantized_cache_passes(design, check, path, bucket, dtype, case):
    runner, c = context(designs.DESIGNS[design].build, case, path, dtype, bucket)
    CHECKS[check](runner, c)


@pytest.mark.parametrize("variant", ["quantized_kv_wrong_scale", "quantized_kv_wrong_row"])
@pytest.mark.parametrize("path", ["concat", "static"])
def test_a_wrong_scale_is_killed_by_p1_under_the_int8_bound(variant, path):
    runner, c = context(variants.VARIANTS[variant].build, CASE, path)
    with pytest.raises(PropertyFailure, match=r"P1 decode logits vs full forward differ .*float32 "
                                              rf"logits:{path}\+int8/token"):
        P.check_cached_equals_uncached(runner, c)
    assert "P1" in variants.VARIANTS[variant].killed_by


class WrongAxisScale:
    """Each position's scale reduced over the heads (dim 1) instead of head_dim (-1): the codes divide by a
    per-(row, position, channel) maximum over heads, while the stored per-token scale is that maximum's
    largest channel: dequantized values are not the cached ones, whatever the head count."""

    def _quantize(self, x, layer, i, at):
        top = designs.quant_max(self.storage)
        channel = x.float().abs().amax(1, keepdim=True).clamp_min(1e-30) / top  # (B, 1, T, hd): the wrong axis
        q = (x.float() / channel).clamp(-top, top)
        codes = (q.round() if not self.storage.is_floating_point else q).to(self.storage)
        return codes, channel.amax(-1, keepdim=True).expand(*x.shape[:3], 1).contiguous()


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_scales_over_the_wrong_axis_fail_p1_for_every_head_count_drawn(heads):
    """Issue 38 (a held-out design): a wrong-axis scale must not hide at any head count drawn (at one head a
    reduction over the heads is a reduction over nothing)."""
    concat = type("WrongAxisConcat", (WrongAxisScale, designs.QuantizedConcatCache), {})
    static = type("WrongAxisStatic", (WrongAxisScale, designs.QuantizedStaticCache), {})
    model = type("WrongAxisMPT", (designs.QuantizedMPT,), {"concat_class": concat, "static_class": static})
    wrong = runner_factory("quantized_scale_wrong_axis", model, designs.QuantizedSession)
    case = P.Case(ModelConfig(d_model=heads * 4, n_heads=heads, n_layers=1, vocab_size=64, max_seq_len=16), (5, 3), 3,
                  seed=heads)
    for path in ("concat", "static"):
        P.check_cached_equals_uncached(*context(designs.quantized_kv_int8, case, path))  # the case is a fair one
        with pytest.raises(PropertyFailure, match=rf"P1 .* differ .*float32 (logits|kv):{path}\+int8/token"):
            P.check_cached_equals_uncached(*context(wrong, case, path))


def codes(dtype=torch.int8, T=6, scales_shape=None):
    k = torch.zeros(2, 3, T, 4, dtype=dtype)
    s = torch.ones(*(scales_shape or (2, 3, T, 1)))
    return [(k, k.clone())], [(s, s.clone())]


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=torch.float16, scales="token"), r"dtype=torch.float16.*expected one of"),
    (dict(dtype=torch.uint8, scales="token"), r"dtype=torch.uint8"),
    (dict(dtype=torch.int8, scales="channel"), r"scales='channel'.*\['head', 'tensor', 'token'\]"),
    (dict(dtype=torch.int8, scales="token", scale_dtype=torch.int32), r"scale_dtype=torch.int32"),
    (dict(dtype=torch.int8, scales="token", scale_dtype=torch.float8_e4m3fn), r"scale_dtype=torch.float8_e4m3fn"),
    (dict(dtype=torch.int8, scales="token", codes=codes(torch.float8_e4m3fn)[0], scale_tensors=codes()[1]),
     r"layer 0 key codes torch.float8_e4m3fn \(2, 3, 6, 4\): expected \(B, H, T, hd\) of torch.int8"),
    (dict(dtype=torch.int8, scales="head", codes=codes()[0], scale_tensors=codes()[1]),
     r"layer 0 key scales .*\(2, 3, 6, 1\): scales='head' expects \(2, 3, 1, 1\)"),
    (dict(dtype=torch.int8, scales="token", codes=codes()[0], scale_tensors=[]), r"1 layers of codes, 0 of scales"),
])
def test_a_bad_declaration_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mpt_kv.QuantizedKV(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(codes=5), dict(codes=[codes()[0][0][0]]), dict(scale_tensors=None)])
def test_codes_and_scales_of_the_wrong_kind_are_a_clear_type_error(kwargs):
    """Issue 38: QuantizedKV(..., codes=5) raised a raw TypeError (object of type 'int' has no len())."""
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=rf"QuantizedKV\({name}=.*\): expected a list of per-layer \(key, value\) pairs"):
        mpt_kv.QuantizedKV(torch.int8, "token", **kwargs)


def test_an_uncalibrated_granularity_is_refused_not_judged_by_the_token_bound():
    session = P.copied(designs.quantized_kv_int8(CASE.cfg, random_state_dict(CASE.cfg), CPU, F32)).session("concat", 10)
    session.prefill(*CASE.inputs(CPU))
    layout = session.cache_layout()
    session.cache_layout = lambda: mpt_kv.QuantizedKV(torch.int8, "tensor", torch.float32, layout.codes,
                                                      [(s[:1, :1, :1], s[:1, :1, :1]) for s, _ in layout.scale_tensors])
    with pytest.raises(ValueError, match=r"no calibrated bound .*int8 codes, scales=tensor.*calibrated are scales"):
        widened(tolerance(F32, "logits:concat"), session)


@pytest.mark.parametrize("dtype,code", [(torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)])
@pytest.mark.parametrize("granularity", ["token", "head"])
def test_poison_fits_the_codes_and_leaves_written_slots_alone(dtype, code, granularity):
    shape = (2, 3, 6, 1) if granularity == "token" else (2, 3, 1, 1)
    c, s = codes(dtype, 6, shape)
    layout = mpt_kv.QuantizedKV(dtype, granularity, torch.float32, c, s)
    poison_quantized(layout, 4, P.POISON)
    for k in c[0]:
        assert (k[:, :, 4:].float() == code).all() and (k[:, :, :4].float() == 0).all()
    for sc in s[0]:
        want = P.POISON if granularity == "token" else 1.0  # a shared scale also scales written slots
        assert torch.allclose(sc[:, :, 4:].float(), torch.tensor(want)) and (sc[:, :, :4] == 1).all()


def test_p2_still_catches_an_attended_never_written_slot_of_a_quantized_cache():
    """The quantized design with a decode that drops the attention mask: the static path attends
    the poisoned slots (code 127 x scale 1e30) and P2 says so."""
    model = model_with(attention=attention_with(drop_mask=True), base=designs.QuantizedMPT)
    build = runner_factory("quantized_decode_ignores_mask", model, designs.QuantizedSession)
    runner, c = context(build, CASE, "static")
    with pytest.raises(PropertyFailure, match=r"P2 static vs concat logits"):
        P.check_static_equals_concat(runner, c)


class ShadowCopyConcatCache(designs.QuantizedConcatCache):
    """Keeps the full-precision K/V beside the codes (a cache that quantizes and keeps the original)."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        shadow = getattr(self, "shadow", [None] * len(self.q))
        self.shadow = shadow
        shadow[layer] = (k.clone(), v.clone()) if shadow[layer] is None else \
            (torch.cat([shadow[layer][0], k], 2), torch.cat([shadow[layer][1], v], 2))
        return super().update(layer, k, v, token_idx, cache_idx)


def test_memory_counts_codes_and_scales_exactly_and_fails_a_full_precision_copy_beside_them():
    cfg, B, L = CASE.cfg, CASE.batch, CASE.prompt_len
    layout = mpt_kv.QuantizedKV(torch.int8, "token")
    # per layer, key and value: B x H x L x hd int8 codes and B x H x L fp32 scales
    assert layout.cache_bytes(cfg.n_layers, B, cfg.n_heads, L, cfg.head_dim) == \
        2 * cfg.n_layers * (B * cfg.n_heads * L * cfg.head_dim * 1 + B * cfg.n_heads * L * 4)
    model = type("ShadowMPT", (designs.QuantizedMPT,), {"concat_class": ShadowCopyConcatCache})
    runner, c = context(runner_factory("quantized_with_a_full_copy", model, designs.QuantizedSession), CASE, "concat")
    kv = 2 * cfg.n_layers * B * cfg.n_heads * L * cfg.head_dim * 4
    with pytest.raises(PropertyFailure, match=rf"after prefill, .* {kv} bytes too many \(exact\): expected the "
                                              r"quantized KV cache .*session.cache.shadow"):
        C.check_memory(runner, c)


@pytest.mark.parametrize("dtype,quantity", [k for k in TOLERANCES if k[1].split(":")[1] in ("concat", "static")])
def test_the_bound_of_a_target_that_declares_no_quantized_cache_is_unchanged(dtype, quantity):
    sessions = []
    for build in (reference_build, designs.cache_growing_in_blocks, designs.quantized_kv_int8):
        s = build(CASE.cfg, random_state_dict(CASE.cfg), CPU, F32).session("concat", 10)
        s.prefill(*CASE.inputs(CPU))
        sessions.append(s)
    tol = tolerance(getattr(torch, dtype), quantity)
    assert widened(tol, sessions[0]) is tol and widened(tol, sessions[1]) is tol
    q = QUANTIZED[("int8", quantity.split(":")[0])]
    wide = widened(tol, sessions[2])
    assert (wide.atol, wide.rtol) == (tol.atol + q.atol, tol.rtol + q.rtol)


class CopiedCodesSession(designs.QuantizedSession):
    """Declares a QuantizedKV whose codes are copies: poison written there lands in no cache."""

    def cache_layout(self):
        layout = super().cache_layout()
        if layout is None:
            return None
        return mpt_kv.QuantizedKV(layout.dtype, layout.scales, layout.scale_dtype,
                                  [tuple(t.clone() for t in pair) for pair in layout.codes], layout.scale_tensors)


def test_p2_refuses_a_quantized_declaration_whose_codes_are_copies():
    runner, c = context(runner_factory("quantized_copied_codes", designs.QuantizedMPT, CopiedCodesSession), CASE,
                        "static")
    with pytest.raises(RuntimeError, match=r"poisoned through cache_layout\(\)'s QuantizedKV codes are not poisoned"):
        P.check_static_equals_concat(runner, c)
