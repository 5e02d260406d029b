"""The checks as plain functions a third party calls (mpt_kv.checks.registry), the capability
declaration they honour, and the ready-made wrappers (mpt_kv.targets.wrappers)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mpt_kv
from mpt_kv import CHECKS, Capabilities, PropertyFailure, Unsupported
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks.properties import Case
from mpt_kv.checks.strategies import cases
from mpt_kv.model.config import ModelConfig
from mpt_kv.targets import target_name
from mpt_kv.targets.reference import ReferenceRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "downstream" / "src"))
from tinympt import TinyMptConfig, TinyMptForCausalLM  # noqa: E402

CPU, FP32 = torch.device("cpu"), torch.float32
CLIP_CASE = Case(ModelConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=0.5), (5, 3), 3, seed=4)


def test_every_check_has_a_stable_unique_id_naming_its_property_and_path():
    ids = list(CHECKS)
    assert len(ids) == len(set(ids))
    assert ids[:3] == ["P0", "P1/concat", "P1/static"]
    assert "P2/static+bucket4" in ids and "memory/static+bucket8/B4-in32-new8" in ids
    for check in CHECKS.values():
        assert check.id.split("/")[0] == check.property and str(check) == check.id


def test_a_check_is_a_plain_function_that_raises_property_failure_on_a_bad_target():
    assert CHECKS["P1/static"]("reference", "cpu", "fp32") == []
    bad = VARIANTS["static_cache_not_written"].build
    with pytest.raises(PropertyFailure, match=r"P1 decode logits vs full forward.*target=mpt_kv\.catalogue\."):
        CHECKS["P1/static"](bad, CPU, FP32)
    # one case, no hypothesis: what a failure's "Falsifying example" prints can be rerun
    with pytest.raises(PropertyFailure, match="P1 decode logits"):
        CHECKS["P1/static"].run_case(bad, CPU, FP32, CLIP_CASE)


def test_a_memory_check_without_stored_ceilings_checks_the_analytic_properties():
    check = CHECKS["memory/concat/B16-in8-new8"]
    assert check("reference", CPU, FP32) == []
    with pytest.raises(PropertyFailure, match="bytes too many .* views of it pin its q third"):
        check(VARIANTS["kv_views_of_mixed_qkv"].build, CPU, FP32)


# --- capabilities -----------------------------------------------------------------------------------------

class IgnoresClip(ReferenceRunner):
    """An attention without clip_qkv: the model is built as if clip_qkv were off."""

    def __init__(self, cfg, state_dict, device, dtype):
        super().__init__(dataclasses.replace(cfg, clip_qkv=None), state_dict, device, dtype)


class DeclaresNoClip(IgnoresClip):
    capabilities = Capabilities({"clip_qkv": "this port has no clip_qkv"})


def ignores_clip(cfg, state_dict, device, dtype):
    return IgnoresClip(cfg, state_dict, device, dtype)


def declares_no_clip(cfg, state_dict, device, dtype):
    return DeclaresNoClip(cfg, state_dict, device, dtype)


def test_without_the_declaration_a_missing_clip_qkv_fails_p0():
    with pytest.raises(PropertyFailure, match="P0 uncached logits vs reference.*clip_qkv=0.5"):
        CHECKS["P0"].run_case(ignores_clip, CPU, FP32, CLIP_CASE)


@settings(max_examples=60, database=None)
@given(st.data())
def test_a_declared_missing_clip_qkv_is_never_drawn(data):
    caps = Capabilities({"clip_qkv": "no"})
    assert data.draw(cases("cpu", capabilities=caps)).cfg.clip_qkv is None


def test_a_target_without_clip_qkv_still_runs_p0_and_static_shape_without_it():
    assert CHECKS["P0"](declares_no_clip, CPU, FP32) == []
    assert CHECKS["static-shape/static"](declares_no_clip, CPU, FP32) == []  # its fixed case, clip_qkv off
    with pytest.raises(Unsupported, match="declares_no_clip: this port has no clip_qkv"):
        CHECKS["P0"].run_case(declares_no_clip, CPU, FP32, CLIP_CASE)  # a clip case: the target's reason


def test_capabilities_reject_unknown_features_and_empty_reasons():
    with pytest.raises(ValueError, match=r"unknown features \['kv_cache_pool'\]"):
        Capabilities({"kv_cache_pool": "x"})
    with pytest.raises(ValueError, match="non-empty string"):
        Capabilities({"bucket": " "})


def test_a_declared_unsupported_dtype_or_device_skips_with_the_targets_reason():
    class NoBf16(ReferenceRunner):
        capabilities = Capabilities({"bf16": "our kernels are fp32 only"})

    def build(cfg, state_dict, device, dtype):
        return NoBf16(cfg, state_dict, device, dtype)

    with pytest.raises(Unsupported, match="our kernels are fp32 only"):
        CHECKS["P1/concat"](build, CPU, torch.bfloat16)
    assert CHECKS["P1/concat"](build, CPU, FP32) == []


# --- wrappers ---------------------------------------------------------------------------------------------

def tinympt(cfg, state_dict, device, dtype):
    """The README's adapter for a model with optimum-habana's signature and no cache_idx."""
    model = TinyMptForCausalLM(TinyMptConfig(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len))
    model.load_state_dict(state_dict)
    return mpt_kv.GaudiStyleRunner(model.to(device, dtype).eval(), device)


def test_gaudi_style_runner_declares_what_the_forward_lacks_instead_of_a_type_error_per_case():
    for path in ("static", "concat"):
        assert CHECKS[f"P1/{path}"](tinympt, CPU, FP32) == []
    with pytest.raises(Unsupported, match=r"TinyMptForCausalLM.forward has no cache_idx parameter"):
        CHECKS["P1/static+bucket4"](tinympt, CPU, FP32)


def test_an_adapter_that_passes_a_keyword_the_model_lacks_is_a_type_error_not_a_property_failure():
    class AlwaysCacheIdx(mpt_kv.GaudiStyleRunner):
        """What GaudiStyleRunner did before: cache_idx= on every call."""

        def __init__(self, model, device):
            super().__init__(model, device, capabilities=Capabilities())
            self.capabilities = Capabilities()  # claims buckets

    def build(cfg, state_dict, device, dtype):
        return AlwaysCacheIdx(tinympt(cfg, state_dict, device, dtype).model, device)

    with pytest.raises(TypeError, match="cache_idx"):
        CHECKS["P1/static+bucket4"](build, CPU, FP32)


def test_transformers_runner_wraps_a_transformers_style_model():
    from transformers import MptForCausalLM

    def build(cfg, state_dict, device, dtype):
        model = MptForCausalLM(cfg.to_hf())
        model.load_state_dict(state_dict)
        return mpt_kv.TransformersRunner(model.to(device, dtype).eval(), device, name="my-hf-mpt")

    assert CHECKS["P1/concat"](build, CPU, FP32) == []
    with pytest.raises(Unsupported, match="Cache objects have no cache_idx buckets"):
        CHECKS["P1/static+bucket4"](build, CPU, FP32)


def test_a_factory_that_returns_no_runner_is_an_error_naming_it():
    def build(cfg, state_dict, device, dtype):
        return object()

    with pytest.raises(TypeError, match=r"test_registry:.*build: the factory returned object, expected a mpt_kv.targets.Runner"):
        CHECKS["P0"](build, CPU, FP32)
    assert target_name(build).startswith("test_registry:")


def test_the_public_api_imports_lazily():
    import subprocess

    code = "import sys, mpt_kv; assert 'torch' not in sys.modules; print(sorted(mpt_kv.__all__)[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "CHECKS" in out


@pytest.mark.parametrize("example, limit", [("downstream/src/tinympt", 15), ("own_signature/src/ownmpt", 20)])
def test_the_example_adapters_are_short_and_use_only_documented_api(example, limit):
    """The acceptance of issues 10 and 30: a model with optimum-habana's signature and no cache_idx
    is adapted in <= 15 lines, one with its own forward signature and caches (CallableRunner) in
    <= 20, each importing only names mpt_kv exports (docs/targets.md)."""
    import ast

    source = Path(__file__).resolve().parents[1] / "examples" / example / "mpt_kv_target.py"
    tree = ast.parse(source.read_text())
    docstring = {n.lineno for n in tree.body[:1] if isinstance(n, ast.Expr)}
    code = [i for i, line in enumerate(source.read_text().splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and i not in docstring]
    assert len(code) <= limit, f"{len(code)} lines of code in {source}, more than {limit}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("mpt_kv"):
            assert node.module == "mpt_kv" and all(a.name in mpt_kv.__all__ for a in node.names), ast.dump(node)


@pytest.mark.parametrize("kwargs, message", [
    (dict(targets=[]), "an empty target list"),
    (dict(targets=["reference"], checks=[]), "no checks selected"),
    (dict(targets=["reference"], checks=["P9"]), "unknown properties or check ids"),
])
def test_parametrize_with_checks_that_would_check_nothing_is_an_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mpt_kv.parametrize_with_checks(**kwargs)


# --- a target is resolved once ---------------------------------------------------------------------------------

def test_a_target_spec_is_resolved_once_per_check_call(monkeypatch):
    """The spec is resolved where the check is called; the probe, every drawn case's runner and
    its messages use that one object (it used to be resolved and built from its string four times)."""
    import mpt_kv.targets as T

    loads, real = [], T._load
    monkeypatch.setattr(T, "_load", lambda spec: loads.append(spec) or real(spec))
    assert CHECKS["static-shape/static"]("reference", CPU, FP32) == []
    assert loads == ["reference"]
    resolved = T.resolve_target("reference")
    loads.clear()
    CHECKS["static-shape/static"](resolved, CPU, FP32)
    CHECKS["P1/static"].run_case(resolved, CPU, FP32, CLIP_CASE)
    assert loads == [], "a ResolvedTarget is passed on, never resolved again"


def test_a_resolved_target_has_its_name_factory_and_declared_capabilities_read_once():
    from mpt_kv.targets import ResolvedTarget, build, resolve, resolve_target

    built = []

    def counting(cfg, state_dict, device, dtype):
        built.append(dtype)
        return DeclaresNoClip(cfg, state_dict, device, dtype)

    target = resolve_target(counting)
    assert isinstance(target, ResolvedTarget) and resolve_target(target) is target
    assert target.name == target_name(counting) == target_name(target) and target.factory is counting
    assert resolve(target) is counting and isinstance(build(target, CLIP_CASE.cfg, _state(CLIP_CASE), CPU, FP32),
                                                      IgnoresClip)
    built.clear()
    first = target.capabilities("cpu", FP32)
    assert target.capabilities(CPU, FP32) is first and resolve_target(counting).capabilities("cpu", FP32) is first
    assert built == [FP32], "the probe is built once per device and dtype"
    assert "clip_qkv" in first.unsupported
    with pytest.raises(TypeError, match="not int"):
        resolve_target(3)


def _state(case):
    from mpt_kv.model.config import random_state_dict

    return random_state_dict(case.cfg, seed=case.seed)
