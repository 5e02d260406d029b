"""CodeGen: fused `qkv_proj` split in 4 model-parallel groups, partial rotary."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="codegen", model_type="codegen", fused="qkv_proj",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "rotary_dim": 4},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
)
