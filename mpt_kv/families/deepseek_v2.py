"""DeepSeek-V2: multi-head latent attention (MLA) and a mixture-of-experts MLP. One fused
projection, `kv_a_proj_with_mqa`, makes each token's compressed latent (kv_lora_rank) and its
shared rotary key part (qk_rope_head_dim) in one output; the cache holds those two (transformers
5.x: the normalized latent as "key", the rotated rope part as "value", one head each), never K and V
(`kv_b_proj` expands them at every step). The seed bug class applies to that fused output: a cache
holding a view of it pins the other part. The tiny latent (4) is smaller than the head dim (8 + 4);
layer 0 dense, layer 1 routes 2 of 4 experts."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

MLA = {"intermediate_size": 64, "moe_intermediate_size": 32, "num_key_value_heads": 4, "kv_lora_rank": 4,
       "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4,
       "num_experts_per_tok": 2, "first_k_dense_replace": 1}


def latent_width(config) -> int:
    """Elements per token per layer: the compressed latent and the shared rope key part."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def expanded_before_5(config) -> int | None:
    """transformers 4.x's DeepSeek caches the expanded K (heads x (nope + rope)) and V (heads x
    v_head_dim), not the latent (4.55.4 models/deepseek_v2/modeling_deepseek_v2.py: the cache update
    after kv_b_proj); None (the latent) from 5.0 on."""
    from mpt_kv.versions import transformers_major

    if transformers_major() >= 5:
        return None
    return config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)


FAMILY = Family(name="deepseek_v2", model_type="deepseek_v2", design="latent+moe", fused="kv_a_proj_with_mqa",
                latent_width=latent_width, stored_width=expanded_before_5, variants={"mla": {**MLA, "q_lora_rank": None}},
    # optimum-habana 1.21.2 models/deepseek_v2/modeling_deepseek_v2.py: its own copy of the Hub's remote code (its
    # own config and model classes, DeepseekV2ForCausalLM keeps transformers' name), imports
    # habana_frameworks.torch.core at module level (line 26), allocate_kv_cache (line 962). Its
    # MoE layers call an HPU kernel in eval: not run off an HPU (its loading with transformers'
    # weights is checked there, on Gaudi)
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.deepseek_v2.modeling_deepseek_v2", causal_lm="DeepseekV2ForCausalLM",
        hf_module="transformers.models.deepseek_v2.modeling_deepseek_v2", standin=True, forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS, reuse_cache=None, reuse_kv=self_attn_kv_caches,
        needs_hpu="its MoE layers call torch.ops.hpu.mixture_of_experts in eval, with no CPU fallback "
                  "(optimum-habana 1.21.2 models/deepseek_v2/modeling_deepseek_v2.py:678)"))
