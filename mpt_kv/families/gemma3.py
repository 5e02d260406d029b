"""Gemma 3 (text): hybrid cache (local sliding-window and global layers), q/k norms, GQA. The tiny
window (9) is longer than the checks' prompt (6) and the decode steps: the k-token cached call
(positions 9-11) crosses it."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches
from mpt_kv.families.windows import history_before_4_56, hybrid_windows

FAMILY = Family(name="gemma3", model_type="gemma3_text", design="hybrid+qk-norm", windows=hybrid_windows,
                stored_windows=history_before_4_56, variants={
    "hybrid-window9": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 9,
                       "layer_types": ["sliding_attention", "full_attention"]}},
    # optimum-habana 1.21.2 models/gemma3/modeling_gemma3.py: imports habana_frameworks.torch.core at
    # module level (line 68); legacy per-layer (key, value), token_idx writes with index_copy_
    # (KVCache.update); reuse_cache: allocate_kv_cache (line 168) and each attention's k_cache/v_cache
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gemma3.modeling_gemma3", causal_lm="GaudiGemma3ForCausalLM",
        hf_module="transformers.models.gemma3.modeling_gemma3", standin=True,
        forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        reuse_cache=None, reuse_kv=self_attn_kv_caches),
)
