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
    # module level (line 4); legacy per-layer (key, value); no allocate_kv_cache. Its RoPE's CPU branch
    # cannot run: apply_customized_rope (lines 93-97) indexes the port's rotary table again and hands
    # transformers' gpt_oss apply_rotary_pos_emb, which expects half-width cos/sin, the full width (a shape
    # error in every forward, on CPU only: q.device.type selects the branch). Off an HPU it takes its HPU
    # branch (apply_customized_rope_module, models/modeling_all_models.py:81-105) with the stand-in's FusedRoPE
    gaudi=GaudiPort(
        module="optimum.habana.transformers.models.gpt_oss.modeling_gpt_oss", causal_lm="GaudiGptOssForCausalLM",
        hf_module="transformers.models.gpt_oss.modeling_gpt_oss", standin=True, forward_kwargs=GENERATE_FORWARD_KWARGS,
        unsupported=NO_BUCKETS, kernels=("RotaryPosEmbeddingHelperV2",), hpu_branches=("apply_customized_rope",)))
