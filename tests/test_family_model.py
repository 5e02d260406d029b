"""A user's own model of a family as a target (`mpt_kv.FamilyModel`, mpt_kv/families/own.py): the
declaration, the one resolver that tells it from an MPT factory, a modeling module loaded without
patching transformers, and the known-failure rule for it (mpt_kv/findings/known.py): what a fork
inherits, strictly, and what nothing inherits by name.

Its model is examples/own_family's owngqa (GQA, a sliding window of 7 on every layer, its own caches),
written from docs/targets.md; tests/test_downstream.py runs that example's whole suite from a folder
outside the repository. The known failures used are transformers 5.x's (the window kept as a slice of
the concatenation: family-P3 and family-memory on concat), so this file runs in the cpu env only.
"""

from __future__ import annotations

import importlib
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import mpt_kv
from mpt_kv import FamilyModel, FamilyTarget, KnownFailure, KnownFailures, PropertyFailure, UnexpectedPass
from mpt_kv.errors import AdapterError, InputError, KnownFailuresError, TargetBroken, UnknownName
from mpt_kv.families import FAMILIES
from mpt_kv.findings.known import entries_for, inherited
from mpt_kv.targets import ResolvedTarget, family_target, resolve_target, target_name

from mpt_kv.versions import transformers_major
from plugin_testing import HANG_S

pytestmark = pytest.mark.skipif(transformers_major() < 5, reason="owngqa's adapter and the known failures used here are "
                                "transformers 5.x's (the cpu env); the ohabana env's forks: tests/test_fork_from_docs.py")

REPO = Path(__file__).resolve().parents[1]
OWNGQA = REPO / "examples" / "own_family" / "src"
P3 = mpt_kv.CHECKS["family-P3/concat"]
# what transformers 5.x's entries and the planted bug's message share (family_known_failures.json, mistral gqa)
SLICE = r"layer 0 key \([0-9, ]+\) is a view of a buffer that is no fused projection's output"


@pytest.fixture(scope="module")
def owngqa():
    """examples/own_family's adapter module (its `build` and `build_model`)."""
    sys.path.insert(0, str(OWNGQA))
    try:
        yield importlib.import_module("owngqa.mpt_kv_target")
    finally:
        sys.path.remove(str(OWNGQA))


@pytest.fixture
def slice_bug(monkeypatch):
    """The planted bug (examples/own_family: the concat window kept as a slice of the concatenation)."""
    monkeypatch.setenv("OWNGQA_WINDOW_SLICE", "1")


# --- the declaration --------------------------------------------------------------------------------------------

def build_nothing(config, state_dict, device, dtype):
    raise AssertionError("not built in these tests")


@pytest.mark.parametrize("kwargs, error, says", [
    (dict(family="mistrall", build=build_nothing), UnknownName, "closest: mistral"),
    (dict(family="mistral"), InputError, "give build="),
    (dict(family="mistral", build=build_nothing, module="mypkg.modeling_mistral", fork_of="transformers"), InputError,
     "one of them"),
    (dict(family="mistral", module="mypkg.modeling_mistral"), InputError, "say what it is a fork of"),
    (dict(family="mistral", build=build_nothing, fork_of="vllm"), InputError, "one of transformers, optimum-habana"),
    (dict(family="mistral", build=build_nothing, fixes={"family-P3/concat": "copied"}), InputError,
     "without fork_of nothing is inherited"),
    (dict(family="mistral", build=build_nothing, variants=()), InputError, "non-empty list of mistral's variants"),
    (dict(family="llama", build=build_nothing, variants="gqa"), InputError, "non-empty list"),
    (dict(family="llama", build=build_nothing, variants=["gqa", "moe"]), InputError, "mha, gqa, mqa"),
])
def test_a_declaration_that_would_check_nothing_or_something_else_is_refused(kwargs, error, says):
    with pytest.raises(error, match=re.escape(says)):
        FamilyModel(**kwargs)


