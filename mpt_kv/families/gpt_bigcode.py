"""GPT-BigCode (starcoder 1): fused `c_attn`; multi-query by default (one K/V head)."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="gpt_bigcode", model_type="gpt_bigcode", fused="c_attn",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64},
    variants={"mqa": {"multi_query": True}, "mha": {"multi_query": False}},
    kv_heads=lambda c: 1 if c.multi_query else c.n_head, head_dim=lambda c: c.n_embd // c.n_head,
    layers=lambda c: c.n_layer,
)
