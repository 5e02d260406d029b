"""gpt-oss: hybrid cache (sliding-window and full layers alternating), learned attention sinks (a
per-head logit in every softmax), GQA, a mixture-of-experts MLP (2 of 4). The tiny window (7) is
longer than the checks' prompt (6): the second decode step crosses it."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS
from mpt_kv.families.windows import history_before_4_56, hybrid_windows

FAMILY = Family(name="gpt_oss", model_type="gpt_oss", design="hybrid+sinks+moe", windows=hybrid_windows,
                stored_windows=history_before_4_56, variants={
    "hybrid-window7": {"intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
                       "num_experts_per_tok": 2, "sliding_window": 7,
                       "layer_types": ["sliding_attention", "full_attention"]}},
    # optimum-habana 1.21.2 models/gpt_oss/modeling_gpt_oss.py: imports habana_frameworks.torch.core at
    # module level (line 4); legacy per-layer (key, value); no allocate_kv_cache. Not run off an HPU
    # (needs_hpu: its CPU RoPE branch cannot run)
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gpt_oss.modeling_gpt_oss", causal_lm="GaudiGptOssForCausalLM",
        hf_module="transformers.models.gpt_oss.modeling_gpt_oss", standin=True, forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS,
        needs_hpu="off an HPU its RoPE fallback indexes transformers' per-position cos/sin again "
                  "(apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids]), models/gpt_oss/"
                  "modeling_gpt_oss.py:97 via :248): every forward raises a shape error there; on Gaudi the "
                  "fused RoPE kernel (has_fused_rope) takes the other branch"))
