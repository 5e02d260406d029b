"""Cohere (Command-R): separate q/k/v, q/k LayerNorms (use_qk_norm), parallel attention and MLP,
GQA, logit scale."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, TINY

# pad/bos/eos: their defaults (0, 5, 255001) include one outside the tiny vocabulary
FAMILY = Family(name="cohere", model_type="cohere", design="full+qk-norm",
                tiny={**TINY, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, variants={
    "gqa-qk-norm": {"intermediate_size": 64, "num_key_value_heads": 2, "use_qk_norm": True}},
    # optimum-habana 1.21.2 models/cohere/modeling_cohere.py: no habana_frameworks import at module level;
    # legacy per-layer (key, value), token_idx writes with index_copy_; no allocate_kv_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.cohere.modeling_cohere", causal_lm="GaudiCohereForCausalLM",
        hf_module="transformers.models.cohere.modeling_cohere", forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS),
)
