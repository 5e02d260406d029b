"""User targets: `--target package.module:factory` and `mpt_kv.parametrize_with_checks` in a
project's own test file. The README's worked example runs; a user target with a cache bug
fails; an adapter that raises is an "error" in the matrix, never a property failure; expected
failures xfail only a PropertyFailure."""

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parent.parent
PROPERTIES = str(REPO / "mpt_kv" / "conformance" / "test_properties.py")


def run(pytester, *args):
    return pytester.runpytest_subprocess(PROPERTIES, f"--rootdir={REPO}", "-p", "no:cacheprovider",
                                         "--device=cpu", "--dtype=fp32", "--only-targets", "-rs", *args)


def test_worked_example_target_passes_the_properties(pytester):
    # the drawn P1 and P3 on the three paths ("P3", not "P3/", would match fp32 too)
    result = run(pytester, "--target=examples.sdpa_mpt:build", "-k", "(P1/ or P3/) and not graphs and not max-seq "
                 "and not long-gen and not head-dim and not bucket-128 and not batch-8 and not alibi-bias")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["*examples.sdpa_mpt:build*cpu*float32*concat*passed*"])


OFF_BY_ONE = """
from mpt_kv.model.cache import StaticCache
from mpt_kv.model.reference import ReferenceMPT
from mpt_kv.targets.reference import ReferenceRunner


class OffByOneCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        # one slot behind: overwrites the previous token, leaves its own slot unwritten (never out of range)
        return super().update(layer, k, v, None if token_idx is None else token_idx - 1, cache_idx)


class Model(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        cache = super().new_cache(path, batch, max_len, fill)
        if path == "static":
            cache.__class__ = OffByOneCache
        return cache


class Runner(ReferenceRunner):
    model_class = Model


def build(cfg, state_dict, device, dtype):
    return Runner(cfg, state_dict, device, dtype)
"""


def test_user_target_with_a_cache_bug_fails(pytester):
    pytester.makepyfile(off_by_one=OFF_BY_ONE)
    # the drawn P1 on the static path only (not its edge cases, graphs or bucket)
    result = run(pytester, "--target=off_by_one:build", "-k",
                 "P1/static and not bucket and not graphs and not max-seq and not long-gen and not head-dim")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    # a wrong value (PropertyFailure) or, where its last write runs past the cache, the crash with a
    # note naming the property and the context: the first CI example generates one new token
    result.stdout.fnmatch_lines(["*P1*target=off_by_one:build*"])


# A --target that cannot be imported is a usage error before any test runs, not a skip: see
# tests/test_plugin_parametrize.py::test_named_targets_that_cannot_load_stop_the_run (docs/gate.md).


WRONG_KEYWORD = """
from mpt_kv import GaudiStyleRunner
from mpt_kv.targets.wrappers import GaudiStyleSession
from tinympt import TinyMptConfig, TinyMptForCausalLM


class Session(GaudiStyleSession):
    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        # written for a newer optimum-habana: cache_idx= on every call, which this model lacks
        out = self.runner.model(input_ids, attention_mask=mask, past_key_values=self.past, use_cache=True,
                                token_idx=None if self.path == "concat" else token_idx, cache_idx=cache_idx)
        self.past = out.past_key_values
        return out.logits


class Runner(GaudiStyleRunner):
    def session(self, path, max_len, bucket=None):
        return Session(self, path, max_len, bucket)


def build(cfg, state_dict, device, dtype):
    model = TinyMptForCausalLM(TinyMptConfig(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len))
    model.load_state_dict(state_dict)
    return Runner(model.to(device, dtype).eval(), device, name="wrong-keyword")
"""


@pytest.fixture
def pytester(pytester, monkeypatch):
    tinympt = str(REPO / "examples" / "downstream" / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tinympt, os.environ.get("PYTHONPATH")])))
    return pytester


def test_an_adapter_that_raises_is_an_error_in_the_matrix_never_a_property_failure(pytester):
    pytester.makepyfile(wrong_keyword=WRONG_KEYWORD)
    result = run(pytester, "--target=wrong_keyword:build", "-k", "P1/")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*TypeError*unexpected keyword argument 'cache_idx'*"])
    # columns P0 P1 P2 P3 memory static-shape; the bucket path: what the wrapper found, as the reason
    result.stdout.re_match_lines([r"wrong_keyword:build +cpu +float32 +concat +- +error +- +- +- +- +-$",
                                  r"wrong_keyword:build +cpu +float32 +static +- +error +- +- +- +- +-$",
                                  r"wrong_keyword:build +cpu +float32 +static\+bucket4 +- +unsupported +- +- +- +- +-$"])
    result.stdout.fnmatch_lines(["*wrong_keyword:build declares unsupported: bucket (TinyMptForCausalLM.forward has no "
                                 "cache_idx parameter*"])
    assert " failed " not in result.stdout.str().split("mpt-kv conformance")[1]


OWN_TESTS = """
import pytest
import mpt_kv
from mpt_kv.catalogue.variants import kv_views_of_mixed_qkv
from wrong_keyword import build as wrong_keyword

views_bug = "prefill caches views of mixed_qkv"


@mpt_kv.parametrize_with_checks([kv_views_of_mixed_qkv, "reference", wrong_keyword], checks=["P3/concat"],
                                expected_failed_checks=lambda target: {"P3/concat": views_bug})
def test_mpt_kv(check, target, device, dtype):
    check(target, device, dtype)
"""


def test_expected_failed_checks_xfail_only_a_property_failure_and_strictly(pytester):
    """One expected failure per target: the views bug xfails; on the reference the check passes
    (XPASS, strict: the run fails); on an adapter that raises TypeError the expectation does not
    absorb it (a failure, "error" in the matrix)."""
    pytester.makepyfile(wrong_keyword=WRONG_KEYWORD, test_own=OWN_TESTS)
    result = pytester.runpytest_subprocess("test_own.py", f"--rootdir={REPO}", "-p", "no:cacheprovider", "--device=cpu",
                                           "--dtype=fp32", "-ra")
    result.assert_outcomes(xfailed=1, failed=2)
    result.stdout.fnmatch_lines(["XFAIL*P3/concat-mpt_kv.catalogue.*kv_views_of_mixed_qkv*prefill caches views*"])
    result.stdout.fnmatch_lines(["[[]XPASS(strict)[]] expected failure: prefill caches views of mixed_qkv"])
    result.stdout.fnmatch_lines(["E * TypeError: *unexpected keyword argument 'cache_idx'"])
    result.stdout.re_match_lines([r"reference +cpu +float32 +concat +- +- +- +XPASS",
                                  r"wrong_keyword:build +cpu +float32 +concat +- +- +- +error"])


def test_an_unknown_expected_check_id_stops_collection(pytester):
    pytester.makepyfile(test_own="""
import mpt_kv

@mpt_kv.parametrize_with_checks(["reference"], expected_failed_checks={"P3-concat": "typo"})
def test_mpt_kv(check, target, device, dtype):
    check(target, device, dtype)
""")
    result = pytester.runpytest_subprocess("test_own.py", f"--rootdir={REPO}", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*unknown check id 'P3-concat'*"])
