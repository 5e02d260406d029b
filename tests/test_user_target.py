"""`--target package.module:factory`: the README's worked example runs; a user target with a
cache bug fails."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parent.parent
PROPERTIES = str(REPO / "mpt_kv" / "conformance" / "test_properties.py")


def run(pytester, *args):
    return pytester.runpytest_subprocess(PROPERTIES, f"--rootdir={REPO}", "-p", "no:cacheprovider",
                                         "--device=cpu", "--dtype=fp32", "--only-targets", "-rs", *args)


def test_worked_example_target_passes_the_properties(pytester):
    result = run(pytester, "--target=examples.sdpa_mpt:build", "-k", "test_p1 or test_p3")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["*examples.sdpa_mpt:build*cpu*float32*concat*passed*"])


OFF_BY_ONE = """
from mpt_kv.model.cache import StaticCache
from mpt_kv.model.reference import ReferenceMPT
from mpt_kv.targets.reference import ReferenceRunner


class OffByOneCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        return super().update(layer, k, v, None if token_idx is None else token_idx + 1, cache_idx)


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
    result = run(pytester, "--target=off_by_one:build", "-k", "test_p1 and static")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*PropertyFailure: P1 decode logits vs full forward*target=off_by_one:build*"])


# A --target that cannot be imported is a usage error before any test runs, not a skip: see
# tests/test_gate.py::test_named_targets_that_cannot_load_stop_the_run (docs/gate.md).
