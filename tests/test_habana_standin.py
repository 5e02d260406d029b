"""The CPU stand-in for habana_frameworks (mpt_kv/families/habana_standin.py) loads a model
module that imports `habana_frameworks.torch.core` unconditionally, and leaves no HPU behind:
`find_spec` finds nothing, torch has no usable hpu, mpt_kv.devices sees none, and `pytest -m hpu`
is still the gate's usage error with such a module imported first (docs/gate.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mpt_kv import devices
from mpt_kv.families import habana_standin
from plugin_testing import HANG_S

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
FALCON = "optimum.habana.transformers.models.falcon.modeling_falcon"
HAVE_OH = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.habana") is not None

# a model module shaped like optimum-habana's falcon: kernels guarded, htcore not
LIKE_FALCON = """
try:
    from habana_frameworks.torch.hpex.kernels import FusedSDPA
except ImportError:
    FusedSDPA = None
try:
    from habana_frameworks.torch.hpu import sdp_kernel
except ImportError:
    sdp_kernel = None
import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu

def step():
    htcore.mark_step()
    return hthpu.is_available()
"""


def no_hpu_left():
    """What every consumer of HPU presence sees after the stand-in is gone."""
    assert importlib.util.find_spec("habana_frameworks") is None
    assert not [n for n in sys.modules if n == "habana_frameworks" or n.startswith("habana_frameworks.")]
    hpu = getattr(torch, "hpu", None)
    assert hpu is None or not hpu.is_available()
    reason = devices._probe.__wrapped__("hpu")  # uncached: probed now, after the import
    assert reason is not None and "habana_frameworks" in reason
    assert devices._cannot_be_here("hpu") == "habana_frameworks is not installed; it ships in Gaudi images only"


@pytest.fixture
def like_falcon(tmp_path, monkeypatch):
    (tmp_path / "like_falcon.py").write_text(LIKE_FALCON)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "like_falcon"
    sys.modules.pop("like_falcon", None)


def test_without_the_standin_such_a_module_does_not_import(like_falcon):
    with pytest.raises(ModuleNotFoundError, match="habana_frameworks"):
        importlib.import_module(like_falcon)


def test_the_standin_loads_it_with_kernels_absent_and_leaves_no_hpu(like_falcon):
    module = habana_standin.import_with_standin(like_falcon)
    assert module.FusedSDPA is None and module.sdp_kernel is None  # its CPU fallbacks
    assert module.step() is False  # mark_step a no-op, hpu not available
    assert habana_standin.is_standin(module.htcore)
    no_hpu_left()


def test_the_standin_is_removed_when_the_import_fails(tmp_path, monkeypatch):
    (tmp_path / "broken_port.py").write_text("import habana_frameworks.torch.core\nraise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        habana_standin.import_with_standin("broken_port")
    no_hpu_left()


def test_the_standin_refuses_where_habana_frameworks_is_real(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "habana_frameworks" else None)
    with pytest.raises(RuntimeError, match="a real habana_frameworks is installed"):
        with habana_standin.standin():
            pass
    monkeypatch.undo()
    real = type(sys)("habana_frameworks")
    monkeypatch.setitem(sys.modules, "habana_frameworks", real)
    with pytest.raises(RuntimeError, match="the real habana_frameworks is already imported"):
        with habana_standin.standin():
            pass
    assert sys.modules["habana_frameworks"] is real  # never removed: it is not the stand-in's


@pytest.mark.optimum_habana
def test_optimum_habanas_falcon_loads_under_the_standin_and_leaves_no_hpu():
    from mpt_kv.targets import gaudi

    gaudi.register_bare_parents(gaudi.optimum_habana_root(), FALCON)
    module = sys.modules.get(FALCON) or habana_standin.import_with_standin(FALCON)
    assert hasattr(module, "GaudiFalconForCausalLM")
    no_hpu_left()


@pytest.mark.skipif(devices.unavailable_reason("hpu") is None, reason="this machine has an HPU: the gate would pass")
def test_pytest_m_hpu_stays_the_gates_usage_error_with_a_standin_loaded_module(pytester, monkeypatch, tmp_path):
    """The module is imported under the stand-in in the run's conftest, before the gate decides."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "like_falcon.py").write_text(LIKE_FALCON)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path / "mods")]))
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", devices.ENV_CARDS):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "mods" / "like_moe.py").write_text("from habana_frameworks.torch.hpex.kernels import FusedSDPA\n")
    # optimum-habana's falcon under the loading stand-in, its mixtral under the kernel stand-in (a forward run)
    load = f"gaudi.register_bare_parents(gaudi.optimum_habana_root(), {FALCON!r}); " \
           f"habana_standin.import_with_standin({FALCON!r}); " \
           "r = IMPLEMENTATIONS['optimum-habana'](FAMILIES['mixtral'], 'moe-2of4'); " \
           "r.logits(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))" if HAVE_OH else "pass"
    pytester.makeconftest(textwrap.dedent(f"""
        import sys
        import torch
        from mpt_kv.families import FAMILIES, habana_standin
        from mpt_kv.families.implementations import IMPLEMENTATIONS
        from mpt_kv.targets import gaudi
        habana_standin.import_with_standin("like_falcon")
        habana_standin.import_with_standin("like_moe", kernels=("FusedSDPA",))
        {load}
        print("stand-in loaded:", sorted(n for n in sys.modules if n in ("like_falcon", {FALCON!r})))
    """))
    pytester.makepyfile(test_gated="""
        import torch

        def test_add(device):
            assert (torch.ones(2, device=device) * 2).sum().item() == 4
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-m", "hpu", timeout=HANG_S)
    text = "\n".join(result.outlines + result.errlines)
    assert "stand-in loaded: " + ("['like_falcon', " + repr(FALCON) + "]" if HAVE_OH else "['like_falcon']") in text
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    assert "ERROR: -m 'hpu' selects hpu cases, but hpu is not available here: habana_frameworks" in text
    assert "test_add" not in text.replace("def test_add", "")


# --- the kernel stand-in: each HPU kernel against a plain torch reference ------------------------------------------

from mpt_kv.families import hpu_kernels  # noqa: E402


@pytest.fixture
def scope():
    """Run the stand-in kernels as inside a declaring port's forward."""
    with habana_standin.kernel_scope(tuple(habana_standin.KERNELS)):
        yield


def qkv(batch=2, q_heads=4, kv_heads=4, length=5, keys=5, dim=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, q_heads, length, dim, generator=g).to(dtype),
            torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype),
            torch.randn(batch, kv_heads, keys, dim, generator=g).to(dtype))


