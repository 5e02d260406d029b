"""graph-capture (mpt_kv/checks/capture.py): the static decode step under torch.compile(fullgraph=True,
dynamic=False, backend="aot_eager") on CPU, and on cuda also replayed from a CUDA graph (here on the fake
GPU of tests/fakes/cuda); the variants it kills, the designs it passes, the built-in targets."""

from __future__ import annotations

import re

import pytest
import torch

from mpt_kv.catalogue.designs import DESIGNS
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import capture as K
from mpt_kv.findings import entries as known_failures
from mpt_kv.checks.cases import Context
from mpt_kv.checks.registry import CHECKS
from mpt_kv.checks.strategies import STATIC_SHAPE_CASE as CASE
from mpt_kv.errors import Crash, PropertyFailure, Unsupported
from mpt_kv.model.config import random_state_dict
from mpt_kv.targets import Capabilities, resolve_target
from mpt_kv.targets.reference import ReferenceRunner, ReferenceSession
from mpt_kv.versions import installed

CHECK = CHECKS["graph-capture/static"]
SITE = r"mpt_kv/catalogue/variants\.py:\d+ in"


def runner_and_context(build, name, device="cpu", dtype=torch.float32):
    runner = build(CASE.cfg, random_state_dict(CASE.cfg, seed=CASE.seed), torch.device(device), dtype)
    return runner, Context(name, device, dtype, CASE, "static")


def test_the_reference_compiles_as_one_graph_equal_to_eager():
    notes = CHECK("reference", "cpu", torch.float32)
    assert notes == [f"graph-capture: reference on cpu: {CASE.new_tokens} static decode steps in 1 graph (aot_eager), "
                     "equal to eager"]


# the variant, what fails it, at which step and line
KILLED = {
    "position_from_a_host_counter": rf"recompiled at decode step 1: a guard of step 0's graph failed: token_idx == 6 "
                                    rf"\(guarded at {SITE} forward\)",
    "static_position_as_python_int": r"recompiled at decode step 1: a guard of step 0's graph failed: token_idx == 6 "
                                     r"\(guarded at mpt_kv/model/reference\.py:\d+ in _positions\)",
    "branch_on_an_unpadded_batch": rf"cannot capture static decode step 0 as one graph: .* at {SITE} forward "
                                   r"\(`if attention_mask is not None and bool\(attention_mask\.all\(\)\)",
    "host_sync_in_static_decode": rf"cannot capture static decode step 0 as one graph: .* at {SITE} update "
                                  r"\(`if self\.prefilled\[layer\] and not bool\(torch\.isfinite\(k\)\.all\(\)\)",
    "static_sliced_to_written_length": rf"captured static decode step 0 with a device value read on the host inside "
                                       rf"the graph: Tensor\.item at {SITE} update \(`n = int\(token_idx",
}


@pytest.mark.parametrize("name", sorted(KILLED))
def test_what_a_graph_cannot_hold_is_killed_with_its_step_and_line(name):
    assert "graph-capture" in VARIANTS[name].killed_by
    with pytest.raises(PropertyFailure, match=KILLED[name]) as e:
        K.check_graph_capture(*runner_and_context(VARIANTS[name].build, name))
    assert f"target={name}, device=cpu, dtype=float32, path=static" in str(e.value)


@pytest.mark.parametrize("name", ["nan_guard_on_the_device", "cache_length_as_python_int", "paged_cache",
                                  "cache_pool_zeroed", "quantized_kv_int8"])
def test_what_a_graph_can_hold_passes(name):
    notes = K.check_graph_capture(*runner_and_context(DESIGNS[name].build, name))
    assert "in 1 graph (aot_eager), equal to eager" in notes[0]


def test_a_step_that_compiles_to_other_values_fails():
    """A target whose compiled path computes something else (a `torch.compiler.is_compiling()` branch,
    as transformers has for tracing) fails on its logits, not on its graph."""
    class CompiledOtherwise(ReferenceRunner):
        def __init__(self, *args):
            super().__init__(*args)
            forward = self.model.forward

            def shifted(*a, **kw):
                out = forward(*a, **kw)
                return out + 1.0 if torch.compiler.is_compiling() else out
            self.model.forward = shifted

    runner, c = runner_and_context(CompiledOtherwise, "compiled_otherwise")
    with pytest.raises(PropertyFailure, match=r"compiled \(aot_eager\) vs eager decode logits differ at 128 of 128 "
                                              r"elements .* float32 logits:compiled\).* step=0"):
        K.check_graph_capture(runner, c)


def test_an_eager_crash_is_the_crash_rule_not_a_capture_failure():
    name = "index_copy_at_token_idx"  # writes past the cache at the last step, eagerly
    with pytest.raises(Crash, match=r"graph-capture: the target's decode raised IndexError: index_copy_\(\).* "
                                    r"\(eager, before any capture\) .*step=5"):
        K.check_graph_capture(*runner_and_context(VARIANTS[name].build, name))


