"""Phi (phi-1/2): separate q/k/v projections, partial rotary, GQA allowed."""

from mpt_kv.families.base import Family

FAMILY = Family(name="phi", model_type="phi", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
