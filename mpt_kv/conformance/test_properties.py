"""P0-P3 on every target, device, dtype and cache path, each against its oracle.

The oracle of P0 is the reference; of P1 the target's own uncached forward; of P2 its own
concat path; P3 is structural (storage identity). Inputs are drawn by hypothesis (strategies.py).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpt_kv.checks import properties as P
from mpt_kv.model.config import random_state_dict
from mpt_kv.checks.strategies import cases
from mpt_kv.targets import build

PATHS = [pytest.param("concat", None, id="concat"), pytest.param("static", None, id="static"),
         pytest.param("static", 4, id="static-bucket4")]


def runner_for(target, case, device, dtype, path=None, bucket=None):
    runner = build(target, case.cfg, random_state_dict(case.cfg, seed=case.seed), device, dtype)
    runner.require(path, "bucket" if bucket else None)
    return runner


def context(target, device, dtype, case, path=None, bucket=None):
    return P.Context(target, device.type, dtype, case, path, bucket)


@pytest.mark.property("P0")
@given(data=st.data())
def test_p0_uncached_logits_match_reference(target, device, dtype, data):
    case = data.draw(cases(device.type))
    runner = runner_for(target, case, device, dtype)
    reference = runner_for("reference", case, device, dtype)
    P.check_oracle(runner, reference, context(target, device, dtype, case))


@pytest.mark.property("P1")
@pytest.mark.parametrize("path,bucket", PATHS)
@given(data=st.data())
def test_p1_cached_equals_uncached(target, device, dtype, path, bucket, data, record_property):
    case = data.draw(cases(device.type))
    runner = runner_for(target, case, device, dtype, path, bucket)
    for note in P.check_cached_equals_uncached(runner, context(target, device, dtype, case, path, bucket)):
        record_property("mpt_kv_note", note)


@pytest.mark.property("P2")
@pytest.mark.parametrize("path,bucket", [p for p in PATHS if p.values[0] == "static"])
@given(data=st.data())
def test_p2_static_equals_concat(target, device, dtype, path, bucket, data):
    case = data.draw(cases(device.type))
    runner = runner_for(target, case, device, dtype, path, bucket)
    P.check_static_equals_concat(runner, context(target, device, dtype, case, path, bucket))


@pytest.mark.property("P3")
@pytest.mark.parametrize("path,bucket", PATHS)
@given(data=st.data())
def test_p3_no_cache_tensor_aliases_mixed_qkv(target, device, dtype, path, bucket, data):
    case = data.draw(cases(device.type))
    runner = runner_for(target, case, device, dtype, path, bucket)
    P.check_no_aliasing(runner, context(target, device, dtype, case, path, bucket))
