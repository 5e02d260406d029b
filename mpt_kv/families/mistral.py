"""Mistral: separate q/k/v, rotary, GQA, sliding window (longer than the tiny prompts)."""

from mpt_kv.families.base import Family

FAMILY = Family(name="mistral", model_type="mistral", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
