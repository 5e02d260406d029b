"""Qwen3-MoE: qwen3's attention (q/k norms, GQA) with a mixture-of-experts MLP (2 of 4 experts per
token): routing in a cached step sees only the new tokens; the cache is the attention's alone."""

from mpt_kv.families.base import Family

FAMILY = Family(name="qwen3_moe", model_type="qwen3_moe", design="full+qk-norm+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "moe_intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8,
                 "num_experts": 4, "num_experts_per_tok": 2}})