def test_a_declaration_is_named_by_the_attribute_that_holds_it_and_runs_each_variant():
    decl = FamilyModel("llama", build_nothing, variants=["gqa", "mqa"])
    globals()["own_llama"] = decl
    try:
        assert target_name(decl) == f"{__name__}:own_llama"
        assert [t.name for t in decl.targets()] == [f"{__name__}:own_llama/llama/gqa", f"{__name__}:own_llama/llama/mqa"]
        assert all(t.paths == ("concat", "static") and not t.oracle for t in decl.targets())  # family-P0 runs on it
    finally:
        del globals()["own_llama"]
    with pytest.raises(InputError, match="no module attribute holds it"):
        target_name(FamilyModel("llama", build_nothing))


# --- one resolver -------------------------------------------------------------------------------------------------

MODULE = """
import mpt_kv
from mpt_kv.targets.reference import ReferenceRunner

def mpt_factory(cfg, state_dict, device, dtype):
    return ReferenceRunner(cfg, state_dict, device, dtype)

def build_model(config, state_dict, device, dtype):
    raise RuntimeError("never built here")

build = mpt_kv.FamilyModel("mistral", build_model)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userfamily.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userfamily"
    sys.modules.pop("userfamily", None)


def test_one_resolver_tells_a_family_declaration_from_an_mpt_factory(user_module):
    decl = resolve_target(f"{user_module}:build")
    assert isinstance(decl, FamilyModel) and decl.name == f"{user_module}:build"
    assert isinstance(resolve_target(f"{user_module}:mpt_factory"), ResolvedTarget)
    target = family_target(f"{user_module}:build/mistral/gqa")
    assert target.implementation.name == f"{user_module}:build" and target.name == f"{user_module}:build/mistral/gqa"
    assert family_target(decl) == target or family_target(decl).name == target.name  # one variant: itself
    with pytest.raises(InputError, match="runs mistral/gqa, not mistral/mha"):
        family_target(f"{user_module}:build/mistral/mha")
    with pytest.raises(InputError, match="is an MPT target's factory, not a family declaration"):
        family_target(f"{user_module}:mpt_factory/mistral/gqa")
    with pytest.raises(InputError, match="is a model of another family .mistral.*the family checks run it"):
        mpt_kv.CHECKS["P1/concat"](f"{user_module}:build")


def test_a_build_error_is_the_targets_error_naming_it_never_a_finding(user_module):
    with pytest.raises(TargetBroken, match=r"userfamily:build does not build mistral/gqa on cpu: "
                                                         r"RuntimeError: never built here"):
        mpt_kv.CHECKS["family-P1/concat"](f"{user_module}:build/mistral/gqa")


# --- the example: its own model passes, its planted bug fails, named ----------------------------------------------

def test_the_own_model_passes_p0_and_p3_and_its_planted_bug_fails_p3_naming_the_bytes(owngqa, monkeypatch):
    mpt_kv.CHECKS["family-P0/concat"](owngqa.build)
    P3(owngqa.build)
    monkeypatch.setenv("OWNGQA_WINDOW_SLICE", "1")
    with pytest.raises(PropertyFailure) as failure:
        P3(owngqa.build)
    # the slice after the first decode: 7 positions of (2 rows, 2 KV heads, head dim 8) fp32 = 896 bytes hold
    # the 6 the window keeps, 768: the evicted position's 128 bytes pinned, in every layer's key and value
    assert re.search(SLICE + r" of this step: its storage holds 896 bytes, the cached tensors in it 768: 128 bytes "
                             r"pinned", str(failure.value)), failure.value
    assert "target=owngqa.mpt_kv_target:build/mistral" in str(failure.value), failure.value


# --- known failures: what a fork inherits, and what nothing inherits by name ------------------------------------

def fork_of_transformers(owngqa, **kw):
    return FamilyModel("mistral", owngqa.build_model, fork_of="transformers", name="owngqa-fork", **kw)


def test_a_declaration_without_fork_of_inherits_nothing(owngqa, slice_bug):
    """owngqa's own name: transformers' entry about the same bug does not apply to it by name."""
    with pytest.raises(PropertyFailure, match=SLICE):
        P3(owngqa.build, known_failures=KnownFailures())


def test_a_fork_with_its_fork_ofs_bug_xfails_on_the_inherited_entry(owngqa, slice_bug):
    with pytest.raises(KnownFailure) as known:
        P3(fork_of_transformers(owngqa), known_failures=KnownFailures())
    assert known.value.entry.origin == "transformers/mistral/gqa" and known.value.entry.target == "owngqa-fork/mistral/gqa"
    assert "known upstream failure of transformers/mistral/gqa, which owngqa-fork forks" in known.value.msg
    assert isinstance(known.value.failure, PropertyFailure)


def test_a_fork_that_fixed_an_inherited_bug_fails_as_xpass_until_it_declares_the_fix(owngqa):
    with pytest.raises(UnexpectedPass, match=re.escape("fixes={'family-P3/concat': 'how'}")):
        P3(fork_of_transformers(owngqa), known_failures=KnownFailures())
    fixed = fork_of_transformers(owngqa, fixes={"family-P3/concat": "the window is copied, not sliced"})
    assert P3(fixed, known_failures=KnownFailures()) == []
    # the other entries of transformers 5.x it inherits (family-memory and the generate drive's modes on concat)
    # still apply to it
    assert [(e.property, e.path, e.check) for e in inherited(fixed, KnownFailures().entries) if e.applies()] == [
        ("family-memory", "concat", None), ("generate", "concat", "generate/concat/greedy"),
        ("generate", "concat", "generate/concat/beam"), ("generate", "concat", "generate/concat/prompt-lookup"),
        ("generate", "concat", "generate/concat/chunked"), ("generate", "concat", "generate/concat/multi-turn")]


def test_fixes_naming_no_inherited_entry_is_an_error(owngqa):
    with pytest.raises(KnownFailuresError, match=r"fixes=\['family-P1/static'\]: no entry of transformers/mistral .*"
                                                 r"gqa family-P3 concat"):
        inherited(fork_of_transformers(owngqa, fixes={"family-P1/static": "typo"}), KnownFailures().entries)
    with pytest.raises(KnownFailuresError, match="a family check id"):
        inherited(fork_of_transformers(owngqa, fixes={"P3/concat": "not a family check"}), KnownFailures().entries)


def test_a_fork_under_the_implementations_name_takes_none_of_its_entries():
    """A FamilyTarget named transformers/mistral/gqa whose Family is an edited copy of the entry is not
    the model the shipped entries were measured on: they do not apply by its name (fail closed)."""
    registry = FamilyTarget("transformers", FAMILIES["mistral"], "gqa", oracle=True)
    edited = FamilyTarget("transformers", replace(FAMILIES["mistral"], design="window, edited"), "gqa", oracle=True)
    known = KnownFailures()
    assert len(entries_for(edited, known.entries)) < len(entries_for(registry, known.entries)) == len(known.entries)
    with pytest.raises(KnownFailure):
        P3(registry, known_failures=known)
    with pytest.raises(PropertyFailure, match=SLICE):
        P3(edited, known_failures=known)


def test_a_projects_own_file_holds_entries_about_its_family_targets(owngqa, slice_bug, tmp_path):
    own = tmp_path / "known.json"
    own.write_text("""[{"target": "owngqa.mpt_kv_target:build/mistral/gqa", "property": "family-P3", "path": "concat",
      "pattern": "layer 0 key \\\\([0-9, ]+\\\\) is a view of a buffer that is no fused projection's output",
      "reason": "the window is a slice until #12 lands"}]""")
    with pytest.raises(KnownFailure, match=r"known failure of this project \(known.json\)"):
        P3(owngqa.build, known_failures=KnownFailures(own))
    own.write_text('[{"target": "owngqa.mpt_kv_target:build", "property": "family-P3", "pattern": "layer 0 key is a '
                   'view", "reason": "r"}]')
    with pytest.raises(KnownFailuresError, match="a family entry's target is '<spec>/<family>/<variant>'"):
        KnownFailures(own)


def test_an_entry_of_one_dtype_applies_by_hand_in_that_dtype_only(owngqa, slice_bug, tmp_path):
    """The by-hand rule reads the case's dtype and device as the plugin does: an entry naming bfloat16 is
    the known failure of the bf16 case, and the fp32 case fails as it is."""
    own = tmp_path / "known.json"
    own.write_text("""[{"target": "owngqa.mpt_kv_target:build/mistral/gqa", "property": "family-P3", "path": "concat",
      "dtype": "bfloat16", "device": "cpu", "pattern": "is a view of a buffer", "reason": "bf16 only, until #12"}]""")
    with pytest.raises(KnownFailure, match="bf16 only"):
        P3(owngqa.build, "cpu", torch.bfloat16, known_failures=KnownFailures(own))
    with pytest.raises(BaseException, match=SLICE) as raised:  # an xfail escaping here would read as one
        P3(owngqa.build, "cpu", "fp32", known_failures=KnownFailures(own))
    assert type(raised.value) is PropertyFailure, type(raised.value)


# --- a modeling module: a copy of transformers' file, loaded without patching transformers ------------------------

def copy_of_transformers_mistral(where: Path, package: str, absolute: bool = True) -> str:
    import transformers.models.mistral.modeling_mistral as upstream

    (where / package).mkdir()
    (where / package / "__init__.py").write_text("")
    text = Path(upstream.__file__).read_text()
    if absolute:  # as Hub remote code writes them (docs/targets.md)
        text = re.sub(r"^from \.\.\.", "from transformers.", text, flags=re.M)
        text = re.sub(r"^from \.configuration_mistral", "from transformers.models.mistral.configuration_mistral",
                      text, flags=re.M)
    (where / package / "modeling_mistral.py").write_text(text)
    return f"{package}.modeling_mistral"


@pytest.fixture
def modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("usercopy"):
            del sys.modules[name]


def test_a_copy_of_transformers_modeling_file_runs_as_its_own_model(modules):
    module = copy_of_transformers_mistral(modules, "usercopy")
    decl = FamilyModel("mistral", module=module, fork_of="transformers", name="usercopy")
    mpt_kv.CHECKS["family-P0/concat"](decl)
    mpt_kv.CHECKS["family-P1/static"](decl)
    runner = decl(FAMILIES["mistral"], "gqa")
    attention = type(runner.model.model.layers[0].self_attn)
    assert attention.__module__ == module  # the copy's class, and transformers' own left as it is
    import transformers.models.mistral.modeling_mistral as upstream
    assert upstream.MistralAttention.__module__ == "transformers.models.mistral.modeling_mistral"
    with pytest.raises(KnownFailure):  # transformers 5.x's cache: the window slice, inherited from transformers
        P3(decl, known_failures=KnownFailures())


def test_a_module_that_reexports_upstream_is_refused(modules):
    (modules / "usercopy_reexport.py").write_text("from transformers.models.mistral.modeling_mistral import *  # noqa\n")
    decl = FamilyModel("mistral", module="usercopy_reexport", fork_of="transformers", name="reexport")
    with pytest.raises(AdapterError, match="runs no class or function of usercopy_reexport"):
        mpt_kv.CHECKS["family-P1/concat"](decl)


def test_a_copy_that_keeps_its_relative_imports_says_how_to_load_it(modules):
    module = copy_of_transformers_mistral(modules, "usercopy_relative", absolute=False)
    decl = FamilyModel("mistral", module=module, fork_of="transformers", name="relative")
    with pytest.raises(TargetBroken, match=r"make them absolute \(`from transformers.cache_utils import`\)"):
        decl(FAMILIES["mistral"], "gqa")  # an error of every case, never a skip


# --- the plugin: the shipped suite and a project's own test file ------------------------------------------------

pytest_plugins = ["pytester"]

OWN_TESTS = """
import mpt_kv
from owngqa.mpt_kv_target import build, build_model

