"""Mistral: separate q/k/v, rotary, GQA, a sliding window on every layer (transformers 5.x: one
DynamicSlidingWindowLayer / StaticSlidingWindowLayer per layer, from `sliding_window` with no
`layer_types`). The tiny window (7) is crossed during decode: the prompt (6) fits, the first decode
fills it, the second slides it (mistral-7b-v0.1's 4096 is crossed by long prompts the same way)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches
from mpt_kv.families.windows import every_layer_window, history_before_4_56


FAMILY = Family(name="mistral", model_type="mistral", design="window", windows=every_layer_window,
                stored_windows=history_before_4_56, variants={
    "gqa": {"intermediate_size": 64, "num_key_value_heads": 2, "sliding_window": 7}},
    # optimum-habana 1.21.2 models/mistral/modeling_mistral.py: imports habana_frameworks.torch.core
    # at module level (line 25); legacy per-layer (key, value); reuse_cache: allocate_kv_cache
    # (line 184). Its forward reads generation_config.use_fused_rope (line 578).
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.mistral.modeling_mistral", causal_lm="GaudiMistralForCausalLM",
        hf_module="transformers.models.mistral.modeling_mistral", standin=True,
        generation={"use_fused_rope": None},
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
