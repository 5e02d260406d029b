"""Llama: separate q/k/v, rotary; MHA, GQA and MQA (num_key_value_heads); and optimum-habana's
own `config.fused_qkv=True` (one `qkv_proj`), which transformers' LlamaConfig keeps as an
unknown attribute and its model ignores (separate q/k/v there)."""

import torch

from mpt_kv.families.base import Family, GaudiPort


def reuse_kv(model) -> list[tuple]:
    """With reuse_cache the port returns only the shapes; its cache is each attention's KVCache."""
    return [(layer.self_attn.k_cache.cache, layer.self_attn.v_cache.cache) for layer in model.model.layers]


def fused_state_dict(state_dict: dict, config) -> dict:
    """transformers' weights in the port's layout: with fused_qkv the port has one `qkv_proj`
    whose output it splits as [q, k, v] (models/llama/modeling_llama.py:476-483 and :600),
    so its weight is q_proj's, k_proj's and v_proj's stacked in that order."""
    if not getattr(config, "fused_qkv", False):
        return state_dict
    out = dict(state_dict)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            names = [f"{p}{n}_proj.{kind}" for n in "qkv"]
            if all(n in out for n in names):
                out[f"{p}qkv_proj.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


FAMILY = Family(name="llama", model_type="llama", variants={
    "mha": {"intermediate_size": 64}, "gqa": {"intermediate_size": 64, "num_key_value_heads": 2},
    "mqa": {"intermediate_size": 64, "num_key_value_heads": 1},
    "fused-qkv": {"intermediate_size": 64, "num_key_value_heads": 2, "fused_qkv": True}},
    # optimum-habana 1.21.2 models/llama/modeling_llama.py: imports habana_frameworks.torch.core at
    # module level (line 51); legacy per-layer (key, value) (concat: tuples, static: [key, value]
    # lists written with index_copy_, KVCache.update lines 328-346); reuse_cache: allocate_kv_cache
    # (line 528). Its forward reads generation_config.use_fused_rope (line 1446): None, as a
    # GaudiGenerationConfig has it unless the user sets it.
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.llama.modeling_llama", causal_lm="GaudiLlamaForCausalLM",
        hf_module="transformers.models.llama.modeling_llama", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs={"lazy_mode": False, "use_flash_attention": False, "attn_softmax_bf16": False,
                        "trim_logits": False},
        unsupported={"bucket": "optimum-habana's bucket_internal pads the returned cache in generate "
                               "(_pad_past_key_values), which this driver does not do"},
        reuse_cache=None, reuse_kv=reuse_kv, state_dict=fused_state_dict),
)
