"""Each family check kills what it is for, on a small broken wrapper of transformers' real runner,
and passes on the real one (wrapped unchanged): a logits forward that drops the padding mask
(family-P0), an extend that drops it (family-P1), a static kv() one position off (family-P2), a
kv() of views of a bigger buffer (family-P3, family-memory), a logits buffer reused (family-P4), a
reorder of the keys only (family-ops), a cache kept on the model after the session (family-memory).
"""

import dataclasses
import re

import pytest
import torch

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.errors import InputError, Unsupported
from mpt_kv.checks import family
from mpt_kv.checks.family import CHECKS
from mpt_kv.families.implementations import IMPLEMENTATIONS, limits_of, transformers_runner
from mpt_kv.families.models import build
from mpt_kv.targets import Capabilities, Runner
from plugin_testing import HANG_S

pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")
needs_5x = pytest.mark.skipif(not hasattr(getattr(cache_utils, "DynamicLayer", None), "lazy_initialization"),
                              reason="the broken wrappers edit transformers 5.x cache layers")

FAMILY, VARIANT = "llama", "gqa"


class WrappedSession:
    """The real session, its calls passed on; a subclass breaks one."""

    def __init__(self, inner, runner):
        self.inner, self.runner = inner, runner

    def __getattr__(self, name):  # written, max_len, mask, device, path, cache
        return getattr(self.inner, name)

    def prefill(self, ids, mask):
        return self.inner.prefill(ids, mask)

    def decode(self, tokens):
        return self.inner.decode(tokens)

    def extend(self, tokens):
        return self.inner.extend(tokens)

    def crop(self, n):
        return self.inner.crop(n)

    def reorder(self, index):
        return self.inner.reorder(index)

    def kv(self):
        return self.inner.kv()


class WrappedRunner(Runner):
    def __init__(self, inner, session_class, capabilities=None):
        self.inner, self.session_class = inner, session_class
        self.model, self.name = inner.model, "wrapped"
        self.max_seq_len, self.vocab_size = inner.max_seq_len, inner.vocab_size
        self.capabilities = capabilities or inner.capabilities

    def logits(self, ids, mask):
        return self.inner.logits(ids, mask)

    def session(self, path, max_len, bucket=None):
        self.require(path)
        return self.session_class(self.inner.session(path, max_len, bucket), self)


def wrapped(session_class=WrappedSession, runner_class=WrappedRunner, name="wrapped", capabilities=None):
    """An implementation (a builder of IMPLEMENTATIONS' shape) around transformers' real runner."""
    def build(family, variant, dtype=torch.float32, *, seed=0, **options):
        return runner_class(transformers_runner(family, variant, dtype, seed=seed, **options), session_class,
                            capabilities)
    build.implementation_name = name
    return build


# --- broken wrappers ---------------------------------------------------------------------------------

class MasklessRunner(WrappedRunner):
    def logits(self, ids, mask):
        return self.inner.logits(ids, torch.ones_like(mask))  # row 0 attends to its padding


class MasklessExtend(WrappedSession):
    def extend(self, tokens):  # the chunk sees the padding: every row's mask all ones for this call
        saved = self.inner.mask
        self.inner.mask = torch.ones_like(saved)
        try:
            return self.inner.extend(tokens)
        finally:
            self.inner.mask = torch.cat([saved, torch.ones_like(tokens)], 1)


class MasklessDecode(WrappedSession):
    def decode(self, tokens):  # the step sees the padding
        saved = self.inner.mask
        self.inner.mask = torch.ones_like(saved)
        try:
            return self.inner.decode(tokens)
        finally:
            self.inner.mask = torch.cat([saved, torch.ones_like(tokens)], 1)


class StaticKvOffByOne(WrappedSession):
    def kv(self):  # the static path reports its buffers one position late; its logits are right
        pairs = self.inner.kv()
        if self.inner.path != "static":
            return pairs
        return [tuple(t.roll(1, dims=-2) for t in pair) for pair in pairs]


class ViewsOfABiggerBuffer(WrappedSession):
    def kv(self):  # each cached tensor a view of a buffer twice its size
        out = []
        for pair in self.inner.kv():
            out.append(tuple(torch.cat([t, t], dim=-1)[..., :t.shape[-1]] for t in pair))
        self._held = out  # kept alive as a cache would keep them
        return out


