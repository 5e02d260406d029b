"""Qwen2-MoE: qwen2's attention (q/k/v with bias, GQA) with a mixture-of-experts MLP (2 of 4
routed experts per token, plus a shared expert)."""

from mpt_kv.families.base import Family

FAMILY = Family(name="qwen2_moe", model_type="qwen2_moe", design="full+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                 "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}})