def sdpa(q, k, v, **kw):
    """torch's SDPA, K/V heads repeated to the query's (each group of consecutive query heads one K/V head)."""
    rep = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1), **kw)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", ["plain", "causal", "causal-decode", "bool-mask", "float-mask", "scale"])
def test_fused_sdpa_is_torchs_sdpa(scope, heads, case):
    q, k, v = qkv(q_heads=heads[0], kv_heads=heads[1], length=1 if case == "causal-decode" else 5, keys=5)
    mask = None
    if case == "bool-mask":
        mask = torch.rand(2, 1, q.shape[2], 5, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True  # every row attends somewhere
    if case == "float-mask":
        mask = torch.randn(2, 1, q.shape[2], 5, generator=torch.Generator().manual_seed(2))
    causal = case.startswith("causal")
    scale = 0.3 if case == "scale" else None
    out = hpu_kernels.FusedSDPA.apply(q, k, v, mask, 0.0, causal, scale, "None", None, None, "None")
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=scale), rtol=0, atol=1e-6)


def test_fused_sdpa_modes_that_change_no_value_and_the_dtype(scope):
    """recompute changes the backward's memory, not the forward's values; "fast" is declared exact
    (the HPU's reduced-precision softmax is not modeled); the result has the query's dtype."""
    q, k, v = qkv()
    base = hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True)
    for mode, recompute in (("fast", None), ("None", True), ("fast", False)):
        assert torch.equal(hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True, None, mode, recompute), base)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    out = hpu_kernels.fused_sdpa(qb, kb, vb, None, 0.0, True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sdpa(qb, kb, vb, is_causal=True), rtol=0, atol=1e-2)