class ReusedLogits(WrappedSession):
    buffers: dict = {}

    def _into(self, logits):
        buf = self.buffers.get(logits.shape)
        if buf is None:
            buf = self.buffers[logits.shape] = torch.empty_like(logits)
        return buf.copy_(logits)

    def decode(self, tokens):
        return self._into(self.inner.decode(tokens))


class KeysOnlyReorder(WrappedSession):
    def reorder(self, index):  # beam search's reorder applied to the keys, not the values
        self.inner.mask = self.inner.mask.index_select(0, index)
        for layer in self.inner.cache.layers:
            layer.keys = layer.keys.index_select(0, index)


class KeptOnTheModel(WrappedSession):
    def prefill(self, ids, mask):
        out = self.inner.prefill(ids, mask)
        self.runner.model.last_cache = self.inner.cache  # per-generation state kept on the model
        return out


# --- the real implementation passes ------------------------------------------------------------------------

@pytest.mark.parametrize("prop, path", [(p, path) for p in CHECKS for path in ("concat", "static")
                                        if not (p == "family-P2" and path == "concat")])
def test_the_real_runner_passes_every_check(prop, path):
    CHECKS[prop](wrapped(), FAMILY, VARIANT, path)


def test_p0_is_no_check_of_transformers_itself():
    """Of transformers with eager attention, the oracle's (the default); with sdpa it is a check, against eager."""
    with pytest.raises(InputError, match="transformers with eager attention is its oracle"):
        CHECKS["family-P0"]("transformers", FAMILY, VARIANT)
    with pytest.raises(InputError, match="transformers with eager attention is its oracle"):
        CHECKS["family-P0"]("transformers", FAMILY, VARIANT, attention="eager")
    assert CHECKS["family-P0"]("transformers", FAMILY, VARIANT, attention="sdpa") == []


# --- each check kills its broken wrapper ---------------------------------------------------------------------

def test_p0_kills_a_forward_that_drops_the_mask():
    with pytest.raises(PropertyFailure, match=r"family-P0 uncached logits vs transformers' uncached forward \(same "
                                              r"weights\) differ .*target=wrapped/llama, implementation=wrapped, "
                                              r"family=llama, variant=gqa, path=concat, device=cpu, dtype=float32, "
                                              r"batch=2, "
                                              r"step=uncached"):
        CHECKS["family-P0"](wrapped(runner_class=MasklessRunner), FAMILY, VARIANT)


@pytest.mark.parametrize("path", ["concat", "static"])
def test_p1_kills_an_extend_that_drops_the_padding_mask(path):
    """The prefill and the decode steps hold; the k-token call is where it breaks."""
    with pytest.raises(PropertyFailure, match=r"family-P1 extend 3 \(step 3\): cached logits vs transformers' "
                                              rf"uncached forward .*path={path}.*operation=extend"):
        CHECKS["family-P1"](wrapped(MasklessExtend), FAMILY, VARIANT, path)


def test_p2_kills_static_kv_one_position_off_while_its_logits_agree():
    with pytest.raises(PropertyFailure, match=r"family-P2 prefill: static-path cached key of layer 0 at the written "
                                              r"token positions vs the concat path's differ .*layer=0"):
        CHECKS["family-P2"](wrapped(StaticKvOffByOne), FAMILY, VARIANT, "static")


@pytest.mark.parametrize("path", ["concat", "static"])
def test_p3_kills_views_of_a_bigger_buffer(path):
    with pytest.raises(PropertyFailure, match=r"family-P3 cache pins storage after prefill: layer 0 key \(2, 2, \d+, "
                                              r"8\) is a view of a buffer that is no fused projection's output of "
                                              rf"this step: its storage holds (\d+) bytes, .*path={path}"):
        CHECKS["family-P3"](wrapped(ViewsOfABiggerBuffer), FAMILY, VARIANT, path)


