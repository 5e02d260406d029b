"""MPT: fused `Wqkv`, ALiBi, no GQA in transformers' port."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="mpt", model_type="mpt", fused="Wqkv",
    tiny={"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64},
    variants={"alibi": {"attn_config": {"alibi": True}}},
    kv_heads=lambda c: c.n_heads, head_dim=lambda c: c.d_model // c.n_heads, layers=lambda c: c.n_layers,
)
