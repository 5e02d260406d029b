"""Mixtral: mistral's attention (GQA, rotary) with a sparse mixture-of-experts MLP (2 of 4 experts
per token)."""

from mpt_kv.families.base import Family

FAMILY = Family(name="mixtral", model_type="mixtral", design="full+moe", variants={
    "moe-2of4": {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 4,
                 "num_experts_per_tok": 2}})
