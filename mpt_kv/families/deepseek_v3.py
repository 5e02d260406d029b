"""DeepSeek-V3: multi-head latent attention as deepseek_v2 (the cache holds the compressed latent
and the rope key part, made by the fused `kv_a_proj_with_mqa`), with a low-rank query
(q_lora_rank) and sigmoid-routed experts (2 of 4, one group)."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS
from mpt_kv.families.deepseek_v2 import MLA, expanded_before_5, latent_width

# Fields the Hub checkpoint's config.json carries (deepseek-ai/DeepSeek-V3) that transformers' DeepseekV3Config
# does not declare (kept as attributes, ignored by its model) and optimum-habana's port, a copy of the Hub's
# remote code, reads (models/deepseek_v3/modeling_deepseek_v3.py MoEGate and :1229 moe_layer_freq): the
# checkpoint's values, the sigmoid scores and noaux_tc top-k transformers' model computes
HUB_FIELDS = {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "seq_aux": True}

FAMILY = Family(name="deepseek_v3", model_type="deepseek_v3", design="latent+moe", fused="kv_a_proj_with_mqa",
                latent_width=latent_width, stored_width=expanded_before_5, variants={"mla": {**MLA, **HUB_FIELDS, "q_lora_rank": 16, "n_group": 1,
                                                                       "topk_group": 1}},
    # optimum-habana 1.21.2 models/deepseek_v3/modeling_deepseek_v3.py: its own copy of the Hub's remote code (its
    # own config and model classes, DeepseekV3ForCausalLM keeps transformers' name), imports
    # habana_frameworks.torch.core at module level (line 33), allocate_kv_cache (line 868). Its
    # MoE layers call an HPU kernel in eval: off an HPU it runs through the kernel stand-in (below)
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.deepseek_v3.modeling_deepseek_v3", causal_lm="DeepseekV3ForCausalLM",
        hf_module="transformers.models.deepseek_v3.modeling_deepseek_v3", standin=True,
        # what its prepare_inputs_for_generation passes besides the cache and positions (trim_logits alone;
        # its forward takes no lazy_mode nor flash-attention flags)
        forward_kwargs={"trim_logits": False},
        unsupported=NO_BUCKETS,
        reuse_cache="DeepseekV3ForCausalLM.forward takes no reuse_cache and its prepare_inputs_for_generation passes "
                    "none (optimum-habana 1.21.2 models/deepseek_v3/modeling_deepseek_v3.py:1661-1676, :1755-1825): "
                    "generate(reuse_cache=True) would allocate the cache (allocate_kv_cache, :1649) that no forward "
                    "writes, so no reuse_cache path reaches the attention's",
        # its MoE layers call torch.ops.hpu.mixture_of_experts in eval, with no CPU fallback
        # (models/deepseek_v3/modeling_deepseek_v3.py:606, :589 with FP8): off an HPU, the kernel stand-in's
        kernels=("mixture_of_experts",)))
