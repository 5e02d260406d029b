"""Gemma 2: hybrid cache (local sliding-window and global layers alternating), attention logit
soft-capping, GQA. The tiny window (4) is shorter than the checks' prompt (6): every cached call
reads a window that has already slid."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches
from mpt_kv.families.windows import history_before_4_56, hybrid_windows

FAMILY = Family(name="gemma2", model_type="gemma2", design="hybrid+softcap", windows=hybrid_windows,
                stored_windows=history_before_4_56, variants={
    "hybrid-window4": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
                       "layer_types": ["sliding_attention", "full_attention"]}},
    # optimum-habana 1.21.2 models/gemma2/modeling_gemma2.py: imports habana_frameworks.torch.core at
    # module level (line 65); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 168) and each attention's k_cache/v_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gemma2.modeling_gemma2", causal_lm="GaudiGemma2ForCausalLM",
        hf_module="transformers.models.gemma2.modeling_gemma2", standin=True,
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
