"""User targets: `--target package.module:factory` and `mpt_kv.parametrize_with_checks` in a
project's own test file. The README's worked example runs; a user target with a cache bug
fails; an adapter that raises is an "error" in the matrix, never a property failure; expected
failures xfail only a PropertyFailure.

The three user targets of the shipped properties (the worked example, one with a cache bug, one whose
adapter raises) run in one pytest subprocess (`three_targets`), each test reading its own target's
cases and matrix rows from it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_testing import HANG_S

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parent.parent
PROPERTIES = str(REPO / "mpt_kv" / "conformance" / "test_properties.py")
TINYMPT = str(REPO / "examples" / "downstream" / "src")
# each target's cases: one -k per target, joined (a case id names its target)
SELECT = {
    # the drawn P1 and P3 on the three paths ("P3", not "P3/", would match fp32 too)
    "examples.sdpa_mpt:build": "(P1/ or P3/) and not graphs and not max-seq and not long-gen and not head-dim and "
                               "not bucket-128 and not batch-8 and not alibi-bias",
    # the drawn P1 on the static path only (not its edge cases, graphs or bucket)
    "off_by_one:build": "P1/static and not bucket and not graphs and not max-seq and not long-gen and not head-dim",
    "wrong_keyword:build": "P1/",
}


@pytest.fixture(scope="module")
def three_targets(tmp_path_factory):
    """(exit code, output) of one run of the shipped properties on the three user targets, --only-targets."""
    where = tmp_path_factory.mktemp("user-targets")
    (where / "off_by_one.py").write_text(OFF_BY_ONE)
    (where / "wrong_keyword.py").write_text(WRONG_KEYWORD)
    targets = [f"--target={t}" for t in SELECT]
    k = " or ".join(f"({t.split(':')[0].split('.')[-1]} and ({expr}))" for t, expr in SELECT.items())
    env = {k_: v for k_, v in os.environ.items() if k_ not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "CI")
           and not k_.startswith("MPT_KV_")}
    env.update(PYTHONPATH=os.pathsep.join([TINYMPT, str(where)]), MPT_KV_HYPOTHESIS_PROFILE="ci")
    done = subprocess.run([sys.executable, "-m", "pytest", PROPERTIES, f"--rootdir={REPO}", "-p", "no:cacheprovider",
                           "--device=cpu", "--dtype=fp32", "--only-targets", *targets, "-rA", "-k", k],
                          cwd=where, env=env, capture_output=True, text=True, timeout=HANG_S)
    return done.returncode, done.stdout + done.stderr


def outcomes_of(out: str, target: str) -> dict[str, int]:
    """{PASSED: n, FAILED: n, ...}: the short summary's lines (-rA) of `target`'s cases."""
    counts: dict[str, int] = {}
    for line in out.splitlines():
        word = line.split(" ", 1)[0]
        if word in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL") and f"-{target}-" in line:
            counts[word] = counts.get(word, 0) + 1
    return counts


def matrix(out: str) -> str:
    return out.split("mpt-kv conformance")[1]


def test_the_run_selected_each_targets_cases(three_targets):
    code, out = three_targets
    assert code == pytest.ExitCode.TESTS_FAILED, out  # the cache bug and the raising adapter fail it
    for target in SELECT:
        assert outcomes_of(out, target), f"no case of {target} ran:\n{out[-3000:]}"


def test_worked_example_target_passes_the_properties(three_targets):
    _, out = three_targets
    assert outcomes_of(out, "examples.sdpa_mpt:build") == {"PASSED": 6}, out[-3000:]
    assert re.search(r"^examples\.sdpa_mpt:build +cpu +float32 +concat .*passed", matrix(out), flags=re.M), out[-3000:]


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


def test_user_target_with_a_cache_bug_fails(three_targets):
    _, out = three_targets
    assert outcomes_of(out, "off_by_one:build").get("FAILED"), out[-3000:]
    # a wrong value (PropertyFailure) or, where its last write runs past the cache, the crash with a
    # note naming the property and the context: the first CI example generates one new token
    assert re.search(r"P1.*target=off_by_one:build", out), out[-3000:]


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


def test_an_adapter_that_raises_is_an_error_in_the_matrix_never_a_property_failure(three_targets):
    _, out = three_targets
    assert re.search(r"TypeError.*unexpected keyword argument 'cache_idx'", out), out[-3000:]
    # columns P0 P1 P2 P3 P4 memory static-shape; the bucket path: what the wrapper found, as the reason
    rows = [line for line in matrix(out).splitlines() if line.startswith("wrong_keyword:build ")]
    for row in (r"wrong_keyword:build +cpu +float32 +concat +- +error +- +- +- +- +-$",
                r"wrong_keyword:build +cpu +float32 +static +- +error +- +- +- +- +-$",
                r"wrong_keyword:build +cpu +float32 +static\+bucket4 +- +unsupported +- +- +- +- +-$"):
        assert [r for r in rows if re.match(row, r)], (row, rows)
    assert "wrong_keyword:build declares unsupported: bucket (TinyMptForCausalLM.forward has no cache_idx parameter" \
        in out, out[-3000:]
    assert not [r for r in rows if " failed" in r], rows  # an error, never a property failure


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
