"""XGLM: separate q/k/v (with bias), sinusoidal positions, MHA."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS

FAMILY = Family(
    name="xglm", model_type="xglm",
    tiny={"vocab_size": 128, "num_layers": 2, "d_model": 32, "attention_heads": 4, "ffn_dim": 64,
          "max_position_embeddings": 64},
    variants={"mha": {}}, layers=lambda c: c.num_layers, kv_heads=lambda c: c.attention_heads,
    head_dim=lambda c: c.d_model // c.attention_heads,
    # optimum-habana 1.21.2 models/xglm/modeling_xglm.py: no habana_frameworks import at module level;
    # legacy per-layer (key, value), token_idx writes with index_copy_; no allocate_kv_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.xglm.modeling_xglm", causal_lm="GaudiXGLMForCausalLM",
        hf_module="transformers.models.xglm.modeling_xglm", forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS),
)
