"""GPT-NeoX (pythia): fused `query_key_value`, partial rotary."""

from mpt_kv.families.base import Family, GaudiPort

FAMILY = Family(
    name="gpt_neox", model_type="gpt_neox", fused="query_key_value", variants={"mha": {"intermediate_size": 64}},
    # optimum-habana 1.21.2 models/gpt_neox/modeling_gpt_neox.py: legacy (key, value) tuples per
    # layer, token_idx writes with index_copy_ (lines 145-146), torch.cat otherwise (150-151)
    gaudi=GaudiPort(module="optimum.habana.transformers.models.gpt_neox.modeling_gpt_neox",
                    causal_lm="GaudiGPTNeoXForCausalLM", hf_module="transformers.models.gpt_neox.modeling_gpt_neox"),
)
