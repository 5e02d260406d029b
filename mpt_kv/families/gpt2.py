"""GPT-2: fused `c_attn` (a Conv1D), learned positions."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="gpt2", model_type="gpt2", fused="c_attn",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
)
