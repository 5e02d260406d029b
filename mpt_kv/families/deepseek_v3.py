"""DeepSeek-V3: multi-head latent attention as deepseek_v2 (the cache holds the compressed latent
and the rope key part, made by the fused `kv_a_proj_with_mqa`), with a low-rank query
(q_lora_rank) and sigmoid-routed experts (2 of 4, one group)."""

from mpt_kv.families.base import Family
from mpt_kv.families.deepseek_v2 import MLA, expanded_before_5, latent_width

FAMILY = Family(name="deepseek_v3", model_type="deepseek_v3", design="latent+moe", fused="kv_a_proj_with_mqa",
                latent_width=latent_width, stored_width=expanded_before_5, variants={"mla": {**MLA, "q_lora_rank": 16, "n_group": 1, "topk_group": 1}})
