"""GPT-2: fused `c_attn` (a Conv1D), learned positions."""

from mpt_kv.families.base import Family, GaudiPort

FAMILY = Family(
    name="gpt2", model_type="gpt2", fused="c_attn",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
    # optimum-habana 1.21.2 models/gpt2/modeling_gpt2.py: legacy (key, value) tuples per layer,
    # token_idx writes with index_copy_ (line 115), no cache_idx, no reuse_cache
    gaudi=GaudiPort(module="optimum.habana.transformers.models.gpt2.modeling_gpt2",
                    causal_lm="GaudiGPT2LMHeadModel", hf_module="transformers.models.gpt2.modeling_gpt2"),
)
