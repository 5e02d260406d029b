"""Cases the property tests run: drawn by hypothesis, plus fixed edge cases every run.

Drawn (CPU): head dims 4-128 (MPT-7B's is 128) with head counts that are and are not powers of
two (3 and 6 exercise ALiBi's slopes for the others), d_model <= 384, 1-3 layers, 1-3 rows of
1-24 prompt tokens, left-padded, 1-12 new tokens (so most cases pass 16 positions), max_seq_len
either exactly the case's length (the last slot is used) or 64, mask dtype bool / int64 / int32.
The `thorough` profile draws further: prompts to 300 and generations to 40 (past 128 and 256
positions), d_model to 1024, up to 4 layers and 4 rows, max_seq_len to 2048, and one case in ten
a long one (`long_case_from`: a prompt of 257-2044 tokens, or a generation of 129-300).

Edge cases (`edge_cases`), fixed so every run reaches them, each cheap on CPU (tiny d_model, one
or two layers): max_seq_len 2048 reached by a long prompt with a short generation, a short prompt
with a generation past 128 and 256 positions, prompts around optimum-habana's 128 bucket, head dim
128 with 3 heads and head dim 32 with 4.

On HPU every new input shape compiles a graph (seconds), so the `hpu` strategy draws few,
bucketed shapes: head dim 128, 3 or 4 heads, one layer, the longest prompt always
`HPU_PROMPT_BUCKET` (128, optimum-habana's bucket) long and `HPU_NEW_TOKENS` new tokens (the
decode crosses position 128); only the padding pattern, the mask dtype, clip_qkv and seeds vary.
"""

from __future__ import annotations

import dataclasses
import os
import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mpt_kv.checks.properties import MASK_DTYPES, Case
from mpt_kv.model.config import ModelConfig

HPU_PROMPT_BUCKET = 128
HPU_NEW_TOKENS = 4
HPU_HEAD_COUNTS, HPU_HEAD_DIM, HPU_LAYERS = (3, 4), 128, 1
HPU_MAX_SEQ_LEN = 2 * HPU_PROMPT_BUCKET
HEAD_DIMS = (4, 8, 16, 32, 64, 128)
HEAD_COUNTS = (1, 2, 3, 4, 6, 8)
# bf16 cases are at least this wide: a layer norm over 4 features in bf16 put the logits 19% of
# their scale from fp32 (8 and more: at most 7%; docs/calibration.md)
BF16_MIN_D_MODEL = 8

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.differing_executors])
settings.register_profile("dev", max_examples=8, derandomize=False, **_common)  # explicit: hypothesis derandomizes under CI by default
# CI: derandomized (the same examples every run, so a red run reproduces), fewer examples
settings.register_profile("ci", max_examples=6, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=100, derandomize=False, **_common)
_profile = "dev"


def load_profile() -> str:
    """MPT_KV_HYPOTHESIS_PROFILE wins; CI=true (or 1, yes) selects `ci`; else `dev`."""
    global _profile
    in_ci = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
    _profile = os.environ.get("MPT_KV_HYPOTHESIS_PROFILE") or ("ci" if in_ci else "dev")
    settings.load_profile(_profile)
    return _profile


class HypothesisPicks:
    """`case_from`'s source of choices inside a hypothesis test (shrinkable)."""

    def __init__(self, draw):
        self.draw = draw

    def choice(self, options):
        return self.draw(st.sampled_from(list(options)))

    def integer(self, low, high):
        return self.draw(st.integers(low, high))


