"""The static-shape property on every target's index_copy_ path (mpt_kv/checks/static_shape.py):
across decode steps attention sees the same shapes and Python scalars, and the cache storages
never move. This is what HPU graphs, CUDA graphs and torch.compile need."""

import pytest
import torch

from mpt_kv.checks import static_shape as S
from mpt_kv.checks.properties import Case, Context
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets import build

# 3 heads, clip_qkv, a left-padded row, 6 decode steps (bucket 4 crosses a boundary)
CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=4.0),
            (5, 3), 6, seed=3)


@pytest.mark.property("static-shape")
@pytest.mark.parametrize("path,bucket", [pytest.param("static", None, id="static"),
                                         pytest.param("static", 4, id="static-bucket4")])
def test_static_path_keeps_shapes_and_storage(target, device, path, bucket):
    runner = build(target, CASE.cfg, random_state_dict(CASE.cfg, seed=CASE.seed), device, torch.float32)
    runner.require(path, "bucket" if bucket else None)
    S.check_static_shape(runner, Context(target, device.type, torch.float32, CASE, path, bucket))
