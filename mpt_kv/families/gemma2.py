"""Gemma 2: hybrid cache (local sliding-window and global layers alternating), attention logit
soft-capping, GQA. The tiny window (4) is shorter than the checks' prompt (6): every cached call
reads a window that has already slid."""

from mpt_kv.families.base import Family
from mpt_kv.families.windows import history_before_5, hybrid_windows

FAMILY = Family(name="gemma2", model_type="gemma2", design="hybrid+softcap", windows=hybrid_windows,
                stored_windows=history_before_5, variants={
    "hybrid-window4": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
                       "layer_types": ["sliding_attention", "full_attention"]}})
