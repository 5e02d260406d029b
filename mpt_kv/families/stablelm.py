"""StableLM: separate q/k/v, partial rotary, GQA."""

from mpt_kv.families.base import Family, GaudiPort
from mpt_kv.families.persimmon import dynamic_cache_kv

FAMILY = Family(
    name="stablelm", model_type="stablelm", variants={"gqa": {"intermediate_size": 64, "num_key_value_heads": 2}},
    # optimum-habana 1.21.2 models/stablelm/modeling_stablelm.py: as persimmon's (index_copy_ into
    # the DynamicCache's layers with token_idx, lines 103-104; get_usable_length on the concat
    # path, line 283: a known failure)
    gaudi=GaudiPort(module="optimum.habana.transformers.models.stablelm.modeling_stablelm",
                    causal_lm="GaudiStableLmForCausalLM", hf_module="transformers.models.stablelm.modeling_stablelm",
                    kv=dynamic_cache_kv),
)
