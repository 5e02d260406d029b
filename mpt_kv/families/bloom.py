"""BLOOM: fused `query_key_value`, ALiBi."""

from mpt_kv.families.base import Family, GaudiPort

FAMILY = Family(
    name="bloom", model_type="bloom", fused="query_key_value",
    tiny={"vocab_size": 128, "n_layer": 2, "hidden_size": 32, "n_head": 4},
    variants={"alibi": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.hidden_size // c.n_head, layers=lambda c: c.n_layer,
    # optimum-habana 1.21.2 models/bloom/modeling_bloom.py: legacy tuples per layer in BLOOM's own
    # layout, keys (B*H, hd, T) and values (B*H, T, hd) (lines 288-308), token_idx writes with
    # index_copy_ (line 116); its forward takes no position_ids (ALiBi), so none are passed
    gaudi=GaudiPort(module="optimum.habana.transformers.models.bloom.modeling_bloom",
                    causal_lm="GaudiBloomForCausalLM", hf_module="transformers.models.bloom.modeling_bloom"),
)
