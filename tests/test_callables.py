"""mpt_kv.CallableRunner: a target from callables, over the reference model driven through its own
signature (`model(ids, mask, cache, token_idx, cache_idx)`), as docs/targets.md describes it."""

import pytest
import torch

import mpt_kv
from mpt_kv import CHECKS, PropertyFailure
from mpt_kv.errors import AdapterError
from mpt_kv.model.reference import ReferenceMPT


def make(cfg, state_dict, device, dtype, *, bare_logits=False, seen=None, **drop):
    model = ReferenceMPT(cfg).load_hf_state_dict(state_dict).to(device=device, dtype=dtype).eval()

    def step(cache, ids, mask, position):
        if seen is not None:
            seen.append((tuple(ids.shape), mask, position))
        # the first call on a cache is its prefill (known on the host: reading `position` there would be a host
        # sync, which static-shape fails); the reference's own static prefill attends over the prompt alone
        if not getattr(cache, "adapter_prefilled", False):
            cache.adapter_prefilled = True
            logits = model(ids, mask[:, :ids.shape[1]], cache)
        else:
            logits = model(ids, mask, cache, position + 1)  # its token_idx: 1-based
        return logits if bare_logits else (logits, cache)

    ops = {"crop": lambda cache, n: cache.crop(n) or cache, "reorder": lambda cache, i: cache.reorder(i) or cache}
    return mpt_kv.CallableRunner(model, device, cfg=cfg, logits=lambda ids, mask: model(ids, mask),
                                 new_cache=model.new_cache, step=step, kv=lambda cache: list(cache.kv),
                                 **{k: v for k, v in ops.items() if k not in drop})


def build(cfg, state_dict, device, dtype):
    return make(cfg, state_dict, device, dtype)


PROBE = mpt_kv.ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)


def probe_runner(**kw):
    from mpt_kv.model.config import random_state_dict

    return make(PROBE, random_state_dict(PROBE), torch.device("cpu"), torch.float32, **kw)


@pytest.mark.parametrize("check", ["P0", "P1/concat", "P1/static", "P2/static", "P3/concat", "P3/static",
                                   "static-shape/static", "memory/static/B4-in32-new8", "ops-P2/static"])
def test_the_checks_pass_on_a_correct_callable_runner(check):
    CHECKS[check](build, "cpu", torch.float32)


@pytest.mark.parametrize("op", ["crop", "reorder"])
def test_an_absent_operation_is_declared_unsupported_with_its_reason(op):
    runner = probe_runner(**{op: None})
    assert runner.unsupported == {"bucket": "CallableRunner has no cache_idx buckets",
                                  op: f"CallableRunner: no {op}= callable given"}


@pytest.mark.parametrize("path, masks, positions", [
    ("concat", [(2, 3), (2, 4), (2, 6)], [0, 3, 4]),   # the mask so far, these tokens included
    ("static", [(2, 6), (2, 6), (2, 6)], [0, 3, 4]),   # the whole cache on every call, one tensor
])
def test_step_receives_the_documented_mask_and_position(path, masks, positions):
    seen = []
    session = probe_runner(seen=seen).session(path, 6)
    session.prefill(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    session.decode(torch.ones(2, 1, dtype=torch.long))
    session.extend(torch.ones(2, 2, dtype=torch.long))
    assert [tuple(m.shape) for _, m, _ in seen] == masks
    assert all(p.dtype == torch.int64 and tuple(p.shape) == (1,) for _, _, p in seen), [p for _, _, p in seen]
    assert [int(p) for _, _, p in seen] == positions
    if path == "static":
        assert len({m.data_ptr() for _, m, _ in seen}) == 1 and session.mask.tolist() == [[1] * 6] * 2
    assert session.written == 6 and len(session.kv()) == 1


def test_a_step_that_returns_bare_logits_is_a_type_error():
    session = probe_runner(bare_logits=True).session("concat", 4)
    with pytest.raises(TypeError, match=r"step\(\) returned Tensor; expected \(logits, cache\)"):
        session.prefill(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))


def test_a_callable_that_is_not_one_is_a_type_error():
    with pytest.raises(TypeError, match=r"CallableRunner kv='cache\.kv' \(str\): expected a callable"):
        mpt_kv.CallableRunner(torch.nn.Linear(1, 1), cfg=PROBE, logits=len, new_cache=len, step=len, kv="cache.kv")


# --- issue 38: an adapter fails at construction, with the argument named, never as a value finding --------------

@pytest.mark.parametrize("missing", ["logits", "new_cache", "step", "kv"])
def test_a_required_callable_that_is_none_is_refused_at_construction(missing):
    """Was accepted, and failed later inside a check."""
    callables = {"logits": len, "new_cache": len, "step": len, "kv": len, missing: None}
    with pytest.raises(AdapterError, match=rf"CallableRunner {missing}=None: expected a callable, {missing}\("):
        mpt_kv.CallableRunner(torch.nn.Linear(1, 1), cfg=PROBE, **callables)


def test_a_new_cache_that_returns_none_is_the_adapters_error_not_a_finding():
    """Was: P1 failed as "logits differ" (step() ran with no cache)."""
    from mpt_kv.model.config import random_state_dict

    def build_none(cfg, state_dict, device, dtype):
        runner = make(cfg, state_dict, device, dtype)
        runner.new_cache = lambda path, batch, max_len: None
        return runner

    with pytest.raises(AdapterError, match=r"the adapter's new_cache\('concat', 2, 8\) returned None: it must "
                                                  r"return the fresh cache that step\(\) fills"):
        build_none(PROBE, random_state_dict(PROBE), torch.device("cpu"), torch.float32).session("concat", 8).prefill(
            torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(AdapterError):  # through a check: raised as it is ("error"), never a PropertyFailure
        CHECKS["P1/concat"].run_case(build_none, "cpu", torch.float32, mpt_kv.Case(PROBE, (3, 2), 2))


def test_a_model_without_config_and_no_cfg_is_one_clear_line():
    """Was: the sentence inside a four-deep chain of "The above exception was the direct cause"."""
    from mpt_kv.model.config import random_state_dict
    from mpt_kv.targets import resolve_target

    def no_cfg(cfg, state_dict, device, dtype):
        model = ReferenceMPT(cfg).load_hf_state_dict(state_dict)
        return mpt_kv.GaudiStyleRunner(model, device)  # ReferenceMPT has .cfg, no .config

    with pytest.raises(AdapterError, match=r"ReferenceMPT: pass cfg= \(the factory's ModelConfig\) to the "
                                                  r"runner, or give the model a \.config .*no cfg= and the model has "
                                                  r"no \.config") as e:
        resolve_target(no_cfg).build(PROBE, random_state_dict(PROBE), "cpu", torch.float32)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no chain under it
