"""DeepSeek-V3: multi-head latent attention as deepseek_v2 (the cache holds the compressed latent
and the rope key part, made by the fused `kv_a_proj_with_mqa`), with a low-rank query
(q_lora_rank) and sigmoid-routed experts (2 of 4, one group)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches
from mpt_kv.families.deepseek_v2 import MLA, expanded_before_5, latent_width

FAMILY = Family(name="deepseek_v3", model_type="deepseek_v3", design="latent+moe", fused="kv_a_proj_with_mqa",
                latent_width=latent_width, stored_width=expanded_before_5, variants={"mla": {**MLA, "q_lora_rank": 16, "n_group": 1, "topk_group": 1}},
    # optimum-habana 1.21.2 models/deepseek_v3/modeling_deepseek_v3.py: its own copy of the Hub's remote code (its
    # own config and model classes, DeepseekV3ForCausalLM keeps transformers' name), imports
    # habana_frameworks.torch.core at module level (line 33), allocate_kv_cache (line 868). Its
    # MoE layers call an HPU kernel in eval: not run off an HPU (its loading with transformers'
    # weights is checked there, on Gaudi)
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.deepseek_v3.modeling_deepseek_v3", causal_lm="DeepseekV3ForCausalLM",
        hf_module="transformers.models.deepseek_v3.modeling_deepseek_v3", standin=True, forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS, reuse_cache=None, reuse_kv=self_attn_kv_caches,
        needs_hpu="its MoE layers call torch.ops.hpu.mixture_of_experts in eval, with no CPU fallback "
                  "(optimum-habana 1.21.2 models/deepseek_v3/modeling_deepseek_v3.py:589 and :606)"))