@pytest.mark.parametrize("side", ["left", "right"])
def test_fused_sdpa_valid_sequence_lengths_attend_each_rows_valid_tokens_only(scope, side):
    """Row b's padded positions take no part: its valid tokens' outputs are causal SDPA over its valid
    tokens alone; its padded queries' outputs, which no caller reads, are zero."""
    q, k, v = qkv(length=6, keys=6)
    lengths = torch.tensor([4, 6])
    out = hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True, None, "None", None, lengths, side)
    for b, n in enumerate(lengths.tolist()):
        valid = slice(6 - n, 6) if side == "left" else slice(0, n)
        pad = slice(0, 6 - n) if side == "left" else slice(n, 6)
        rows = [t[b:b + 1, :, valid] for t in (q, k, v)]
        torch.testing.assert_close(out[b:b + 1, :, valid], sdpa(*rows, is_causal=True), rtol=0, atol=1e-6)
        assert not out[b, :, pad].any()
    full = hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True, None, "None", None, torch.tensor([6, 6]), side)
    torch.testing.assert_close(full, sdpa(q, k, v, is_causal=True), rtol=0, atol=1e-6)


def test_fused_sdpa_refuses_what_it_does_not_model(scope):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=r"dropout_p=0.1 \(training\) is not modeled"):
        hpu_kernels.fused_sdpa(q, k, v, None, 0.1)
    with pytest.raises(ValueError, match="is_causal with an attn_mask as well"):
        hpu_kernels.fused_sdpa(q, k, v, torch.zeros(2, 1, 5, 5), 0.0, True)
    with pytest.raises(ValueError, match="softmax_mode 'exact'"):
        hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True, None, "exact")
    with pytest.raises(ValueError, match="valid_sequence_lengths is supported with is_causal only"):
        hpu_kernels.fused_sdpa(q, k, v, None, 0.0, False, None, "None", None, torch.tensor([5, 5]), "left")
    with pytest.raises(ValueError, match="not a multiple of 3 K/V heads"):
        hpu_kernels.fused_sdpa(*qkv(kv_heads=3))


def test_fused_rope_is_the_ports_cpu_fallback(scope):
    """FusedRoPE.apply(x, cos[None, None], sin[None, None], position_ids) on a rotary table equals what
    the ports run off an HPU: transformers' apply_rotary_pos_emb on each position's cos and sin
    (optimum-habana models/llama/modeling_llama.py:1616-1620)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    angles = torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()  # (16, 8) tables
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids])
    got = [hpu_kernels.RotaryPosEmbeddingHelperV2.apply(x, cos[None, None], sin[None, None], position_ids)
           for x in (q, k)]
    torch.testing.assert_close(got[0], want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want_k, rtol=0, atol=1e-6)
    per_position = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)  # no position_ids: as given
    torch.testing.assert_close(hpu_kernels.rotary_pos_embedding(q, *per_position), want_q, rtol=0, atol=1e-6)
    with pytest.raises(NotImplementedError, match="a rotary mode argument"):
        hpu_kernels.rotary_pos_embedding(q, cos[None, None], sin[None, None], position_ids, 0, "PAIRWISE")


def test_fused_rms_norm_is_llamas_rmsnorm(scope):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float32, torch.bfloat16):
        got = hpu_kernels.FusedRMSNorm.apply(x.to(dtype), norm.weight.to(dtype), 1e-5)
        torch.testing.assert_close(got, norm.to(dtype)(x.to(dtype)), rtol=0, atol=0)


def moe_reference(x, routing, weights, gate, up, down, first=0):
    """A plain loop: each token, each of its routed experts in the lists' range, weight x down(silu(gate x) * up x)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(routing.shape[1]):
            e = int(routing[t, j]) - first
            if 0 <= e < len(gate):
                h = torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])
                out[t] += weights[t, j] * (down[e] @ h)
    return out


