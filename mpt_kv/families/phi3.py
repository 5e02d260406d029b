"""Phi-3: fused `qkv_proj`, rotary, GQA."""

from mpt_kv.families.base import TINY, Family

# pad_token_id: its default (32000) is outside the tiny vocabulary (the embedding refuses it)
FAMILY = Family(name="phi3", model_type="phi3", fused="qkv_proj", tiny={**TINY, "pad_token_id": 0}, variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
