"""GPT-NeoX (pythia): fused `query_key_value`, partial rotary."""

from mpt_kv.families.base import Family

FAMILY = Family(name="gpt_neox", model_type="gpt_neox", fused="query_key_value",
                variants={"mha": {"intermediate_size": 64}})
