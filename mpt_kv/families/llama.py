"""Llama: separate q/k/v, rotary; MHA, GQA and MQA (num_key_value_heads)."""

from mpt_kv.families.base import Family

FAMILY = Family(name="llama", model_type="llama", variants={
    "mha": {"intermediate_size": 64}, "gqa": {"intermediate_size": 64, "num_key_value_heads": 2},
    "mqa": {"intermediate_size": 64, "num_key_value_heads": 1}})