def moe_inputs(tokens=7, hidden=8, inner=6, experts=4, top=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, routing = scores.topk(top, dim=-1)
    linear = [[torch.randn(*shape, generator=g) * 0.3 for _ in range(experts)]
              for shape in ((inner, hidden), (inner, hidden), (hidden, inner))]
    return x, routing, weights, *linear


def test_mixture_of_experts_is_a_loop_over_experts(scope):
    x, routing, weights, gate, up, down = moe_inputs()
    want = moe_reference(x, routing, weights, gate, up, down)
    got = hpu_kernels.mixture_of_experts(hidden_states=x, expert_routing_table=routing, router_weights=weights,
                                         w1=gate, w2=up, w3=down, permuted_weights=True, activation="silu",
                                         experts_min=0, experts_max=3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    fused = hpu_kernels.mixture_of_experts(hidden_states=x, expert_routing_table=routing, router_weights=weights,
                                           w12=[torch.cat((g_, u)) for g_, u in zip(gate, up)], w3=down,
                                           permuted_weights=True, activation="silu", experts_min=0, experts_max=3)
    torch.testing.assert_close(fused, want, rtol=0, atol=1e-5)
    via_ops = torch.ops.hpu.mixture_of_experts(hidden_states=x, expert_routing_table=routing, router_weights=weights,
                                               w1=gate, w2=up, w3=down, permuted_weights=True, activation="silu",
                                               experts_min=0, experts_max=3)
    assert torch.equal(via_ops, got)


def test_mixture_of_experts_slices_add_up_as_deepseek_v2_sums_them(scope):
    """deepseek_v2 calls the op once per slice of experts (its lists start at experts_min) and sums the
    slices (optimum-habana models/deepseek_v2/modeling_deepseek_v2.py:670-690): each slice adds exactly
    its own experts' share."""
    x, routing, weights, gate, up, down = moe_inputs(experts=6, top=3)
    whole = moe_reference(x, routing, weights, gate, up, down)
    slices = sum(hpu_kernels.mixture_of_experts(hidden_states=x, expert_routing_table=routing, router_weights=weights,
                                                w1=gate[lo:hi], w2=up[lo:hi], w3=down[lo:hi], permuted_weights=True,
                                                activation="silu", experts_min=lo, experts_max=hi - 1)
                 for lo, hi in ((0, 2), (2, 4), (4, 6)))
    torch.testing.assert_close(slices, whole, rtol=0, atol=1e-5)
    second = hpu_kernels.mixture_of_experts(hidden_states=x, expert_routing_table=routing, router_weights=weights,
                                            w1=gate[2:4], w2=up[2:4], w3=down[2:4], experts_min=2, experts_max=3)
    torch.testing.assert_close(second, moe_reference(x, routing, weights, gate[2:4], up[2:4], down[2:4], first=2),
                               rtol=0, atol=1e-5)


def test_mixture_of_experts_refuses_what_it_does_not_model(scope):
    x, routing, weights, gate, up, down = moe_inputs()
    args = dict(hidden_states=x, expert_routing_table=routing, router_weights=weights, w1=gate, w2=up, w3=down)
    with pytest.raises(NotImplementedError, match="permuted_weights=False is not modeled"):
        hpu_kernels.mixture_of_experts(**args, permuted_weights=False)
    with pytest.raises(NotImplementedError, match=r"argument\(s\) \['d_scale_w1'\] \(FP8\) is not modeled"):
        hpu_kernels.mixture_of_experts(**args, d_scale_w1=[torch.ones(())] * 4)
    with pytest.raises(ValueError, match="experts_min 1 .. experts_max 3 is 3 experts, the weight lists hold 4"):
        hpu_kernels.mixture_of_experts(**args, experts_min=1, experts_max=3)


def test_fused_sdpa_takes_qwen2s_fp32_softmax_mode_exact(scope):
    """qwen2's flash branch passes softmax_mode "fp32" (modeling_qwen2.py:492-493): the softmax in float32,
    which the stand-in computes for every mode."""
    q, k, v = qkv()
    assert torch.equal(hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True, None, "fp32"),
                       hpu_kernels.fused_sdpa(q, k, v, None, 0.0, True))


def test_sdp_kernel_is_a_context_that_changes_nothing_and_only_in_a_flash_ports_scope():
    """sdp_kernel(enable_recompute=...): the recompute mode's context (memory, not values), importable from
    habana_frameworks.torch.hpu inside an importable kernel scope only (the ports import it in their forward),
    gone after it."""
    with pytest.raises(hpu_kernels.StandinOutOfScope):
        with hpu_kernels.sdp_kernel(enable_recompute=True):
            pass
    with habana_standin.kernel_scope(("FusedSDPA",), importable=True):
        import habana_frameworks.torch.hpu as ht

        with ht.sdp_kernel(enable_recompute=True):
            q, k, v = qkv()
            out = hpu_kernels.FusedSDPA.apply(q, k, v, None, 0.0, True)
        torch.testing.assert_close(out, sdpa(q, k, v, is_causal=True), rtol=0, atol=1e-6)
        assert not ht.is_available()
    assert importlib.util.find_spec("habana_frameworks") is None
    assert "habana_frameworks.torch.hpu" not in sys.modules
    with habana_standin.kernel_scope(("FusedSDPA",)):  # not importable: nothing in sys.modules
        assert importlib.util.find_spec("habana_frameworks") is None


def test_mark_step_and_wrap_in_hpu_graph_change_nothing():
    module = torch.nn.Linear(2, 2)
    assert hpu_kernels.wrap_in_hpu_graph(module, disable_tensor_cache=True) is module
    assert hpu_kernels.mark_step() is None


# --- the kernel stand-in's scope: only a declaring port's forward, torch untouched ---------------------------------

def test_a_standin_kernel_outside_a_declaring_ports_forward_raises():
    q, k, v = qkv()
    with pytest.raises(hpu_kernels.StandinOutOfScope, match="FusedSDPA was called outside the forward of a port"):
        hpu_kernels.FusedSDPA.apply(q, k, v)
    with habana_standin.kernel_scope(("mixture_of_experts",)):
        with pytest.raises(hpu_kernels.StandinOutOfScope, match=r"declares only \['mixture_of_experts'\]"):
            hpu_kernels.FusedSDPA.apply(q, k, v)


def test_the_kernel_scope_gives_torch_ops_hpu_one_op_and_puts_back_what_was_there(monkeypatch):
    assert "hpu" not in torch.ops.__dict__
    with habana_standin.kernel_scope(("mixture_of_experts",)):
        assert torch.ops.hpu.mixture_of_experts is hpu_kernels.mixture_of_experts
        with pytest.raises(AttributeError):
            torch.ops.hpu.sdpa_fwd  # noqa: B018  (no other HPU op: as a stack that lacks it)
        with habana_standin.kernel_scope(("mixture_of_experts",)):  # nested: the outer one puts back
            pass
        assert "hpu" in torch.ops.__dict__
    assert "hpu" not in torch.ops.__dict__
    with habana_standin.kernel_scope(("FusedSDPA",)):  # no MoE op declared: no torch.ops.hpu
        assert "hpu" not in torch.ops.__dict__
    before = object()
    monkeypatch.setattr(torch.ops, "hpu", before, raising=False)
    with habana_standin.kernel_scope(("mixture_of_experts",)):
        assert torch.ops.hpu is not before
    assert torch.ops.hpu is before
    assert not getattr(torch, "hpu", None) or not torch.hpu.is_available()


def test_the_kernel_standin_imports_only_the_declared_kernels_and_leaves_no_hpu(tmp_path, monkeypatch):
    (tmp_path / "like_mixtral.py").write_text(
        "import habana_frameworks.torch.core as htcore\n"
        "from habana_frameworks.torch.hpex.kernels import FusedSDPA\n"
        "try:\n    from habana_frameworks.torch.hpex.normalization import FusedRMSNorm\n"
        "except ImportError:\n    FusedRMSNorm = None\n"
        "from habana_frameworks.torch.hpu import wrap_in_hpu_graph, is_available\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        module = habana_standin.import_with_standin("like_mixtral", kernels=("FusedSDPA",))
        assert module.FusedSDPA is hpu_kernels.FusedSDPA and module.FusedRMSNorm is None
        assert module.wrap_in_hpu_graph is hpu_kernels.wrap_in_hpu_graph and module.is_available() is False
        no_hpu_left()
    finally:
        sys.modules.pop("like_mixtral", None)
    with pytest.raises(ValueError, match=r"unknown kernels \['FusedAdamW'\]"):
        habana_standin.import_with_standin("like_mixtral", kernels=("FusedAdamW",))
    no_hpu_left()


def test_an_hpu_branch_is_the_functions_own_code_with_its_device_test_answered_as_on_an_hpu(scope, tmp_path,
                                                                                           monkeypatch):
    (tmp_path / "like_port.py").write_text(
        "FusedRoPE = None\n"
        "def rope(q, cos, sin, position_ids):\n"
        "    if q.device.type == 'hpu' and FusedRoPE is not None:\n"
        "        return FusedRoPE.apply(q, cos, sin, position_ids)\n"
        "    raise RuntimeError('the CPU branch')\n"
        "def plain(q):\n"
        "    return q\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import like_port

    try:
        with pytest.raises(RuntimeError, match="the CPU branch"):
            like_port.rope(torch.zeros(1, 1, 2, 4), None, None, None)
        branch = hpu_kernels.hpu_branch(like_port.rope)
        cos, sin = torch.ones(1, 1, 3, 4), torch.zeros(1, 1, 3, 4)
        x = torch.randn(1, 1, 2, 4)
        assert torch.equal(branch(x, cos, sin, torch.tensor([[0, 1]])), x)  # cos 1, sin 0: x itself
        assert branch.__code__.co_filename == like_port.__file__ and branch.__code__.co_firstlineno == 2
        assert like_port.FusedRoPE is None  # the module is untouched
        with pytest.raises(ValueError, match="has no device test"):
            hpu_kernels.hpu_branch(like_port.plain)
    finally:
        sys.modules.pop("like_port", None)


def test_device_label_marks_only_a_declaring_ports_cpu_cases(monkeypatch):
    from mpt_kv.families import FAMILIES
    from mpt_kv.targets import FamilyTarget

    mixtral = FamilyTarget("optimum-habana", "mixtral", "moe-2of4")
    assert habana_standin.device_label(mixtral, "cpu") == "cpu+standin"
    assert habana_standin.device_label(FamilyTarget("optimum-habana", FAMILIES["minicpm"], "mla"), "cpu") == \
        "cpu+standin"
    assert habana_standin.device_label(mixtral, "hpu") == "hpu"
    assert habana_standin.device_label(FamilyTarget("transformers", "mixtral", "moe-2of4"), "cpu") == "cpu"
    assert habana_standin.device_label(FamilyTarget("optimum-habana", "llama", "gqa"), "cpu") == "cpu"
    # a recipe with --use_flash_attention runs the stand-in's FusedSDPA in its flash branch (tests/test_recipes.py)
    llama = FamilyTarget("optimum-habana", "llama", "gqa")
    assert habana_standin.device_label(llama, "cpu", "static@flash-bucket") == "cpu+standin"
    assert habana_standin.device_label(llama, "cpu", "static+reuse@reuse-trim-softmax") == "cpu"
    assert habana_standin.device_label(FamilyTarget("transformers", "llama", "gqa"), "cpu", "static") == "cpu"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "habana_frameworks" else None)
    assert habana_standin.device_label(mixtral, "cpu") == "cpu"  # a real stack: the real kernels, no stand-in
    assert habana_standin.device_label(llama, "cpu", "static@flash-bucket") == "cpu"
    with pytest.raises(RuntimeError, match="kernel stand-in refused: a real habana_frameworks is installed"):
        with habana_standin.kernel_scope(("mixture_of_experts",)):
            pass


ON_A_GAUDI = """
import sys, torch
from mpt_kv.families import FAMILIES, habana_standin
from mpt_kv.families.implementations import IMPLEMENTATIONS
from mpt_kv.targets import FamilyTarget, gaudi

# optimum-habana's package __init__ files need its full dependency set (a Gaudi image has it); here
# its parent packages are registered bare first, so the port module itself takes the normal import path
gaudi.register_bare_parents(gaudi.optimum_habana_root(), FAMILIES["qwen2_moe"].gaudi.module)
runner = IMPLEMENTATIONS["optimum-habana"](FAMILIES["qwen2_moe"], "moe-2of4")
target = FamilyTarget("optimum-habana", "qwen2_moe", "moe-2of4")
print("hpu available:", torch.hpu.is_available())
print("stand-in kernels imported:", "mpt_kv.families.hpu_kernels" in sys.modules)
print("habana_frameworks real:", not habana_standin.is_standin(sys.modules["habana_frameworks"]))
print("forward hooks:", len(runner.model._forward_pre_hooks), len(runner.model._forward_hooks))
print("labels:", habana_standin.device_label(target, "cpu"), habana_standin.device_label(target, "hpu"))
ids = torch.randint(1, 100, (1, 4))
try:
    runner.logits(ids, torch.ones_like(ids))
except Exception as e:  # the fake stack has no MoE op: the real failure, never the stand-in's
    print("forward:", type(e).__name__, str(e).splitlines()[0][:120])
"""


@pytest.mark.optimum_habana
def test_where_habana_frameworks_is_installed_the_kernel_standin_is_never_imported(tmp_path):
    """On a Gaudi (here the simulated one, tests/fakes/hpu) a port that declares stand-in kernels is
    imported the normal way: its kernels are whatever the installed stack has, mpt_kv's stand-in
    module is never imported, no forward runs in a kernel scope, its cases are labelled by their
    device, and an op the stack lacks fails as it would there."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fakes" / "hpu"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", ON_A_GAUDI], env=env, capture_output=True, text=True, timeout=HANG_S,
                         cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "hpu available: True" in text and "habana_frameworks real: True" in text
    assert "stand-in kernels imported: False" in text and "forward hooks: 0 0" in text
    assert "labels: cpu hpu" in text
    assert "forward: " in text and "mixture_of_experts" in text and "stand-in" not in text.split("forward: ")[1]


def test_a_port_entry_names_only_kernels_the_standin_has():
    from mpt_kv.families.base import GaudiPort

    with pytest.raises(ValueError, match=r"kernels \('FusedAdamW',\): a tuple of the stand-in's kernels"):
        GaudiPort(module="m", causal_lm="C", hf_module="h", kernels=("FusedAdamW",))
    with pytest.raises(ValueError, match="a tuple of the stand-in's kernels"):
        GaudiPort(module="m", causal_lm="C", hf_module="h", kernels="FusedSDPA")  # a string, not a tuple
    assert GaudiPort(module="m", causal_lm="C", hf_module="h", kernels=("FusedSDPA",)).kernels == ("FusedSDPA",)
