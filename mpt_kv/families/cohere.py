"""Cohere (Command-R): separate q/k/v, q/k LayerNorms (use_qk_norm), parallel attention and MLP,
GQA, logit scale."""

from mpt_kv.families.base import TINY, Family

# pad/bos/eos: their defaults (0, 5, 255001) include one outside the tiny vocabulary
FAMILY = Family(name="cohere", model_type="cohere", design="full+qk-norm",
                tiny={**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, variants={
    "gqa-qk-norm": {"intermediate_size": 64, "num_key_value_heads": 2, "use_qk_norm": True}})
