"""Gemma: separate q/k/v, rotary, GQA (gemma-7b: MHA; gemma-2b: MQA), head_dim set apart from
hidden_size / heads."""

from mpt_kv.families.base import Family

FAMILY = Family(name="gemma", model_type="gemma", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}})
