"""Per-step verdicts: a known failure of a later call never hides an earlier step's wrong values.

A check that drives several calls judges every step before a crash propagates. An implementation
whose decode is wrong AND whose later extend (or reorder) crashes as a shipped known failure says
fails naming the decode step, in a message the known failure's pattern does not find (so the
conformance case fails, not xfails); the crash alone still matches it, naming the steps judged
before it that held. The crash rule is one: `mpt_kv.checks.compare.Crash`.

Also: the family checks' caches are keyed by what they hold (the Family object, the config), so a
copy of a family under the same name is not given the original's runner or model.
"""

from dataclasses import replace

import pytest
import torch

from mpt_kv.checks import family_driver, operations, programs
from mpt_kv.checks.family import CHECKS
from mpt_kv.checks.index import by_name
from mpt_kv.checks.running import function_of
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.errors import Failures
from mpt_kv.checks.properties import Context
from mpt_kv.families import FAMILIES
from mpt_kv.findings import entries as family_known
from mpt_kv.families.implementations import transformers_runner
from mpt_kv.model.config import random_state_dict
from mpt_kv.targets.reference import build as reference_build

pytest.importorskip("transformers")

FAMILY, VARIANT = "llama", "gqa"
# the port's shipped k-token extend crash (optimum-habana <= 1.21.2): the known failure a fork inherits
EXTEND_CRASH = next(k for k in family_known.load_families()
                    if k.property == "family-P1" and "extend raised" in k.pattern.pattern)
CRASH = "The expanded size of the tensor (9) must match the existing size (6) at non-singleton dimension 3"


class Session:
    """transformers' real session; `wrong_decode` adds 0.5 to a decode's logits (the rows see the
    same tokens: a value bug), `crash` makes that operation (or those, a tuple) raise the port's RuntimeError."""

    def __init__(self, inner, wrong_decode, crash, paths=("concat", "static")):
        self.inner, self.wrong_decode, self.crash, self.paths = inner, wrong_decode, crash, paths

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _maybe_crash(self, operation):
        if operation in ((self.crash,) if isinstance(self.crash, str) else self.crash or ()):
            raise RuntimeError(CRASH)

    def prefill(self, ids, mask):
        return self.inner.prefill(ids, mask)

    def decode(self, tokens):
        self._maybe_crash("decode")
        out = self.inner.decode(tokens)
        return out + 0.5 if self.wrong_decode and self.inner.path in self.paths else out

    def extend(self, tokens):
        self._maybe_crash("extend")
        return self.inner.extend(tokens)

    def crop(self, n):
        self._maybe_crash("crop")
        return self.inner.crop(n)

    def reorder(self, index):
        self._maybe_crash("reorder")
        return self.inner.reorder(index)

    def kv(self):
        return self.inner.kv()


def implementation(wrong_decode: bool, crash: str | None, crash_path=None, paths=("concat", "static")):
    """A builder of IMPLEMENTATIONS' shape around transformers' runner, its sessions `Session`s
    (the crash only on `crash_path` where given)."""
    def build(family, variant, dtype=torch.float32, *, seed=0, **options):
        runner = transformers_runner(family, variant, dtype, seed=seed, **options)
        open_session = runner.session

        def session(path, max_len, bucket=None):
            inner = open_session(path, max_len, bucket)
            return Session(inner, wrong_decode, crash if crash_path in (None, path) else None, paths)
        runner.session = session
        return runner
    build.implementation_name = "stepped"
    return build


def crash_matches(message: str) -> bool:
    return EXTEND_CRASH.pattern.search(message) is not None


# --- family checks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["concat", "static"])
def test_p1_a_wrong_decode_before_a_crashing_extend_fails_naming_the_decode_step(path):
    with pytest.raises(PropertyFailure) as failure:
        CHECKS["family-P1"](implementation(True, "extend"), FAMILY, VARIANT, path)
    message = str(failure.value)
    assert message.startswith("family-P1 decode step 1: cached logits vs transformers' uncached forward"), message
    assert "did not get past extend 3 (step 3), whose extend crashed with RuntimeError" in message, message
    assert not crash_matches(message), f"the known failure {EXTEND_CRASH.pattern.pattern!r} matches: {message}"


