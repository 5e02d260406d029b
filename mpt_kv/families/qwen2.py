"""Qwen2: separate q/k/v (with bias), rotary, GQA."""

from mpt_kv.families.base import Family, GaudiPort


def reuse_kv(model) -> list[tuple]:
    """With reuse_cache the port returns only the shapes; its cache is each attention's KVCache."""
    return [(layer.self_attn.k_cache.cache, layer.self_attn.v_cache.cache) for layer in model.model.layers]


FAMILY = Family(name="qwen2", model_type="qwen2", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}},
    # optimum-habana 1.21.2 models/qwen2/modeling_qwen2.py: imports habana_frameworks.torch.core at
    # module level (line 74); legacy per-layer (key, value); token_idx writes with index_copy_
    # (KVCache.update, modeling_all_models.py:67); reuse_cache: allocate_kv_cache (line 337). Its
    # forward reads generation_config.use_fused_rope (line 915).
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.qwen2.modeling_qwen2", causal_lm="GaudiQwen2ForCausalLM",
        hf_module="transformers.models.qwen2.modeling_qwen2", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs={"lazy_mode": False, "use_flash_attention": False, "attn_softmax_bf16": False,
                        "trim_logits": False},
        unsupported={"bucket": "optimum-habana's bucket_internal pads the returned cache in generate "
                               "(_pad_past_key_values), which this driver does not do"},
        reuse_cache=None, reuse_kv=reuse_kv),
)
