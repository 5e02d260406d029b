"""The static-shape property on every target's index_copy_ path (mpt_kv/checks/static_shape.py):
across decode steps attention sees the same shapes and Python scalars, the cache storages never
move, and no step makes a host sync. This is what HPU graphs, CUDA graphs and torch.compile need.
And graph-capture (mpt_kv/checks/capture.py): the decode step compiled by torch.compile as one graph
that does not recompile from step to step, equal to eager; on CUDA also replayed from a CUDA graph.
Both are the index's fixed-case checks (runs "fixed"), one dtype."""

import pytest
import torch

from mpt_kv.checks import index
from mpt_kv.checks.registry import parametrize_with_checks


@parametrize_with_checks(checks=index.of_runs("fixed"))
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32")])  # shapes and pointers: one dtype is enough
def test_static_path_keeps_shapes_and_storage(check, target, device, dtype):
    check(target, device, dtype)
