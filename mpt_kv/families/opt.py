"""OPT: separate q/k/v (with bias), learned positions (offset 2), MHA."""

from mpt_kv.families.base import Family

FAMILY = Family(
    name="opt", model_type="opt",
    tiny={"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_dim": 64,
          "word_embed_proj_dim": 32, "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 2,
          "eos_token_id": 2},
    variants={"mha": {}},
    # OPTLearnedPositionalEmbedding counts positions from the 2D mask (cumsum, transformers 5.24
    # models/opt/modeling_opt.py): generate passes the written part of it, never one padded to a
    # StaticCache's length
    pad_static_mask=False)
