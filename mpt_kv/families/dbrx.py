"""DBRX: fused `Wqkv`, rotary, GQA (attn_config.kv_n_heads), mixture-of-experts MLP."""

from mpt_kv.families.base import Family, GaudiPort

FAMILY = Family(
    name="dbrx", model_type="dbrx", fused="Wqkv",
    tiny={"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64},
    # rope_theta and clip_qkv given: the default config does not run in transformers 5.24
    # (DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does not set:
    # modeling_dbrx.py:184; its default clip_qkv=None calls clamp(min=None, max=None), which
    # raises: modeling_dbrx.py:205-206). 8.0 is DBRX's released clip_qkv.
    variants={"gqa": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                      "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1}}},
    kv_heads=lambda c: c.attn_config.kv_n_heads, head_dim=lambda c: c.d_model // c.n_heads,
    layers=lambda c: c.n_layers,
    # optimum-habana 1.21.2 ships no dbrx port: no models/dbrx/ and no dbrx line in
    # adapt_transformers_to_gaudi (modeling_utils.py). The entry names where a release would put
    # it, so the runner's TargetUnavailable says the installed release has none.
    gaudi=GaudiPort(module="optimum.habana.transformers.models.dbrx.modeling_dbrx", causal_lm="GaudiDbrxForCausalLM",
                    hf_module="transformers.models.dbrx.modeling_dbrx"),
)
