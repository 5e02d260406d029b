"""DeciLM (DeciLM-7B): llama's layout with a different number of K/V heads in each layer
(`num_key_value_heads_per_layer`, variable GQA): q, k and v separate, rotary. The tiny model has
three layers, an MHA, a GQA and an MQA layer (4, 2 and 1 K/V heads for 4 query heads), so the
analytic bytes are per layer (`Family.layer_widths`) and a cache that gives every layer the first
layer's heads, or the widest, is bytes too many.

transformers ships DeciLM only as Hub remote code (Deci/DeciLM-7B, trust_remote_code):
optimum-habana 1.21.2 carries its own copy of those files (models/decilm/), which is the model here
and its uncached forward the oracle (`Family.remote_code`)."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS

PORT = "optimum.habana.transformers.models.decilm"
TINY = {"vocab_size": 128, "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 64}

FAMILY = Family(
    name="decilm", model_type="deci", design="per-layer-gqa", tiny=TINY,
    kv_heads=lambda c: list(c.num_key_value_heads_per_layer),
    remote_code="Deci/DeciLM-7B's modeling_decilm.py", remote_config=f"{PORT}.configuration_decilm:DeciLMConfig",
    variants={"kv-heads-4-2-1": {"num_key_value_heads_per_layer": [4, 2, 1]}},
    # optimum-habana 1.21.2 models/decilm/modeling_decilm.py: imports the llama port (its rotary
    # embedding, line 31), which imports habana_frameworks at module level; legacy per-layer
    # (key, value): concat torch.cat, static token_idx index_add_ into the padded prefill's cache
    # (lines 120-133); no allocate_kv_cache (no reuse_cache); its forward takes no **kwargs
    # (line 494): generate's other keywords never reach it (prepare_inputs_for_generation, line 482)
    gaudi=GaudiPort(module=f"{PORT}.modeling_decilm", causal_lm="DeciLMForCausalLM",
                    hf_module="transformers.models.deci.modeling_deci", standin=True, unsupported=NO_BUCKETS),
)
