"""Hypothesis strategies for `Case`s, and the profiles the suite runs under.

On HPU every new input shape compiles a graph (seconds), so the `hpu` strategy draws few,
bucketed shapes: the longest prompt is always `HPU_PROMPT_BUCKET` long and the number of new
tokens is fixed; only the padding pattern, clip_qkv and seeds vary.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mpt_kv.model.config import ModelConfig
from mpt_kv.checks.properties import Case

HPU_PROMPT_BUCKET = 8
HPU_NEW_TOKENS = 4

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.differing_executors])
settings.register_profile("dev", max_examples=8, derandomize=False, **_common)  # explicit: hypothesis derandomizes under CI by default
# CI: derandomized (the same examples every run, so a red run reproduces), fewer examples
settings.register_profile("ci", max_examples=6, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=100, derandomize=False, **_common)


def load_profile() -> str:
    """MPT_KV_HYPOTHESIS_PROFILE wins; CI=true (or 1, yes) selects `ci`; else `dev`."""
    in_ci = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
    name = os.environ.get("MPT_KV_HYPOTHESIS_PROFILE") or ("ci" if in_ci else "dev")
    settings.load_profile(name)
    return name


@st.composite
def cases(draw, device: str = "cpu", capabilities=None) -> Case:
    """`capabilities` (mpt_kv.targets.Capabilities): a feature the target declares unsupported
    (clip_qkv) is not drawn, so the cases that do not need it still run."""
    if device == "hpu":
        n_heads, head_dim, n_layers = draw(st.sampled_from([2, 3])), 8, 2
        batch = draw(st.sampled_from([1, 2]))
        lens = [HPU_PROMPT_BUCKET] + draw(st.lists(st.integers(1, HPU_PROMPT_BUCKET), min_size=batch - 1, max_size=batch - 1))
        new_tokens = HPU_NEW_TOKENS
    else:
        n_heads = draw(st.sampled_from([1, 2, 3, 4, 6]))   # 3 and 6: ALiBi slopes of non-powers of two
        head_dim = draw(st.sampled_from([4, 8, 16]))
        n_layers = draw(st.integers(1, 3))
        batch = draw(st.integers(1, 3))
        lens = draw(st.lists(st.integers(1, 8), min_size=batch, max_size=batch))
        new_tokens = draw(st.integers(1, 6))
    cfg = ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=n_layers, vocab_size=64,
                      max_seq_len=32, clip_qkv=draw(clip_qkv_values(capabilities)))
    return Case(cfg, tuple(lens), new_tokens, seed=draw(st.integers(0, 2**16)))


def clip_qkv_values(capabilities=None):
    if capabilities is not None and capabilities.reason("clip_qkv"):
        return st.just(None)
    return st.sampled_from([None, None, 0.5, 4.0])
