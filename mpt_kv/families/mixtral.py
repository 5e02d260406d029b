"""Mixtral: mistral's attention (GQA, rotary) with a sparse mixture-of-experts MLP (2 of 4 experts
per token)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

FAMILY = Family(name="mixtral", model_type="mixtral", design="full+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 4,
                 "num_experts_per_tok": 2}},
    # optimum-habana 1.21.2 models/mixtral/modeling_mixtral.py: imports habana_frameworks.torch.core at
    # module level (line 26); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 333) and each attention's k_cache/v_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.mixtral.modeling_mixtral", causal_lm="GaudiMixtralForCausalLM",
        hf_module="transformers.models.mixtral.modeling_mixtral", standin=True,
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches,
        # its sparse MoE block calls torch.ops.hpu.mixture_of_experts in eval, with no CPU fallback
        # (models/mixtral/modeling_mixtral.py:249 via :230): off an HPU, the kernel stand-in's; its
        # attention calls FusedSDPA wherever it imports (:327, :421-449: not only with use_flash_attention),
        # as on a Gaudi; its RoPE's
        # CPU branch cannot run (apply_customized_rope, :116-120, hands transformers 4.55's
        # apply_rotary_pos_emb the rotary table, not each position's cos/sin: a shape error in every forward,
        # on CPU only), so it takes its HPU branch (apply_customized_rope_module) with the stand-in's FusedRoPE
        kernels=("mixture_of_experts", "FusedSDPA", "RotaryPosEmbeddingHelperV2"),
        hpu_branches=("apply_customized_rope",)),
)