def test_memory_names_the_excess_of_views_of_a_bigger_buffer():
    # llama gqa: 2 layers x 2 K/V heads x head dim 8 x 4 bytes x 2 (K and V) = 256 bytes per token per row
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: the cache's distinct storages hold 6144 "
                                              r"bytes, the family's analytic K/V for 2 x 6 tokens 3072: \+3072 bytes; "
                                              r"layer 0 key \(2, 2, 6, 8\) is a view of a buffer .* 768 bytes pinned"):
        CHECKS["family-memory"](wrapped(ViewsOfABiggerBuffer), FAMILY, VARIANT, "concat")


@pytest.mark.parametrize("path", ["concat", "static"])
def test_p4_kills_a_reused_logits_buffer(path):
    ReusedLogits.buffers.clear()
    with pytest.raises(PropertyFailure, match=r"family-P4: the logits \(2, 128\) returned by decode step 1 were "
                                              rf"overwritten by a later call .*path={path}"):
        CHECKS["family-P4"](wrapped(ReusedLogits), FAMILY, VARIANT, path)


def test_p4_is_satisfied_by_declared_graph_outputs():
    ReusedLogits.buffers.clear()
    caps = Capabilities(graph_outputs=True)
    CHECKS["family-P4"](wrapped(ReusedLogits, capabilities=caps), FAMILY, VARIANT, "concat")


@needs_5x
@pytest.mark.parametrize("path", ["concat", "static"])
def test_ops_kills_a_reorder_of_the_keys_only(path):
    with pytest.raises(PropertyFailure, match=r"family-ops beam step 2 \(decode\): logits vs transformers' uncached "
                                              rf"forward over each row's surviving history .*path={path}.*batch=3.*"
                                              r"program=beam, step=2, operation=decode"):
        CHECKS["family-ops"](wrapped(KeysOnlyReorder), FAMILY, VARIANT, path)


def test_ops_without_reorder_is_unsupported_after_the_assisted_program_ran(monkeypatch):
    ran = []
    real = family.run_program
    monkeypatch.setattr(family, "run_program", lambda runner, c, name, ops: ran.append(name) or real(runner, c, name, ops))
    caps = Capabilities({"reorder": "no beam search here"})
    with pytest.raises(Unsupported, match=r"wrapped/llama concat: beam program: no beam search here \(the other "
                                          r"program ran and held\)"):
        CHECKS["family-ops"](wrapped(capabilities=caps), FAMILY, VARIANT, "concat")
    assert ran == ["assisted"]


@needs_5x
def test_memory_kills_a_cache_kept_on_the_model():
    # the drive ends at 11 positions: prompt 6, 3 decodes, a 3-token call, a crop back 2, a decode
    with pytest.raises(PropertyFailure, match=r"family-memory after the session was deleted: 4 storages the cache "
                                              r"held \(5632 bytes: layer 0 key, layer 0 value, layer 1 key, layer 1 "
                                              r"value\) are still alive; the model or runner keeps "
                                              r"model\.last_cache\.layers\[0\]\.keys \(2, 2, 11, 8\)"):
        CHECKS["family-memory"](wrapped(KeptOnTheModel), FAMILY, VARIANT, "concat")


def test_p1_without_extend_is_unsupported_after_the_decode_steps_held():
    caps = Capabilities({"extend": "no k-token calls here"})
    with pytest.raises(Unsupported, match=r"wrapped/llama concat: the k-token cached call: no k-token calls here "
                                          r"\(the prefill and the decode steps held\)"):
        CHECKS["family-P1"](wrapped(capabilities=caps), FAMILY, VARIANT, "concat")
    with pytest.raises(PropertyFailure, match="family-P1 decode step 1"):  # the decode steps are still checked
        CHECKS["family-P1"](wrapped(MasklessDecode, capabilities=caps), FAMILY, VARIANT, "concat")


def test_a_call_that_raises_is_a_failure_naming_it():
    class Crashes(WrappedSession):
        def decode(self, tokens):
            raise TypeError("can only concatenate tuple (not Tensor) to tuple")

    with pytest.raises(PropertyFailure, match=r"family-P1 decode step 1: the implementation's decode raised TypeError: "
                                              r"can only "
                                              r"concatenate tuple \(not Tensor\) to tuple .*operation=decode"):
        CHECKS["family-P1"](wrapped(Crashes), FAMILY, VARIANT, "concat")


