"""Starcoder2: separate q/k/v, rotary, GQA."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches


FAMILY = Family(name="starcoder2", model_type="starcoder2", variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}},
    # optimum-habana 1.21.2 models/starcoder2/modeling_starcoder2.py: imports
    # habana_frameworks.torch.core at module level (line 60); legacy per-layer (key, value);
    # reuse_cache: allocate_kv_cache (line 155).
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.starcoder2.modeling_starcoder2",
        causal_lm="GaudiStarcoder2ForCausalLM", hf_module="transformers.models.starcoder2.modeling_starcoder2",
        standin=True,
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
