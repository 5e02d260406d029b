"""GPT-Neo: separate q/k/v, learned positions, global and local layers alternating (a local layer
attends to the last `window_size` positions: a window of 4 here, shorter than the prompt)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS


def windows(config) -> list:
    """`config.attention_layers` ("global" / "local" per layer): window_size on a local layer."""
    return [config.window_size if kind == "local" else None for kind in config.attention_layers]


FAMILY = Family(
    name="gpt_neo", model_type="gpt_neo", design="hybrid", windows=windows,
    tiny={"vocab_size": 128, "num_layers": 2, "hidden_size": 32, "num_heads": 4, "max_position_embeddings": 64,
          "bos_token_id": 1, "eos_token_id": 2},
    variants={"global-local4": {"attention_types": [[["global", "local"], 1]], "window_size": 4}},
    layers=lambda c: c.num_layers, kv_heads=lambda c: c.num_heads,
    # transformers' GPT-Neo masks the window (its causal `bias`, models/gpt_neo/modeling_gpt_neo.py:63-68)
    # but caches every position in every layer (a DynamicLayer, never a sliding one): its local
    # layers keep the whole history (a known excess: known_failures.json, family-memory)
    stored_windows=lambda c: [None] * c.num_layers,
    # optimum-habana 1.21.2 models/gpt_neo/modeling_gpt_neo.py: no habana_frameworks import at module level;
    # legacy per-layer (key, value), token_idx writes with index_copy_; no allocate_kv_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gpt_neo.modeling_gpt_neo", causal_lm="GaudiGPTNeoForCausalLM",
        hf_module="transformers.models.gpt_neo.modeling_gpt_neo", forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS),
)