# --- implementations ---------------------------------------------------------------------------------------

def test_the_implementations_and_their_limits():
    assert list(IMPLEMENTATIONS) == ["transformers", "optimum-habana"]
    from mpt_kv.families import FAMILIES

    bloom = FAMILIES["bloom"].config("alibi")  # no positional limit: ALiBi
    assert limits_of(bloom).max_seq_len == 2048 and limits_of(bloom).vocab_size == 128
    assert limits_of(FAMILIES["gpt2"].config("mha")).max_seq_len == 64  # n_positions
    assert limits_of(FAMILIES["mpt"].config("alibi")).max_seq_len == 64  # max_seq_len
    with pytest.raises(InputError, match=r"unknown options \['reuse_cache'\]"):
        transformers_runner(FAMILIES["llama"], "gqa", reuse_cache=True)


def test_the_runner_holds_the_weights_of_build():
    from mpt_kv.families import FAMILIES

    runner = transformers_runner(FAMILIES["llama"], "gqa")
    model, _ = build(FAMILIES["llama"], "gqa")
    for (name, a), b in zip(runner.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert runner.model is not model  # its own copy: the oracle is never the implementation's module


def test_optimum_habana_not_installed_is_target_unavailable(monkeypatch):
    from mpt_kv.errors import TargetUnavailable
    from mpt_kv.families import FAMILIES, implementations

    monkeypatch.setattr(implementations, "installed", lambda dist: False)
    with pytest.raises(TargetUnavailable, match="optimum-habana is not installed"):
        implementations.gaudi_runner(FAMILIES["llama"], "gqa")


def test_optimum_habana_installed_but_its_loader_missing_is_an_error(monkeypatch):
    """Installed, the import of mpt_kv.families.gaudi failing is an ImportError (an error), never a skip."""
    import sys

    from mpt_kv.families import FAMILIES, implementations

    monkeypatch.setattr(implementations, "installed", lambda dist: True)
    monkeypatch.setitem(sys.modules, "mpt_kv.families.gaudi", None)  # as if the module were absent
    with pytest.raises(ImportError):
        implementations.gaudi_runner(FAMILIES["llama"], "gqa")


# --- issue 49: a cached tensor of zero width is compared and counted, never crashed on ---------------------------

@needs_5x
@pytest.mark.parametrize("prop", ["family-P2", "family-P3", "family-P4", "family-memory"])
def test_a_cached_tensor_of_zero_width_is_compared_not_crashed_on(prop):
    """Was (family-P2): RuntimeError: max(): Expected reduction dim to be specified for input.numel() == 0, on an MLA
    layout that keeps the latent and the rope key in one tensor and returns an empty value beside it
    (family_catalogue.latent_and_rope_in_one_tensor)."""
    from mpt_kv.catalogue.family_catalogue import FAMILY_DESIGNS, run

    notes = run(FAMILY_DESIGNS["latent_and_rope_in_one_tensor"], prop)
    assert not any("do not line up" in n for n in notes), notes  # P2 compared the K/V, the empty one included


def test_two_empty_tensors_of_one_shape_compare_equal_and_of_two_shapes_fail():
    from mpt_kv.checks.compare import assert_close, tolerance

    tol = tolerance(torch.float32, "kv:static")
    assert_close(torch.empty(2, 1, 5, 0), torch.empty(2, 1, 5, 0), tol, "kv", {})
    with pytest.raises(PropertyFailure, match=r"kv: shape \(2, 1, 4, 0\) != expected \(2, 1, 5, 0\)"):
        assert_close(torch.empty(2, 1, 4, 0), torch.empty(2, 1, 5, 0), tol, "kv", {})


# --- issue 49: family-P3 and family-memory after a k-token call and a crop --------------------------------------

class ViewsAfterExtend(WrappedSession):
    def extend(self, tokens):
        self.extended = True
        return self.inner.extend(tokens)

    def kv(self):  # from the k-token call on, each cached tensor a view of a buffer twice its size
        pairs = self.inner.kv()
        if not getattr(self, "extended", False):
            return pairs
        self._held = [tuple(torch.cat([t, t], dim=-1)[..., :t.shape[-1]] for t in pair) for pair in pairs]
        return self._held


class CrashingExtend(WrappedSession):
    def extend(self, tokens):
        raise RuntimeError("the port's k-token call crashed")


@pytest.mark.parametrize("prop, said", [("family-P3", "family-P3 cache pins storage after extend 3 (step 4)"),
                                        ("family-memory", "family-memory after extend 3 (step 4)")])
def test_p3_and_memory_judge_the_cache_after_a_k_token_call(prop, said):
    """Was a pass: family-P3 and family-memory drove the prefill and decode steps only."""
    with pytest.raises(PropertyFailure, match=re.escape(said)):
        CHECKS[prop](wrapped(ViewsAfterExtend), FAMILY, VARIANT, "concat")


@pytest.mark.parametrize("prop", ["family-P3", "family-memory"])
def test_a_k_token_call_that_crashes_is_family_p1s_finding_not_a_second_verdict(prop):
    notes = CHECKS[prop](wrapped(CrashingExtend), FAMILY, VARIANT, "concat")
    assert any("the cache was not measured after the extend" in n and "the port's k-token call crashed" in n
               and "family-P1's finding" in n for n in notes), notes
    with pytest.raises(PropertyFailure, match="the implementation's extend raised RuntimeError"):
        CHECKS["family-P1"](wrapped(CrashingExtend), FAMILY, VARIANT, "concat")


@needs_5x
def test_the_windows_rule_is_what_transformers_keeps_after_a_k_token_call_and_a_crop():
    """Family.layer_tokens against transformers 5.24's DynamicSlidingWindowLayer (gemma2's w = 4 layer), call by call:
    3 positions (w - 1) until a k-token call records the past, 6 after it, 7 after a decode, 3 after a crop back 2,
    4 after the next decode."""
    from mpt_kv.checks.family_driver import prompt, teacher_tokens
    from mpt_kv.families import FAMILIES

    fam = FAMILIES["gemma2"]
    config, runner = fam.config("hybrid-window4"), transformers_runner(fam, "hybrid-window4")
    window_layer = fam.layer_windows(config).index(4)
    session = runner.session("concat", 16)
    recorded, held = None, []
    with torch.inference_mode():
        session.prefill(*prompt(config))
        for op in ("decode", "extend", "decode", "crop", "decode"):
            if op == "decode":
                session.decode(teacher_tokens(config, 2, 1, 0))
            elif op == "extend":
                recorded = session.written if recorded is None else recorded
                session.extend(teacher_tokens(config, 2, 3, 0))
            else:
                session.crop(session.written - 2)
                recorded = session.written
            kept = session.kv()[window_layer][0].shape[2]
            assert kept == fam.layer_tokens(config, session.written, recorded_from=recorded)[window_layer], (op, kept)
            held.append(kept)
    assert held == [3, 6, 7, 3, 4]


@needs_5x
def test_a_window_that_pins_its_recorded_past_fails_within_the_range_a_crop_may_keep():
    """While a cache keeps its past for a crop, a window may hold w - 1 to w - 1 + the positions since: a window that
    keeps its w - 1 as a slice of the recorded past has storages of the range's size, and still pins the rest."""
    from mpt_kv.catalogue import family_catalogue as F

    copied = F.window_update(keep=-1, copy=True)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.record_past:
            return copied(self, key_states, value_states, *args, **kwargs)
        full_k, full_v = torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)
        self.cumulative_length += key_states.shape[-2]
        self.keys, self.values = full_k[:, :, -self.sliding_window + 1:], full_v[:, :, -self.sliding_window + 1:]
        return full_k, full_v

    entry = F.FamilyEntry("window_pins_its_recorded_past", "gemma2", "hybrid-window4", "concat", "-", "-",
                          patch=F.window_layer(update))
    with pytest.raises(PropertyFailure, match=r"family-memory after extend 3 \(step \d+\): .* bytes pinned beyond"):
        F.run(entry, "family-memory")

