"""Phi (phi-1/2): separate q/k/v projections, partial rotary, GQA allowed (phi-1/2 are MHA)."""

from mpt_kv.families.base import Family, GaudiPort, self_attn_kv_caches


FAMILY = Family(name="phi", model_type="phi", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2},
    "mha": {"intermediate_size": 64}},  # phi-1, phi-1.5 and phi-2's layout
    # optimum-habana 1.21.2 models/phi/modeling_phi.py: legacy (key, value) tuples per layer,
    # KVCache.update (models/modeling_all_models.py:56-70: index_copy_ with token_idx), reuse_cache
    # with allocate_kv_cache (lines 121-126, 444-445); under GQA its eager attention transposes
    # the grouped 5-D key on the wrong dims (line 97): a known failure
    gaudi=GaudiPort(module="optimum.habana.transformers.models.phi.modeling_phi", causal_lm="GaudiPhiForCausalLM",
                    hf_module="transformers.models.phi.modeling_phi", reuse_cache=None, reuse_kv=self_attn_kv_caches,
                    unsupported={"bucket": "GaudiPhiAttention slices its cache to cache_idx (line 217) but, without "
                                           "reuse_cache, allocates it at the prompt's length (lines 206-210): mpt-kv drives "
                                           "cache_idx buckets only as MPT's (kv_cache_len preallocation)"}),
)
