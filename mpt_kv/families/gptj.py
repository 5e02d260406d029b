"""GPT-J: separate q/k/v, partial rotary (rotary_dim), parallel attention and MLP."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="gptj", model_type="gptj",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "rotary_dim": 4},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
)