def test_a_decode_step_that_never_calls_runner_model_is_an_error():
    """Fail closed: what the check compiles is runner.model's forward; a session driving another module
    would pass with nothing compiled."""
    class ElsewhereRunner(ReferenceRunner):
        def __init__(self, *args):
            super().__init__(*args)
            self.hidden, self.model = self.model, torch.nn.Linear(1, 1)

        def session(self, path, max_len, bucket=None):
            return ReferenceSession(self.hidden, path, max_len, bucket)

    runner, c = runner_and_context(ElsewhereRunner, "elsewhere")
    with pytest.raises(RuntimeError, match=r"decode step 0 did not call runner\.model, so nothing of it was compiled"):
        K.check_graph_capture(runner, c)


def test_a_target_without_a_static_path_is_unsupported_with_its_reason():
    def build(cfg, state_dict, device, dtype):
        runner = resolve_target("reference").build(cfg, state_dict, device, dtype)
        runner.capabilities = Capabilities({"static": "our cache grows by torch.cat only"})
        return runner

    with pytest.raises(Unsupported, match="our cache grows by torch.cat only"):
        CHECK(build, "cpu", torch.float32)


def test_hpu_is_unsupported_with_what_it_needs():
    runner, _ = runner_and_context(resolve_target("reference").build, "reference")
    with pytest.raises(Unsupported, match=r"HPU graphs \(wrap_in_hpu_graph.*P1, P2 and P4's /graphs runs.*"
                                          r"backend='hpu_backend'"):
        K.check_graph_capture(runner, Context("reference", "hpu", torch.float32, CASE, "static"))


def test_the_check_is_the_static_path_without_buckets():
    runner, _ = runner_and_context(resolve_target("reference").build, "reference")
    for path, bucket in (("concat", None), ("static", 4)):
        with pytest.raises(ValueError, match="static path without buckets"):
            K.check_graph_capture(runner, Context("reference", "cpu", torch.float32, CASE, path, bucket))


def test_failed_guards_name_the_expression_and_where():
    text = ("Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: 'm.py'\n"
            "    triggered by the following guard failure(s):\n"
            "    - 0/0: token_idx == 6                       # if token_idx is None:  # pkg/m.py:159 in _positions\n"
            "    - User stack trace:\n"
            "    -   File \"/x/pkg/m.py\", line 126, in forward\n")
    assert K.failed_guards(text) == ["token_idx == 6 (guarded at pkg/m.py:159 in _positions)"]


# --- the built-in targets -----------------------------------------------------------------------------------


def builtin_targets():
    out = ["reference", "transformers"]
    return out + (["optimum-habana"] if installed("optimum-habana") else [])


@pytest.mark.parametrize("target", builtin_targets())
def test_the_builtin_targets(target):
    """reference and optimum-habana's static path compile as one graph; transformers' fails where its known
    failure says (5.12.1-5.24), through that entry's pattern; a transformers without an MPT static path
    (4.55) is unsupported with its reason."""
    entries = [e for e in known_failures.load() if e.target == target and e.property == "graph-capture" and e.applies()]
    caps = resolve_target(target).capabilities("cpu", torch.float32)
    if caps.reason("static"):
        with pytest.raises(Unsupported, match="no static-cache path"):
            CHECK(target, "cpu", torch.float32)
        return
    if not entries:
        assert CHECK(target, "cpu", torch.float32)[0].endswith("in 1 graph (aot_eager), equal to eager")
        return
    with pytest.raises(PropertyFailure) as e:
        CHECK(target, "cpu", torch.float32)
    assert any(re.search(entry.pattern, str(e.value)) for entry in entries), str(e.value)


# --- cuda: the same step replayed from a CUDA graph, on the fake GPU ----------------------------------------


def test_on_cuda_the_step_is_also_replayed_from_a_cuda_graph(fake_cuda):
    notes = CHECK("reference", "cuda", torch.float32)
    assert notes[1] == (f"graph-capture: reference on cuda: step 0 captured as one CUDA graph, steps 1-"
                        f"{CASE.new_tokens - 1} replayed, equal to eager")


def eager_then_graphed(name, fake_cuda):
    runner, c = runner_and_context(VARIANTS[name].build, name, "cuda")
    with torch.inference_mode(), K.validation_off(runner.model):
        tokens, want = K.eager_generation(runner, c)
        return K.graphed_generation(runner, c, tokens, want)


def test_a_cache_that_moves_replays_into_the_old_buffers(fake_cuda):
    """torch.compile does not mind a cache reallocated every step; a CUDA graph replays into the captured
    buffers, and the logits show it."""
    runner, c = runner_and_context(VARIANTS["static_cache_reallocated"].build, "static_cache_reallocated", "cuda")
    with pytest.raises(PropertyFailure, match=r"CUDA graph replay vs eager decode logits differ .* step=2\]"):
        K.check_graph_capture(runner, c)


def test_a_python_int_that_changes_per_step_is_named_at_replay(fake_cuda):
    with pytest.raises(PropertyFailure, match=r"CUDA graph replay of static decode step 1: the model's argument "
                                              r"'token_idx' changed since the captured step \(6 -> 7\)"):
        eager_then_graphed("static_position_as_python_int", fake_cuda)


def test_a_host_read_while_capturing_fails_the_capture(fake_cuda):
    with pytest.raises(PropertyFailure, match=r"CUDA graph capture of static decode step 0 failed: RuntimeError: "
                                              r"CUDA error: operation not permitted when stream is capturing"):
        eager_then_graphed("host_sync_in_static_decode", fake_cuda)
