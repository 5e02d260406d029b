"""XGLM: separate q/k/v (with bias), sinusoidal positions, MHA."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="xglm", model_type="xglm",
    tiny={"vocab_size": 128, "num_layers": 2, "d_model": 32, "attention_heads": 4, "ffn_dim": 64,
          "max_position_embeddings": 64},
    variants={"mha": {}}, layers=lambda c: c.num_layers, kv_heads=lambda c: c.attention_heads,
    head_dim=lambda c: c.d_model // c.attention_heads)