# --- devices and dtypes ------------------------------------------------------------------------------------

class KeysInFloat32(WrappedSession):
    def kv(self):  # a bf16 model's keys cached in fp32 (transformers 4.55's GPT-J: its rotary table is fp32)
        self._held = [(k.float(), v) for k, v in self.inner.kv()]
        return self._held


def test_memory_names_cached_tensors_in_another_dtype_than_the_models():
    # llama gqa in bf16: 2 layers x 2 K/V heads x head dim 8 x 2 bytes x 2 (K and V) = 128 bytes per token per row;
    # keys in fp32 add 64
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: the cache's distinct storages hold 2304 "
                                              r"bytes, the family's analytic K/V for 2 x 6 tokens 1536: \+768 bytes; .*"
                                              r"2 cached tensors \(layer 0 key, layer 1 key\) are float32 in a "
                                              r"bfloat16 model .*dtype=bfloat16"):
        CHECKS["family-memory"](wrapped(KeysInFloat32), FAMILY, VARIANT, "concat", torch.bfloat16)


def test_the_entry_check_counts_transformers_cache_in_the_models_dtype():
    """The family entry describes the cache's shape: transformers' keys cached in fp32 in a bf16 model are
    family-memory's finding (a known failure can take it), not an error that says the entry is wrong."""
    from mpt_kv.checks import family_driver, family_storage

    c = family_driver.context_of("transformers", FAMILY, VARIANT, "concat", torch.bfloat16)
    session = type("S", (), {"written": 6, "max_len": 16})()
    shape = (2, 2, 6, 8)  # batch 2, 2 K/V heads, 6 tokens, head dim 8
    kv = [(layer, name, torch.zeros(shape, dtype=torch.float32 if name == "key" else torch.bfloat16))
          for layer in (0, 1) for name in ("key", "value")]
    family_storage.check_entry_bytes(c, session, kv)  # elements as the entry says: no error
    with pytest.raises(RuntimeError, match="the family entry says 1536"):
        family_storage.check_entry_bytes(c, session, kv[:2])  # one layer missing: the entry misdescribes it


