"""OPT: separate q/k/v (with bias), learned positions (offset 2), MHA."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS

FAMILY = Family(
    name="opt", model_type="opt",
    tiny={"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_dim": 64,
          "word_embed_proj_dim": 32, "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 2,
          "eos_token_id": 2},
    variants={"mha": {}},
    # OPTLearnedPositionalEmbedding counts positions from the 2D mask (cumsum, transformers 5.24
    # models/opt/modeling_opt.py): generate passes the written part of it, never one padded to a
    # StaticCache's length
    pad_static_mask=False,
    # optimum-habana 1.21.2 models/opt/modeling_opt.py: no habana_frameworks import at module level;
    # legacy per-layer (key, value), token_idx writes with index_copy_; no allocate_kv_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.opt.modeling_opt", causal_lm="GaudiOPTForCausalLM",
        hf_module="transformers.models.opt.modeling_opt", forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS),
)
