"""The static-shape property of the index_copy_ path (what HPU graphs, CUDA graphs and
torch.compile need), on the reference, and the variants it must catch. The step actually compiled
and replayed from a CUDA graph: tests/test_graph_capture.py."""

import dataclasses
import inspect
import re

import pytest
import torch

from mpt_kv.checks import static_shape as S
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.checks.properties import Case, Context
from mpt_kv.targets.reference import build as reference
from mpt_kv.catalogue import variants as V
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.targets import Capabilities

# 3 heads, clip_qkv, a left-padded row, 6 decode steps (bucket 4 crosses a boundary)
CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=4.0),
            (5, 3), 6, seed=3)



def runner_and_context(build, name, device, bucket=None):
    runner = build(CASE.cfg, random_state_dict(CASE.cfg, seed=CASE.seed), device, torch.float32)
    return runner, Context(name, device.type, torch.float32, CASE, "static", bucket)


def with_host_syncs(runner, host_syncs):
    """The runner, declaring `host_syncs` on top of what it declares."""
    runner.capabilities = dataclasses.replace(runner.capabilities, host_syncs=host_syncs)
    return runner


# the shape and pointer checks stand alone: the variants' own host syncs allowed, they still kill them
@pytest.mark.parametrize("name,allowed,message", [
    ("static_cache_reallocated", {}, "cached key of layer 0 moved at decode step 0"),
    ("static_sliced_to_written_length", {"catalogue/variants.py:WrittenPrefixStaticCache.update": "test"},
     r"operands .* became"),
    ("static_position_as_python_int", {"variants.py:HostPositionSession._forward": "test"},
     r"op #\d+ tensor: operands \(\d+,"),
])
def test_static_shape_catches(device, name, allowed, message):
    runner, c = runner_and_context(VARIANTS[name].build, name, device)
    with pytest.raises(PropertyFailure, match=message):
        S.check_static_shape(with_host_syncs(runner, allowed), c)


def line_of(func, text: str) -> str:
    """The oracle: 'mpt_kv/catalogue/variants.py:LINE' of the line of `func` that holds `text`."""
    lines, first = inspect.getsourcelines(func)
    return f"mpt_kv/catalogue/variants.py:{first + next(i for i, line in enumerate(lines) if text in line)}"


@pytest.mark.parametrize("name,func,text", [
    ("host_sync_in_static_decode", V.FiniteGuardStaticCache.update, "bool(torch.isfinite(k).all())"),
    ("static_position_as_python_int", V.HostPositionSession._forward, "int(token_idx.reshape(-1)[0])"),
])
@pytest.mark.parametrize("bucket", [None, 4])
def test_host_sync_in_decode_is_caught(device, name, func, text, bucket):
    where = line_of(func, text)
    with pytest.raises(PropertyFailure) as e:
        S.check_static_shape(*runner_and_context(VARIANTS[name].build, name, device, bucket))
    msg = str(e.value)
    assert re.search(rf"decode step 0 made a host sync: aten\.(_local_scalar_dense|item|is_nonzero) from "
                     rf"{re.escape(where)} in {func.__qualname__} \(`.*{re.escape(text)}", msg), msg
    assert f"target={name}" in msg, msg


@pytest.mark.parametrize("bucket", [None, 4])
def test_reference_makes_no_host_sync(device, bucket):
    # its input validation (.item()) is off for the decode steps, Session.decode's checks are outside the watch
    S.check_static_shape(*runner_and_context(reference, "reference", device, bucket))


