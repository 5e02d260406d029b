"""gpt-oss: hybrid cache (sliding-window and full layers alternating), learned attention sinks (a
per-head logit in every softmax), GQA, a mixture-of-experts MLP (2 of 4). The tiny window (7) is
longer than the checks' prompt (6): the second decode step crosses it."""

from mpt_kv.families.base import Family
from mpt_kv.families.windows import history_before_5, hybrid_windows

FAMILY = Family(name="gpt_oss", model_type="gpt_oss", design="hybrid+sinks+moe", windows=hybrid_windows,
                stored_windows=history_before_5, variants={
    "hybrid-window7": {"intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
                       "num_experts_per_tok": 2, "sliding_window": 7,
                       "layer_types": ["sliding_attention", "full_attention"]}})
