"""GPT-BigCode (starcoder 1): fused `c_attn`; multi-query by default (one K/V head)."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS


def fused_kv(past) -> list[tuple]:
    """The port caches one fused key_value tensor per layer: (B, T, 2 head_dim) under
    multi-query, (B, H, T, 2 head_dim) otherwise."""
    return [(layer,) for layer in past]


FAMILY = Family(
    name="gpt_bigcode", model_type="gpt_bigcode", fused="c_attn",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64},
    variants={"mqa": {"multi_query": True}, "mha": {"multi_query": False}},
    kv_heads=lambda c: 1 if c.multi_query else c.n_head, head_dim=lambda c: c.n_embd // c.n_head,
    layers=lambda c: c.n_layer,
    # optimum-habana 1.21.2 models/gpt_bigcode/modeling_gpt_bigcode.py: imports
    # habana_frameworks.torch.core at module level (line 42); a list of fused key_value tensors
    # (present = cat((key, value), -1), line 365); token_idx writes with an out-of-place
    # index_add on dim 1 (lines 356-359); no allocate_kv_cache, and generate asserts reuse_cache
    # off for gpt_bigcode (generation/utils.py:1420-1443).
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gpt_bigcode.modeling_gpt_bigcode",
        causal_lm="GaudiGPTBigCodeForCausalLM", hf_module="transformers.models.gpt_bigcode.modeling_gpt_bigcode",
        standin=True, kv=fused_kv,
        forward_kwargs={"use_flash_attention": False, "flash_attention_recompute": False,
                        "flash_attention_fast_softmax": False, "flash_attention_causal_mask": False},
        unsupported=NO_BUCKETS,
        reuse_cache="GaudiGPTBigCodeForCausalLM has no allocate_kv_cache, and optimum-habana 1.21.2's generate "
                    "asserts reuse_cache off for gpt_bigcode (generation/utils.py:1420-1443)"),
)