# a fork of transformers' Mistral (its entries inherited): the fixed copy, and one with transformers' bug
fixed = mpt_kv.FamilyModel("mistral", build_model, fork_of="transformers")
buggy = mpt_kv.FamilyModel("mistral", build_model, fork_of="transformers")


@mpt_kv.parametrize_with_checks([build, fixed, buggy], checks=["family-P3/concat", "family-P1/concat"])
def test_family(check, target, device, dtype, monkeypatch):
    if target.implementation_name.endswith(":buggy"):
        monkeypatch.setenv("OWNGQA_WINDOW_SLICE", "1")
    check(target, device, dtype)
"""


def run_pytest(pytester, *args):
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--rootdir={pytester.path}", "-rA", *args,
                                         timeout=HANG_S)


@pytest.fixture
def project(pytester, monkeypatch):
    for var in ("CI", "MPT_KV_KNOWN_FAILURES", "MPT_KV_HYPOTHESIS_PROFILE", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(OWNGQA))
    return pytester


@pytest.mark.slow  # one pytest subprocess (transformers' import, 6 family cases)
def test_parametrize_with_checks_applies_what_a_fork_inherits_and_the_projects_own_entries(project):
    project.makepyfile(test_own=OWN_TESTS)
    project.path.joinpath("known.json").write_text("""[{"target": "owngqa.mpt_kv_target:build/mistral/gqa",
      "property": "family-P1", "path": "concat", "pattern": "cached logits vs transformers' uncached forward",
      "reason": "the project's own entry about its own model, which passes: XPASS"}]""")
    result = run_pytest(project, "test_own.py", "--device=cpu", "--dtype=fp32", "-o", "mpt_kv_known_failures=known.json")
    out = "\n".join(result.outlines)
    result.assert_outcomes(passed=3, failed=2, xfailed=1)
    # the fork that fixed its fork_of's bug: XPASS, saying how to declare the fix
    assert "FAILED test_own.py::test_family[cpu-fp32-family-P3/concat-test_own:fixed/mistral/gqa]" in out, out
    assert re.search(r"\[XPASS\(strict\)\] known upstream failure of transformers/mistral/gqa, which test_own:fixed forks "
                     r"entry \d+ .* -- if test_own:fixed fixed it, declare that in its FamilyModel: "
                     r"fixes=\{'family-P3/concat': 'how'\}", out), out
    # the fork that has it: xfail on the inherited entry; owngqa itself (no fork_of) passes P3
    assert re.search(r"XFAIL test_own.py::test_family\[cpu-fp32-family-P3/concat-test_own:buggy/mistral/gqa\] - known "
                     r"upstream failure of transformers/mistral/gqa, which test_own:buggy forks", out), out
    assert "PASSED test_own.py::test_family[cpu-fp32-family-P3/concat-owngqa.mpt_kv_target:build/mistral/gqa]" in out
    # the project's own entry about its own target: strict too
    assert "FAILED test_own.py::test_family[cpu-fp32-family-P1/concat-owngqa.mpt_kv_target:build/mistral/gqa]" in out
    assert re.search(r"\[XPASS\(strict\)\] known failure of this project \(known.json\) entry 0 "
                     r"\(owngqa.mpt_kv_target:build/mistral/gqa family-P1 concat\) did not happen", out), out
    assert "inherited by test_own:buggy: 1 cases xfailed as known" in out, out


@pytest.mark.slow  # two pytest subprocesses (collection only, then a usage error)
def test_a_named_family_target_whose_cases_the_run_does_not_collect_is_a_usage_error(project):
    """--target naming a family declaration with only the MPT modules selected: alone (only placeholders)
    and beside an MPT target (whose cases would otherwise make the run green)."""
    alone = run_pytest(project, "--pyargs", "mpt_kv.conformance.test_properties", "--target",
                       "owngqa.mpt_kv_target:build", "--only-targets")
    assert alone.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(alone.outlines + alone.errlines)
    assert "owngqa.mpt_kv_target:build is a family target" in "\n".join(alone.errlines)
    beside = run_pytest(project, "--pyargs", "mpt_kv.conformance.test_properties", "--target",
                        "owngqa.mpt_kv_target:build", "--target", "reference", "--only-targets", "-k",
                        "P3/concat] and fp32")  # the reference alone: a green run without the rule
    errors = "\n".join(beside.errlines)
    assert beside.ret == pytest.ExitCode.USAGE_ERROR, "\n".join(beside.outlines) + errors
    assert ("target owngqa.mpt_kv_target:build is a family target (mistral) named with --target (or ini "
            "mpt_kv_targets), but no case of it is in this run") in errors, errors


def test_python_m_mpt_kv_run_says_a_family_target_is_one(owngqa):
    """`python -m mpt_kv run --target` describes what is here: a family target by its cases, not as an MPT
    factory that does not build."""
    from mpt_kv.cli.run import describe_machine

    (line,) = [x for x in describe_machine(["owngqa.mpt_kv_target:build"], ["cpu"]) if x.startswith("target")]
    assert line.split() == ["target", "owngqa.mpt_kv_target:build", "family", "target:",
                            "owngqa.mpt_kv_target:build/mistral/gqa"], line