@pytest.mark.parametrize("key,passes", [
    ("mpt_kv/catalogue/variants.py:FiniteGuardStaticCache.update", True),
    ("variants.py:FiniteGuardStaticCache.update", True),  # the end of the path, at a '/'
    ("iants.py:FiniteGuardStaticCache.update", False),    # not at a '/': another file
    ("mpt_kv/catalogue/variants.py:update", False),       # a bare name: every class's update would pass
    ("mpt_kv/catalogue/variants.py:WrittenPrefixStaticCache.update", False),  # another class's method
    ("mpt_kv/catalogue/designs.py:FiniteGuardStaticCache.update", False),     # the same name in another file
])
def test_host_sync_allowance_names_one_function(device, key, passes):
    name = "host_sync_in_static_decode"
    runner, c = runner_and_context(VARIANTS[name].build, name, device)
    check = lambda: S.check_static_shape(with_host_syncs(runner, {key: "a NaN guard we keep"}), c)  # noqa: E731
    if passes:
        check()
    else:
        with pytest.raises(PropertyFailure, match=r"host sync: .* from mpt_kv/catalogue/variants.py:\d+ in FiniteGuardStaticCache.update"):
            check()


@pytest.mark.parametrize("host_syncs,error,message", [
    (["variants.py:_decode"], TypeError, r"host_syncs=\['variants.py:_decode'\] \(list\): give a mapping"),
    ("variants.py:_decode", TypeError, r"\(str\): give a mapping"),
    ({"variants.py": "why"}, ValueError, r"key 'variants.py': expected 'path.py:function'"),
    ({"variants.py:": "why"}, ValueError, r"key 'variants.py:': expected"),
    ({"variants:_decode": "why"}, ValueError, r"key 'variants:_decode': expected"),
    ({"/abs/variants.py:_decode": "why"}, ValueError, r"key '/abs/variants.py:_decode': expected"),
    ({3: "why"}, ValueError, r"key 3: expected"),
    ({"variants.py:_decode": ""}, ValueError, r"host_syncs\['variants.py:_decode'\]: give the reason"),
    ({"variants.py:_decode": True}, ValueError, r"give the reason as a non-empty string"),
    ({"variants.py:Cache..update": "why"}, ValueError, r"key 'variants.py:Cache..update': expected"),
])
def test_bad_host_sync_allowances_are_refused(host_syncs, error, message):
    with pytest.raises(error, match=message):
        Capabilities(host_syncs=host_syncs)


def test_a_decode_that_bypasses_the_watch_is_an_error(device):
    # fail closed: a Session overriding decode() itself would make every step look sync-free
    runner, c = runner_and_context(reference, "reference", device)
    make = runner.session

    def session(*args):
        s = make(*args)
        def decode(tokens):  # right, but around _decode
            logits = type(s)._extend(s, tokens)[:, -1]
            s.written += 1
            return logits
        s.decode = decode
        return s
    runner.session = session
    with pytest.raises(RuntimeError, match=r"ReferenceSession.decode did not call _decode, so no host sync"):
        S.check_static_shape(runner, c)


X = torch.tensor([1.0, 2.0])
HOST_READS = {"t.item()": lambda: X[0].item(), "int(t)": lambda: int(X[0]), "float(t)": lambda: float(X[0]),
              "if t.all():": lambda: 1 if X.all() else 0, "t.tolist()": lambda: X.tolist(), "t.numpy()": lambda: X.numpy()}


@pytest.mark.parametrize("code,sync", [(k, True) for k in HOST_READS] + [
    ("t + 1", False), ("t.shape[0]", False), ("torch.tensor([3])", False)])
def test_host_syncs_seen_on_cpu(code, sync):
    run = HOST_READS.get(code) or (lambda: eval(code, {"torch": torch, "t": X}))
    with torch.inference_mode(), S.HostSyncs() as seen:
        run()
    assert bool(seen.syncs) is sync, f"{code}: {seen.syncs}"
    if sync:  # named at this file's line, not inside torch
        assert all(site.path.endswith("test_static_shape.py") for _, site in seen.syncs), seen.syncs


@pytest.mark.parametrize("src,dst,is_sync", [("meta", "cpu", True), ("cpu", "cpu", False), ("cpu", "meta", False)])
def test_device_to_host_copy_is_a_host_sync(src, dst, is_sync):
    # meta stands in for a device here (this machine has none): the rule is by device type, not by op
    out = torch.empty(2, device=dst)
    assert S.device_to_host((torch.empty(2, device=src),), {"device": dst}, out) is is_sync