@pytest.mark.parametrize("path", ["concat", "static"])
def test_p1_the_extend_crash_alone_is_still_its_known_failure_naming_the_steps_that_held(path):
    with pytest.raises(PropertyFailure) as failure:
        CHECKS["family-P1"](implementation(False, "extend"), FAMILY, VARIANT, path)
    message = str(failure.value)
    assert crash_matches(message), f"pattern {EXTEND_CRASH.pattern.pattern!r} does not match: {message}"
    assert "(judged before it and held: prefill, decode step 1, decode step 2)" in message, message


def test_p2_a_wrong_static_decode_before_a_crashing_concat_extend_fails_naming_the_decode_step():
    build = implementation(True, "extend", crash_path="concat", paths=("static",))
    with pytest.raises(PropertyFailure) as failure:
        CHECKS["family-P2"](build, FAMILY, VARIANT, "static")
    message = str(failure.value)
    assert message.startswith("family-P2 decode step 1: static-path logits vs the concat path's"), message
    assert "crashed with RuntimeError" in message and not crash_matches(message), message


def test_p2_the_concat_extend_crash_alone_is_still_the_crash():
    with pytest.raises(PropertyFailure) as failure:
        CHECKS["family-P2"](implementation(False, "extend", crash_path="concat"), FAMILY, VARIANT, "static")
    message = str(failure.value)
    assert crash_matches(message) and "extend 3 (step 3)" in message, message
    assert "(judged before it and held: prefill, decode step 1, decode step 2)" in message, message


def test_ops_a_reorder_crash_names_the_steps_judged_before_it():
    # family-ops' beam program: decode, reorder, ...: the decode was judged when the reorder raised
    with pytest.raises(PropertyFailure, match=r"family-ops beam step 1 \(reorder \[2, 0, 1\]\): the implementation's "
                                              r"reorder raised RuntimeError: .*\(judged before it and held: prefill, "
                                              r"step 0 \(decode\)\)"):
        CHECKS["family-ops"](implementation(False, "reorder"), FAMILY, VARIANT, "concat")
    # the wrong decode: both programs decode, and each program's failure is its own
    with pytest.raises(Failures) as both:
        CHECKS["family-ops"](implementation(True, "reorder"), FAMILY, VARIANT, "concat")
    assert [str(e).split(":")[0] for e in both.value.exceptions] == [
        "family-ops beam step 0 (decode)", "family-ops assisted step 2 (decode)"]


def test_ops_a_beam_program_crash_hides_no_assisted_program_crash():
    """Each program runs on its own session: a known beam-search crash (a port without _reorder_cache) must
    not stop the assisted program, whose own crash is another finding (a tuple cache without crop)."""
    with pytest.raises(Failures) as both:
        CHECKS["family-ops"](implementation(False, ("reorder", "crop")), FAMILY, VARIANT, "concat")
    beam, assisted = map(str, both.value.exceptions)
    assert beam.startswith("family-ops beam step 1 (reorder [2, 0, 1]): the implementation's reorder raised"), beam
    assert assisted.startswith("family-ops assisted step 1 (crop -2): the implementation's crop raised"), assisted
    with pytest.raises(PropertyFailure) as alone:  # one program failing: its failure as it is, not a group
        CHECKS["family-ops"](implementation(False, "crop"), FAMILY, VARIANT, "concat")
    assert not isinstance(alone.value, Failures) and "assisted step 1 (crop -2)" in str(alone.value)


# --- the MPT operation programs ---------------------------------------------------------------------------

BEAM = programs.FIXED["beam"]  # decode, reorder, decode, ...


def reference_target(wrong_decode: bool, crash: str | None):
    cfg = BEAM.case.cfg
    runner = reference_build(cfg, random_state_dict(cfg, seed=BEAM.case.seed), torch.device("cpu"), torch.float32)
    open_session = runner.session
    runner.session = lambda path, max_len, bucket=None: Session(open_session(path, max_len, bucket), wrong_decode,
                                                               crash)
    return runner


def context():
    return Context("stepped", "cpu", torch.float32, BEAM.case, "concat", None)


@pytest.mark.parametrize("check", ["ops-P1", "ops-P3"])
def test_mpt_ops_a_reorder_crash_names_the_steps_judged_before_it(check):
    with pytest.raises(PropertyFailure, match=rf"{check}: the target's reorder raised RuntimeError: .* at step 1 "
                                              r"\(reorder \[2, 0, 1\]\) \(judged before it and held: prefill, "
                                              r"step 0 \(decode\)\)"):
        function_of(by_name(check))(reference_target(False, "reorder"), context(), BEAM)


