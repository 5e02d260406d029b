"""Qwen2: separate q/k/v (with bias), rotary, GQA."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches


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
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
