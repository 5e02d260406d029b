"""The static-shape property of the index_copy_ path (what HPU graphs, CUDA graphs and
torch.compile need), on the reference, and the variants it must catch."""

import os

import pytest
import torch

from mpt_kv.checks import static_shape as S
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.checks.properties import Case, Context
from mpt_kv.targets.reference import build as reference
from mpt_kv.catalogue.variants import VARIANTS

# 3 heads, clip_qkv, a left-padded row, 6 decode steps (bucket 4 crosses a boundary)
CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=4.0),
            (5, 3), 6, seed=3)
# "aot_eager": dynamo's guards decide recompilation whatever the backend; inductor's C++ build
# takes ~10-30 s here. MPT_KV_COMPILE_BACKEND=inductor runs the real compiler.
COMPILE_BACKEND = os.environ.get("MPT_KV_COMPILE_BACKEND", "aot_eager")



def runner_and_context(build, name, device, bucket=None):
    runner = build(CASE.cfg, random_state_dict(CASE.cfg, seed=CASE.seed), device, torch.float32)
    return runner, Context(name, device.type, torch.float32, CASE, "static", bucket)


@pytest.mark.parametrize("name,message", [
    ("static_cache_reallocated", "cached key of layer 0 moved at decode step 0"),
    ("static_sliced_to_written_length", r"operands .* became"),
    ("static_position_as_python_int", r"op #\d+ tensor: operands \(\d+,"),
])
def test_static_shape_catches(device, name, message):
    with pytest.raises(PropertyFailure, match=message):
        S.check_static_shape(*runner_and_context(VARIANTS[name].build, name, device))


def test_compiled_decode_step_does_not_recompile(device):
    reason = S.compile_unavailable(device.type)
    if reason:
        pytest.skip(reason)
    graphs = S.check_no_recompile(*runner_and_context(reference, "reference", device), backend=COMPILE_BACKEND)
    assert graphs == 1, f"{graphs} graphs for one decode step"


def test_recompilation_is_caught(device):
    reason = S.compile_unavailable(device.type)
    if reason:
        pytest.skip(reason)
    runner, c = runner_and_context(VARIANTS["static_position_as_python_int"].build, "static_position_as_python_int", device)
    with pytest.raises(PropertyFailure, match="recompiled at decode step 1"):
        S.check_no_recompile(runner, c, backend=COMPILE_BACKEND)


def test_graph_replay_matches_eager(device):
    reason = S.graphs_unavailable(device.type)
    if reason:
        pytest.skip(reason)
    S.check_graph_replay(*runner_and_context(reference, "reference", device))