def test_mpt_ops_p1_a_wrong_decode_before_a_crashing_reorder_fails_naming_the_decode():
    with pytest.raises(PropertyFailure) as failure:
        operations.check_program_cached(reference_target(True, "reorder"), context(), BEAM)
    message = str(failure.value)
    assert message.startswith("ops-P1 decode logits"), message
    assert "step=0" in message and "reorder raised" not in message, message


def crashing_reference(crash):
    """The reference target (a factory) whose sessions raise at `crash` (an operation, or a tuple of them)."""
    def build(cfg, state_dict, device, dtype):
        runner = reference_build(cfg, state_dict, device, dtype)
        open_session = runner.session
        runner.session = lambda path, max_len, bucket=None: Session(open_session(path, max_len, bucket), False, crash)
        return runner
    return build


def test_mpt_ops_a_beam_program_crash_hides_no_other_fixed_program():
    """The run layer's program driver (by_program): each fixed program on a fresh runner, whatever the one before
    it did, as family-ops' two programs; the drawn programs only once the fixed ones hold."""
    from mpt_kv.checks.registry import CHECKS as MPT_CHECKS

    with pytest.raises(Failures) as every:
        MPT_CHECKS["ops-P1/concat"](crashing_reference(("reorder", "extend")), "cpu", torch.float32)
    beam, *others = map(str, every.value.exceptions)
    assert "the target's reorder raised RuntimeError" in beam, beam
    assert others and all("the target's extend raised RuntimeError" in o for o in others), others


# --- caches keyed by what they hold ----------------------------------------------------------------------

def test_a_family_copy_under_the_same_name_gets_its_own_runner_and_model():
    """A copy of llama with a larger vocabulary, checked after llama in one process: keyed by name,
    it was handed llama's runner and oracle (the copy's prompt tokens past llama's vocabulary: an
    IndexError, a false failure); keyed by the Family object and the config it passes."""
    family = FAMILIES[FAMILY]
    copy = replace(family, tiny={**family.tiny, "vocab_size": 2 * family.config(VARIANT).vocab_size})
    CHECKS["family-P1"]("transformers", family, VARIANT, "concat")
    CHECKS["family-P1"]("transformers", copy, VARIANT, "concat")  # raised PropertyFailure (IndexError) keyed by name
    runner = family_driver.runner_for("transformers", copy, VARIANT, torch.float32, {})
    assert runner.model.config.vocab_size == copy.config(VARIANT).vocab_size
    assert family_driver.oracle_model(copy, VARIANT, torch.float32).config.vocab_size == copy.config(VARIANT).vocab_size
    assert family_driver.runner_for("transformers", family, VARIANT, torch.float32, {}).model.config.vocab_size == \
        family.config(VARIANT).vocab_size


def test_optimum_habanas_generation_function_is_cached_by_the_file_it_comes_from(tmp_path, monkeypatch):
    """Two releases' generation/utils.py in one process: each gives its own function (cached by the
    name alone, the second was handed the first's)."""
    from mpt_kv.targets import gaudi_generation as G

    for release in ("1.19.0", "1.21.2"):
        path = tmp_path / release / "utils.py"
        path.parent.mkdir()
        path.write_text(f"def _which_release():\n    return {release!r}\n")
        monkeypatch.setattr(G, "generation_utils_path", lambda path=path: path)
        assert G.optimum_habana_function("_which_release")() == release, path


def test_the_mpt_ports_patched_classes_are_cached_by_the_module_object():
    """Two modules under one name and file (a reloaded port, a fork substituted in sys.modules):
    each gets classes of its own values (cached by name and file, the second got the first's)."""
    import types

    from mpt_kv.targets import gaudi as gaudi_target

    patch = gaudi_target.MptPatch(1, "MptBlock", None, "GaudiMptBlock")
    modules = []
    for which in ("port", "fork"):
        module = types.ModuleType("optimum.habana.transformers.models.mpt.modeling_mpt")
        module.__file__ = "/same/modeling_mpt.py"
        module.GaudiMptBlock = type(f"{which}Block", (), {})
        modules.append(module)
    for module in modules:
        assert gaudi_target.patched_classes(module, [patch])["MptBlock"] is module.GaudiMptBlock, module.GaudiMptBlock
