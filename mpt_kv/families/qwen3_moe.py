"""Qwen3-MoE: qwen3's attention (q/k norms, GQA) with a mixture-of-experts MLP (2 of 4 experts per
token): routing in a cached step sees only the new tokens; the cache is the attention's alone."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

FAMILY = Family(name="qwen3_moe", model_type="qwen3_moe", design="full+qk-norm+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "moe_intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8,
                 "num_experts": 4, "num_experts_per_tok": 2}},
    # optimum-habana 1.21.2 models/qwen3_moe/modeling_qwen3_moe.py: imports habana_frameworks.torch.core at
    # module level (line 84); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 354) and each attention's k_cache/v_cache; its forward reads
    # generation_config.use_fused_rope
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.qwen3_moe.modeling_qwen3_moe", causal_lm="GaudiQwen3MoeForCausalLM",
        hf_module="transformers.models.qwen3_moe.modeling_qwen3_moe", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches,
        # its sparse MoE block calls torch.ops.hpu.mixture_of_experts in eval, with no CPU fallback
        # (models/qwen3_moe/modeling_qwen3_moe.py:638): off an HPU, the kernel stand-in's
        kernels=("mixture_of_experts",)),
)
