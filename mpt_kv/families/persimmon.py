"""Persimmon: fused `query_key_value`, q/k layernorm, partial rotary."""

from mpt_kv.families.base import Family

FAMILY = Family(name="persimmon", model_type="persimmon", fused="query_key_value",
                variants={"mha": {"intermediate_size": 64}})
