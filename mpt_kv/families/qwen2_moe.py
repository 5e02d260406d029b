"""Qwen2-MoE: qwen2's attention (q/k/v with bias, GQA) with a mixture-of-experts MLP (2 of 4
routed experts per token, plus a shared expert)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

FAMILY = Family(name="qwen2_moe", model_type="qwen2_moe", design="full+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                 "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}},
    # optimum-habana 1.21.2 models/qwen2_moe/modeling_qwen2_moe.py: imports habana_frameworks.torch.core at
    # module level (line 26); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 288) and each attention's k_cache/v_cache; its forward reads
    # generation_config.use_fused_rope
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.qwen2_moe.modeling_qwen2_moe", causal_lm="GaudiQwen2MoeForCausalLM",
        hf_module="transformers.models.qwen2_moe.modeling_qwen2_moe", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches,
        # its sparse MoE block calls torch.ops.hpu.mixture_of_experts, with no CPU fallback
        # (models/qwen2_moe/modeling_qwen2_moe.py:564): off an HPU, the kernel stand-in's
        kernels=("mixture_of_experts",)),
)
