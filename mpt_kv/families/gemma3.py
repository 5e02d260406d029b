"""Gemma 3 (text): hybrid cache (local sliding-window and global layers), q/k norms, GQA. The tiny
window (9) is longer than the checks' prompt (6) and the decode steps: the k-token cached call
(positions 9-11) crosses it."""

from mpt_kv.families.base import Family
from mpt_kv.families.windows import history_before_5, hybrid_windows

FAMILY = Family(name="gemma3", model_type="gemma3_text", design="hybrid+qk-norm", windows=hybrid_windows,
                stored_windows=history_before_5, variants={
    "hybrid-window9": {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 9,
                       "layer_types": ["sliding_attention", "full_attention"]}})
