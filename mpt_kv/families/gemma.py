"""Gemma: separate q/k/v, rotary, GQA (gemma-7b: MHA; gemma-2b: MQA), head_dim set apart from
hidden_size / heads."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

FAMILY = Family(name="gemma", model_type="gemma", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}},
    # optimum-habana 1.21.2 models/gemma/modeling_gemma.py: imports habana_frameworks.torch.core at
    # module level (line 54); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 214) and each attention's k_cache/v_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gemma.modeling_gemma", causal_lm="GaudiGemmaForCausalLM",
        hf_module="transformers.models.gemma.modeling_gemma", standin=True,
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
