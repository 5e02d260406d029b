"""Falcon: fused `query_key_value`; ALiBi or rotary; multi-query (one K/V head) or the new
decoder architecture (num_kv_heads K/V heads)."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS


def kv_heads(c) -> int:
    if c.new_decoder_architecture:
        return c.num_kv_heads
    return 1 if c.multi_query else c.num_attention_heads


def stored_kv_heads(c) -> int | None:
    """The new decoder architecture broadcasts K/V to every query head before caching them
    (transformers 5.24 models/falcon/modeling_falcon.py:256-261 and :313), so its cache holds
    num_attention_heads / num_kv_heads times the GQA size."""
    return c.num_attention_heads if c.new_decoder_architecture else kv_heads(c)


def reuse_kv(model) -> list[tuple]:
    """With reuse_cache the port returns only the shapes; its cache is each attention's KVCache."""
    return [(b.self_attention.k_cache.cache, b.self_attention.v_cache.cache) for b in model.transformer.h]


FAMILY = Family(
    name="falcon", model_type="falcon", fused="query_key_value", kv_heads=kv_heads,
    stored_kv_heads=stored_kv_heads,
    variants={
        "alibi": {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        "rotary-mqa": {"alibi": False, "multi_query": True},
        "new-arch-gqa": {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 2},
    },
    # optimum-habana 1.21.2 models/falcon/modeling_falcon.py: imports habana_frameworks.torch.core
    # at module level (line 28); legacy per-layer (key, value) (concat: tuples, static: [key, value]
    # lists written with index_copy_ through KVCache.update, modeling_all_models.py:67);
    # reuse_cache: allocate_kv_cache (line 253) and the attention's own KVCache buffers.
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.falcon.modeling_falcon", causal_lm="GaudiFalconForCausalLM",
        hf_module="transformers.models.falcon.modeling_falcon", standin=True,
        forward_kwargs={"use_flash_attention": False, "flash_attention_recompute": False,
                        "flash_attention_causal_mask": False},
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=reuse_kv),
)
