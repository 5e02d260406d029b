"""Falcon: fused `query_key_value`; ALiBi or rotary; multi-query (one K/V head) or the new
decoder architecture (num_kv_heads K/V heads)."""

from mpt_kv.families.base import Family


def kv_heads(c) -> int:
    if c.new_decoder_architecture:
        return c.num_kv_heads
    return 1 if c.multi_query else c.num_attention_heads


def stored_kv_heads(c) -> int | None:
    """The new decoder architecture broadcasts K/V to every query head before caching them
    (transformers 5.24 models/falcon/modeling_falcon.py:256-261 and :313), so its cache holds
    num_attention_heads / num_kv_heads times the GQA size."""
    return c.num_attention_heads if c.new_decoder_architecture else kv_heads(c)


FAMILY = Family(
    name="falcon", model_type="falcon", fused="query_key_value", kv_heads=kv_heads,
    stored_kv_heads=stored_kv_heads,
    variants={
        "alibi": {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True},
        "rotary-mqa": {"alibi": False, "multi_query": True},
        "new-arch-gqa": {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 2},
    },
)