class RandomPicks:
    """`case_from`'s source of choices for scripts (the calibration): seeded, reproducible by index."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def choice(self, options):
        return self.rng.choice(list(options))

    def integer(self, low, high):
        return self.rng.randint(low, high)


def case_from(pick, device: str = "cpu", thorough: bool = False, min_d_model: int = 1) -> Case:
    """The case space, written once for hypothesis (`cases`) and for scripts (`RandomPicks`)."""
    mask_dtype = pick.choice(MASK_DTYPES)
    clip_qkv = pick.choice([None, None, 0.5, 4.0])
    if device == "hpu":
        n_heads, head_dim, n_layers = pick.choice(HPU_HEAD_COUNTS), HPU_HEAD_DIM, HPU_LAYERS
        batch = pick.choice([1, 2])
        lens = [HPU_PROMPT_BUCKET] + [pick.integer(1, HPU_PROMPT_BUCKET) for _ in range(batch - 1)]
        new_tokens, max_seq_len = HPU_NEW_TOKENS, HPU_MAX_SEQ_LEN
    else:
        widest, longest, most_new = (1024, 300, 40) if thorough else (384, 24, 12)
        n_heads, head_dim = pick.choice([(h, d) for h in HEAD_COUNTS for d in HEAD_DIMS
                                         if min_d_model <= h * d <= widest])
        n_layers = pick.integer(1, 4 if thorough else 3)
        batch = pick.integer(1, 4 if thorough else 3)
        lens = [pick.integer(1, longest) for _ in range(batch)]
        new_tokens = pick.integer(1, most_new)
        total = max(lens) + new_tokens
        max_seq_len = pick.choice([total, max(64, total), 2048 if thorough else 64])
    cfg = ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=n_layers, vocab_size=64,
                      max_seq_len=max_seq_len, clip_qkv=clip_qkv)
    return Case(cfg, tuple(lens), new_tokens, seed=pick.integer(0, 2**16), mask_dtype=mask_dtype)


def long_case_from(pick, min_d_model: int = 1) -> Case:
    """Long sequences on a tiny model (one layer, d_model <= 32): a prompt of 257-2044 tokens with a
    short generation, or a short prompt with a generation past 128 or 256 positions, up to
    max_seq_len 2048. For the calibration and the thorough runs; the edge cases fix a few."""
    n_heads, head_dim = pick.choice([(h, d) for h in (1, 2, 3, 4) for d in (4, 8) if min_d_model <= h * d <= 32])
    if pick.choice(["long-prompt", "long-generation"]) == "long-prompt":
        lens = [pick.integer(257, 2044)]  # one row: a 2048-long forward costs ~0.15 s of CPU per row
        new_tokens = pick.integer(1, min(8, 2048 - max(lens)))
    else:
        lens = [pick.integer(1, 64) for _ in range(pick.integer(1, 2))]
        new_tokens = pick.integer(129, 300)
    total = max(lens) + new_tokens
    cfg = ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=1, vocab_size=64,
                      max_seq_len=pick.choice([total, 2048]), clip_qkv=pick.choice([None, 4.0]))
    return Case(cfg, tuple(lens), new_tokens, seed=pick.integer(0, 2**16), mask_dtype=pick.choice(MASK_DTYPES))


@st.composite
def cases(draw, device: str = "cpu", *, thorough: bool | None = None, dtype: torch.dtype | None = None,
          capabilities=None) -> Case:
    """A `Case` for `device` ("hpu": few bucketed shapes); `thorough` (default: whether the
    `thorough` profile is loaded) draws longer and wider, and one case in ten is a long one;
    bf16 draws d_model >= BF16_MIN_D_MODEL. `capabilities` (mpt_kv.targets.Capabilities): a
    feature the target declares unsupported (clip_qkv) is not drawn, so the cases that do not
    need it still run."""
    thorough = _profile == "thorough" if thorough is None else thorough
    min_d_model = BF16_MIN_D_MODEL if dtype == torch.bfloat16 else 1
    if thorough and device != "hpu" and draw(st.integers(0, 9)) == 0:
        case = long_case_from(HypothesisPicks(draw), min_d_model)
    else:
        case = case_from(HypothesisPicks(draw), device, thorough, min_d_model)
    if capabilities is not None and capabilities.reason("clip_qkv") and case.cfg.clip_qkv is not None:
        case = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, clip_qkv=None))
    return case


def _cfg(n_heads, head_dim, n_layers, max_seq_len, clip_qkv=None):
    return ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=n_layers, vocab_size=64,
                       max_seq_len=max_seq_len, clip_qkv=clip_qkv)


# Fixed cases every run reaches; (name -> Case). Their later generations (Case.generations) add a
# longer and a shorter layout: e.g. "max-seq-len" reruns at 2048 with other padding, then at ~1022.
EDGE_CASES = {
    # long prompt, short generation, ending exactly at max_seq_len = 2048 (the last slot), bool mask;
    # one row: a 2048-long forward costs ~0.15 s of CPU per row here, and it runs a dozen times
    "max-seq-len-2048": Case(_cfg(2, 8, 1, 2048), (2044,), 4, seed=11, mask_dtype=torch.bool),
    # short prompt, long generation: decode steps cross positions 128 and 256 (bf16 integers past
    # 256 are not exact), int32 mask
    "long-generation": Case(_cfg(3, 8, 1, 2048), (2, 1), 270, seed=12, mask_dtype=torch.int32),
    # prompts around optimum-habana's 128 bucket: decode at positions 127, 128, 129; head dim 32,
    # 4 heads (a power of two), clip_qkv
    "bucket-128": Case(_cfg(4, 32, 2, 256, clip_qkv=4.0), (127, 100, 126), 3, seed=13),
    # MPT-7B's head dim 128 with 3 heads (not a power of two), past 16 positions
    "head-dim-128": Case(_cfg(3, 128, 1, 64), (20, 7), 12, seed=14, mask_dtype=torch.bool),
}

# On HPU the same names with few decode steps: on its concat path every step is a new shape (a
# graph compile), so the long generation becomes a prompt ending just before position 256
HPU_EDGE_CASES = {
    **EDGE_CASES,
    "long-generation": Case(_cfg(3, 8, 1, 2048), (254, 200), HPU_NEW_TOKENS, seed=12, mask_dtype=torch.int32),
    "head-dim-128": Case(_cfg(3, 128, 1, 2 * HPU_PROMPT_BUCKET), (HPU_PROMPT_BUCKET, 60), HPU_NEW_TOKENS, seed=14,
                         mask_dtype=torch.bool),
}
assert HPU_EDGE_CASES.keys() == EDGE_CASES.keys()


def edge_cases(device: str = "cpu") -> dict[str, Case]:
    return HPU_EDGE_CASES if device == "hpu" else EDGE_CASES
