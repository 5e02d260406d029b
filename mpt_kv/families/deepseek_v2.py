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
# Fields the Hub checkpoints' config.json carry (deepseek-ai/DeepSeek-V2-Lite) that transformers' DeepseekV2Config
# does not declare (it keeps them as attributes, its model ignores them) and optimum-habana's port, a copy of the
# Hub's remote code, reads (models/deepseek_v2/modeling_deepseek_v2.py:491 scoring_func, :1485 moe_layer_freq):
# the checkpoint's values, which route as transformers' model does (softmax scores, greedy top-k)
HUB_FIELDS = {"moe_layer_freq": 1, "scoring_func": "softmax"}


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
                latent_width=latent_width, stored_width=expanded_before_5, variants={"mla": {**MLA, **HUB_FIELDS, "q_lora_rank": None}},
    # optimum-habana 1.21.2 models/deepseek_v2/modeling_deepseek_v2.py: its own copy of the Hub's remote code (its
    # own config and model classes, DeepseekV2ForCausalLM keeps transformers' name), imports
    # habana_frameworks.torch.core at module level (line 26), allocate_kv_cache (line 962). Its
    # MoE layers call an HPU kernel in eval: off an HPU it runs through the kernel stand-in (below)
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.deepseek_v2.modeling_deepseek_v2", causal_lm="DeepseekV2ForCausalLM",
        hf_module="transformers.models.deepseek_v2.modeling_deepseek_v2", standin=True, forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS, reuse_cache=None, reuse_kv=self_attn_kv_caches,
        # its MoE layers call torch.ops.hpu.mixture_of_experts in eval, one slice of experts at a time,
        # with no CPU fallback (models/deepseek_v2/modeling_deepseek_v2.py:670-690): off an HPU, the
        # kernel stand-in's. Its prefill attention's RoPE (first_token: prefill_forward, :1204) has a CPU
        # branch that cannot run (apply_customized_rope, :415-421, calls the 4-argument
        # apply_rotary_pos_emb(q, cos, sin, position_ids) with 5: the key as cos, an IndexError in every
        # prefill, on CPU only), so it takes its HPU branch (FusedRoPE, :416-419) with the stand-in's
        kernels=("mixture_of_experts", "RotaryPosEmbeddingHelperV2"), hpu_branches=("apply_customized_rope",)))
