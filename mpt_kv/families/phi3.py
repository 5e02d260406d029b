"""Phi-3: fused `qkv_proj`, rotary, GQA."""

from mpt_kv.families.base import TINY, Family, GaudiPort

# pad_token_id: its default (32000) is outside the tiny vocabulary (the embedding refuses it)
FAMILY = Family(name="phi3", model_type="phi3", fused="qkv_proj", tiny={**TINY, "pad_token_id": 0}, variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2}},
    # optimum-habana 1.21.2 ships no phi3 port: no models/phi3/ and no phi3 line in
    # adapt_transformers_to_gaudi (modeling_utils.py). The entry names where a release would put
    # it, so the runner's TargetUnavailable says the installed release has none (and a release
    # that ships one is loaded, not skipped).
    gaudi=GaudiPort(module="optimum.habana.transformers.models.phi3.modeling_phi3", causal_lm="GaudiPhi3ForCausalLM",
                    hf_module="transformers.models.phi3.modeling_phi3"))
