"""StableLM: separate q/k/v, partial rotary, GQA."""

from mpt_kv.families.base import Family

FAMILY = Family(name="stablelm", model_type="stablelm", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}})
