"""Qwen3: separate q/k/v, per-head RMSNorm on q and k before rotary (q/k norms), GQA."""

from mpt_kv.families.base import Family

FAMILY = Family(name="qwen3", model_type="qwen3", design="full+qk-norm", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}})