HPU_FAMILY_SCRIPT = """
import json, torch
import habana_frameworks.torch.core as htcore
from mpt_kv.checks.family import CHECKS
from mpt_kv.checks import family_driver
steps = []
htcore.mark_step = lambda: steps.append(1)  # what devices.sync calls on hpu (lazy mode)
notes = CHECKS["family-P1"]("transformers", "gpt2", "mha", "concat", torch.bfloat16, "hpu")
(key,) = [k for k in family_driver._runners if k[3] == torch.bfloat16]
print(json.dumps({"mark_steps": len(steps), "device": key[4], "notes": notes}))
"""


def test_on_hpu_the_implementation_runs_there_and_marks_a_step_after_each_call():
    """The family driver builds the implementation's runner on the case's device (the simulated HPU,
    tests/fakes/hpu), and its sessions mark a step (lazy mode) after every call before anything reads
    the results, as the MPT runners do; the oracle stays transformers' fp32 model on CPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests" / "fakes" / "hpu")]),
           "MPT_KV_FAKE_HPU": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", HPU_FAMILY_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["device"] == "hpu", found
    # the prefill, 2 decodes, the 3-token call and a decode: each followed by a step before its logits are read
    assert found["mark_steps"] >= 5, found


def test_a_port_that_needs_an_hpu_is_unavailable_on_any_other_device(monkeypatch):
    """Where habana_frameworks is installed (a Gaudi runner), a cpu case of a port whose forward calls an
    HPU kernel without a CPU fallback is unavailable with its reason, not built on CPU to crash there."""
    import importlib.util

    from mpt_kv.errors import TargetUnavailable
    from mpt_kv.families import FAMILIES
    from mpt_kv.families import gaudi

    minicpm = FAMILIES["minicpm"]  # no port needs an HPU today (the kernel stand-in runs them): one that did
    real = importlib.util.find_spec
    monkeypatch.setattr(gaudi.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "habana_frameworks" else real(name, *a))
    needy = dataclasses.replace(minicpm, gaudi=dataclasses.replace(minicpm.gaudi, kernels=(), needs_hpu="a kernel"))
    with pytest.raises(TargetUnavailable, match=r"port of minicpm \(MiniCPM3ForCausalLM\) cannot run off an HPU: a kernel"):
        gaudi.gaudi_runner(needy, "mla", torch.bfloat16, device="cpu")
