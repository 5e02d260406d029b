"""Starcoder2: separate q/k/v, rotary, GQA."""

from mpt_kv.families.base import Family

FAMILY = Family(name="starcoder2", model_type="starcoder2", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
