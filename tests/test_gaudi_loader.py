"""The optimum-habana loader applies what the installed release's `adapt_transformers_to_gaudi`
does for MPT, read from its modeling_utils.py: class-style patches (1.14 and later) and
function-style ones (1.7 to 1.13: `MptAttention.forward = gaudi_mpt_attention_forward`). Fake
release trees here; the real releases run in the sweep (docs/releases.md)."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch
import transformers
from packaging.version import Version

import transformers.models.mpt.modeling_mpt as hf
from mpt_kv.errors import TargetUnavailable
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets import gaudi

FUNCTION_STYLE = """
    import transformers
    from .models import GaudiMptForCausalLM, GaudiMptModel, gaudi_mpt_attention_forward, gaudi_mpt_block_forward

    def adapt_transformers_to_gaudi():
        transformers.models.bloom.modeling_bloom.BloomModel = GaudiBloomModel  # not MPT: ignored
        # Optimization for mpt on Gaudi
        transformers.models.mpt.modeling_mpt.MptForCausalLM = GaudiMptForCausalLM
        transformers.models.mpt.modeling_mpt.MptModel = GaudiMptModel
        transformers.models.mpt.modeling_mpt.MptAttention.forward = gaudi_mpt_attention_forward
        transformers.models.mpt.modeling_mpt.MptBlock.forward = gaudi_mpt_block_forward
"""


def fake_release(tmp_path, modeling_utils: str, **attrs):
    """A module standing for optimum-habana's MPT module, with the release's modeling_utils.py."""
    folder = tmp_path / "optimum" / "habana" / "transformers"
    (folder / "models" / "mpt").mkdir(parents=True)
    (folder / "modeling_utils.py").write_text(textwrap.dedent(modeling_utils))
    module = types.ModuleType("fake_gaudi_mpt")
    module.__file__ = str(folder / "models" / "mpt" / "modeling_mpt.py")
    for name, value in attrs.items():
        setattr(module, name, value)
    return module


def function_style(tmp_path, calls):
    original_attn, original_block = hf.MptAttention.forward, hf.MptBlock.forward

    def gaudi_mpt_attention_forward(self, *args, **kwargs):
        calls.append("attention")
        return original_attn(self, *args, **kwargs)

    def gaudi_mpt_block_forward(self, *args, **kwargs):
        calls.append("block")
        return original_block(self, *args, **kwargs)

    class GaudiMptModel(hf.MptModel):
        pass

    class GaudiMptForCausalLM(hf.MptForCausalLM):
        pass

    return fake_release(tmp_path, FUNCTION_STYLE, GaudiMptForCausalLM=GaudiMptForCausalLM, GaudiMptModel=GaudiMptModel,
                        gaudi_mpt_attention_forward=gaudi_mpt_attention_forward,
                        gaudi_mpt_block_forward=gaudi_mpt_block_forward)


def test_function_style_patches_are_read_in_order(tmp_path):
    module = function_style(tmp_path, [])
    patches = gaudi.mpt_patches(module)
    assert [(p.name, p.attribute, p.value) for p in patches] == [
        ("MptForCausalLM", None, "GaudiMptForCausalLM"), ("MptModel", None, "GaudiMptModel"),
        ("MptAttention", "forward", "gaudi_mpt_attention_forward"), ("MptBlock", "forward", "gaudi_mpt_block_forward")]


def test_function_style_release_builds_and_leaves_transformers_untouched(tmp_path):
    calls = []
    module = function_style(tmp_path, calls)
    before = {n: getattr(hf, n) for n in ("MptModel", "MptBlock", "MptAttention", "MptForCausalLM")}
    forwards = (hf.MptAttention.forward, hf.MptBlock.forward)
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=2, vocab_size=16, max_seq_len=8)
    with gaudi.gaudi_classes(module):
        model = module.GaudiMptForCausalLM(cfg.to_hf())
    model.load_state_dict(random_state_dict(cfg), strict=True)
    assert type(model.transformer) is module.GaudiMptModel
    attn = model.transformer.blocks[0].attn
    assert type(attn).forward is module.gaudi_mpt_attention_forward and isinstance(attn, before["MptAttention"])
    model.eval()(torch.tensor([[1, 2, 3]]), use_cache=False)
    assert calls == ["block", "attention"] * 2  # both layers run the release's forwards
    assert {n: getattr(hf, n) for n in before} == before  # restored, and transformers' own forwards unpatched
    assert (hf.MptAttention.forward, hf.MptBlock.forward) == forwards


def test_a_release_whose_attention_never_reads_clip_qkv_declares_it(tmp_path):
    module = function_style(tmp_path, [])
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
    with gaudi.gaudi_classes(module):
        model = module.GaudiMptForCausalLM(cfg.to_hf())
    assert "clip_qkv" in gaudi.release_capabilities(model).unsupported  # the fake forward only delegates
    if Version(transformers.__version__) >= Version("4.43"):  # 4.40.2 does not clamp, 4.43.4 does
        plain = hf.MptForCausalLM(cfg.to_hf())
        assert gaudi.release_capabilities(plain).unsupported == {}  # transformers' MptAttention clamps


@pytest.mark.parametrize("source, message", [
    ("def adapt_transformers_to_gaudi():\n    transformers.models.llama.modeling_llama.LlamaModel = X\n",
     "patches nothing of transformers.models.mpt.modeling_mpt: this release has no Gaudi MPT"),
    ("def something_else():\n    pass\n", "defines no adapt_transformers_to_gaudi"),
    ("def adapt_transformers_to_gaudi():\n    transformers.models.mpt.modeling_mpt.MptModel = GaudiMptModelX\n",
     "modeling_utils.py:2: transformers.models.mpt.modeling_mpt.MptModel = GaudiMptModelX: fake_gaudi_mpt has no "
     "'GaudiMptModelX'"),
    ("def adapt_transformers_to_gaudi():\n    transformers.models.mpt.modeling_mpt.MptModel.forward.x = f(1)\n",
     "modeling_utils.py:2: the loader cannot apply 'transformers.models.mpt.modeling_mpt.MptModel.forward.x = f(1)'"),
    ("def adapt_transformers_to_gaudi(:\n", "cannot read adapt_transformers_to_gaudi from"),
])
def test_a_release_the_loader_cannot_build_is_an_error_naming_it(tmp_path, source, message):
    module = fake_release(tmp_path, source)
    with pytest.raises(TargetUnavailable, match="^optimum-habana ") as e:
        with gaudi.gaudi_classes(module):
            pass
    assert message in str(e.value)


@pytest.mark.optimum_habana
def test_the_installed_release_is_read_from_its_own_file():
    module = gaudi.load_gaudi_mpt_module()
    names = {p.name for p in gaudi.mpt_patches(module)}
    assert {"MptForCausalLM", "MptModel", "MptAttention", "MptBlock"} <= names
