"""Qwen2: separate q/k/v (with bias), rotary, GQA."""

from mpt_kv.families.base import Family

FAMILY = Family(name="qwen2", model_type="qwen2", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
