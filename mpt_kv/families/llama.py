"""Llama: separate q/k/v, rotary; MHA, GQA and MQA (num_key_value_heads); and optimum-habana's
own `config.fused_qkv=True` (one `qkv_proj`), which transformers' LlamaConfig keeps as an
unknown attribute and its model ignores (separate q/k/v there)."""

import torch

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches


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
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches, state_dict=fused_state_dict),
)
