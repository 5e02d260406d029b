"""Persimmon: fused `query_key_value`, q/k layernorm, partial rotary."""

from mpt_kv.families.base import Family, GaudiPort


def dynamic_cache_kv(past) -> list[tuple]:
    """The port returns what its model forward made (persimmon, stablelm: a DynamicCache fed
    legacy tuples in, converted back with to_legacy_cache; with token_idx the DynamicCache
    itself): each layer's (keys, values) as stored."""
    if hasattr(past, "layers"):
        return [(layer.keys, layer.values) for layer in past.layers]
    return [tuple(layer) for layer in past]


FAMILY = Family(
    name="persimmon", model_type="persimmon", fused="query_key_value", variants={"mha": {"intermediate_size": 64}},
    # optimum-habana 1.21.2 models/persimmon/modeling_persimmon.py: a DynamicCache whose layers
    # the token_idx path writes with index_copy_ (lines 105-106); the concat path (no token_idx)
    # calls DynamicCache.get_usable_length, which transformers 4.55 does not have (line 256): a
    # known failure (mpt_kv/findings/family_known_failures.json)
    gaudi=GaudiPort(module="optimum.habana.transformers.models.persimmon.modeling_persimmon",
                    causal_lm="GaudiPersimmonForCausalLM", hf_module="transformers.models.persimmon.modeling_persimmon",
                    kv=dynamic_cache_kv),
)
