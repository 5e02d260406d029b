"""BLOOM: fused `query_key_value`, ALiBi."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="bloom", model_type="bloom", fused="query_key_value",
    tiny={"vocab_size": 128, "n_layer": 2, "hidden_size": 32, "n_head": 4},
    variants={"alibi": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.hidden_size // c.n_head, layers=lambda c: c.n_layer,
)
