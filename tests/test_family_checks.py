"""Each family check kills what it is for, on a small broken wrapper of transformers' real runner,
and passes on the real one (wrapped unchanged): a logits forward that drops the padding mask
(family-P0), an extend that drops it (family-P1), a static kv() one position off (family-P2), a
kv() of views of a bigger buffer (family-P3, family-memory), a logits buffer reused (family-P4), a
reorder of the keys only (family-ops), a cache kept on the model after the session (family-memory).
"""

import pytest
import torch

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.errors import InputError, Unsupported
from mpt_kv.checks import family
from mpt_kv.checks.family import CHECKS
from mpt_kv.families.implementations import IMPLEMENTATIONS, limits_of, transformers_runner
from mpt_kv.families.models import build
from mpt_kv.targets import Capabilities, Runner

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
    with pytest.raises(InputError, match="transformers itself is its oracle"):
        CHECKS["family-P0"]("transformers", FAMILY, VARIANT)


# --- each check kills its broken wrapper ---------------------------------------------------------------------

def test_p0_kills_a_forward_that_drops_the_mask():
    with pytest.raises(PropertyFailure, match=r"family-P0 uncached logits vs transformers' uncached forward \(same "
                                              r"weights\) differ .*target=wrapped/llama, implementation=wrapped, "
                                              r"family=llama, variant=gqa, path=concat, dtype=float32, batch=2, "
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
    with pytest.raises(PropertyFailure, match=r"family-memory after the session was deleted: 4 storages the cache "
                                              r"held \(4608 bytes: layer 0 key, layer 0 value, layer 1 key, layer 1 "
                                              r"value\) are still alive; the model or runner keeps "
                                              r"model\.last_cache\.layers\[0\]\.keys \(2, 2, 9, 8\)"):
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
