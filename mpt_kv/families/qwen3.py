"""Qwen3: separate q/k/v, per-head RMSNorm on q and k before rotary (q/k norms), GQA."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

FAMILY = Family(name="qwen3", model_type="qwen3", design="full+qk-norm", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}},
    # optimum-habana 1.21.2 models/qwen3/modeling_qwen3.py: imports habana_frameworks.torch.core at
    # module level (line 75); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 338) and each attention's k_cache/v_cache; its forward reads
    # generation_config.use_fused_rope
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.qwen3.modeling_qwen3", causal_lm="GaudiQwen3ForCausalLM",
        hf_module="transformers.models.qwen3.modeling_qwen3", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
