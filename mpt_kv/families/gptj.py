"""GPT-J: separate q/k/v, partial rotary (rotary_dim), parallel attention and MLP."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS


def reuse_kv(model) -> list[tuple]:
    """With reuse_cache the port returns only the shapes; its cache is each attention's KVCache."""
    return [(b.attn.k_cache.cache, b.attn.v_cache.cache) for b in model.transformer.h]


FAMILY = Family(
    name="gptj", model_type="gptj",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "rotary_dim": 4},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
    # optimum-habana 1.21.2 models/gptj/modeling_gptj.py: imports habana_frameworks.torch.core at
    # module level (line 3); legacy per-layer (key, value) tuples; token_idx writes with
    # index_copy_ into the past it returned (line 225); reuse_cache: allocate_kv_cache (line 90) and
    # its own KVCache (line 29).
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gptj.modeling_gptj", causal_lm="GaudiGPTJForCausalLM",
        hf_module="transformers.models.gptj.modeling_gptj", standin=True,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=reuse_kv),
)
