"""What a green run must contain (mpt_kv.plugin.gate.run_problems): a target its conformance tests
apply to, and per target that ran a cache property checked on a cache path. The same function
judges the plugin's run and `python -m mpt_kv report`'s JSON reports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mpt_kv.plugin import gate
from plugin_testing import HANG_S

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

# a target that declares every cache path and operation unsupported: only the uncached P0 can run
UNCACHED_ONLY = """
from mpt_kv import Capabilities
from mpt_kv.targets.reference import build as reference


def build(cfg, state_dict, device, dtype):
    runner = reference(cfg, state_dict, device, dtype)
    runner.capabilities = Capabilities({k: "declared for the test" for k in ("concat", "static", "extend", "crop",
                                                                            "reorder")})
    return runner
"""


# a target whose "cache" is the token ids: every call runs the whole history uncached (right logits, no
# cache); kv() makes K/V-shaped tensors at each read, or returns the ids themselves
RECOMPUTES = """
import torch
from mpt_kv.model.session import Session
from mpt_kv.targets.reference import build as reference


class RecomputeSession(Session):
    def __init__(self, runner, path, max_len):
        super().__init__(path, max_len, runner.model.cfg.max_seq_len, runner.model.cfg.vocab_size)
        self.runner, self.ids = runner, None

    def _prefill(self, ids, mask):
        self.ids, self.mask = ids, mask
        return self.runner.logits(ids, mask)

    def _extend(self, tokens):
        self.ids = torch.cat([self.ids, tokens], 1)
        self.mask = torch.cat([self.mask, torch.ones_like(tokens, dtype=self.mask.dtype)], 1)
        return self.runner.logits(self.ids, self.mask)[:, -tokens.shape[1]:]

    def kv(self):
        cfg, (B, T) = self.runner.model.cfg, self.ids.shape
        if KV == "ids":
            return [(self.ids, self.ids) for _ in range(cfg.n_layers)]
        return [(torch.zeros(B, cfg.n_heads, T, cfg.head_dim), torch.zeros(B, cfg.n_heads, T, cfg.head_dim))
                for _ in range(cfg.n_layers)]


def build(cfg, state_dict, device, dtype):
    runner = reference(cfg, state_dict, device, dtype)
    runner.session = lambda path, max_len, bucket=None: RecomputeSession(runner, path, max_len)
    return runner
"""


@pytest.fixture
def pytest_run(pytester, monkeypatch):
    """pytest in a fresh subprocess from pytester's folder: (exit code, its output)."""
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "MPT_KV_HYPOTHESIS_PROFILE", "MPT_KV_KNOWN_FAILURES", "PYTEST_ADDOPTS",
                "PYTEST_XDIST_WORKER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(pytester.path)]))
    monkeypatch.setenv("MPT_KV_HYPOTHESIS_PROFILE", "ci")  # the runs are not about profiles
    pytester.makepyfile(uncached_only=UNCACHED_ONLY)

    def _run(*args, ini=""):
        if ini:
            pytester.makeini(f"[pytest]\n{ini}\n")
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args, timeout=HANG_S)
        return result.ret, "\n".join(result.outlines + result.errlines)

    return _run


NO_TARGET = "but no target is named (no --target, no ini mpt_kv_targets): the run would have no target"
NO_FAMILY = "no target of this run applies to the conformance tests it selected (1 placeholder cases"


@pytest.mark.parametrize("args, ini, code, line", [
    # hole 2: was exit 0, "7 passed, 75 skipped": only the uncached P0 ran
    pytest.param(("--pyargs", "mpt_kv.conformance.test_properties", "--target", "uncached_only:build", "--only-targets",
                  "--device", "cpu", "--dtype", "fp32", "-k", "(P0 and not P0/) or (P1/ and not graphs and not bucket)"),
                 "", 1,
                 "target uncached_only:build: no cache property passed (P0 passed 1; P1 unsupported 12 on concat, "
                 "static)", id="hole2-only-uncached-P0-ran"),
    # hole 3: was exit 0, "247 skipped" (pytest's empty-parameter placeholders)
    pytest.param(("--pyargs", "mpt_kv.conformance.test_properties", "--only-targets"), "", 4,
                 f"--only-targets {NO_TARGET}", id="hole3-only-targets-without-target"),
    pytest.param(("--pyargs", "mpt_kv.conformance.test_properties"), "mpt_kv_only_targets = true", 4,
                 f"ini option mpt_kv_only_targets = true {NO_TARGET}", id="hole3-ini-only-targets-without-target"),
    # hole 4: was exit 0, "1 skipped": a module whose targets are none of the run's
    pytest.param(("--pyargs", "mpt_kv.conformance.test_families", "--only-targets", "--target", "reference"), "", 4,
                 NO_FAMILY, id="hole4-families-on-reference"),
    # the same under xdist: the controller collects nothing, so its end-of-run verdict says it
    pytest.param(("--pyargs", "mpt_kv.conformance.test_families", "--only-targets", "--target", "reference", "-n", "1"),
                 "", 1, NO_FAMILY, id="hole4-families-on-reference-xdist"),
])
def test_a_run_that_checked_no_cache_or_had_no_target_fails(pytest_run, args, ini, code, line):
    ret, text = pytest_run(*args, ini=ini)
    assert ret == code, text
    assert line in text, text


SHOWN = {"shown": True, "why": "after a prefill of 2 x 5 tokens the cache's storages hold 1280 bytes"}


@pytest.mark.parametrize("kv, why", [
    ("made", "a second read of the cache returned other storages than the first: K/V made at each read"),
    ("ids", "less than the analytic K/V of the prefilled tokens (3840 bytes): no cache is kept")])
def test_a_target_that_recomputes_instead_of_caching_fails_a_run_of_value_checks(pytester, pytest_run, kv, why):
    """Issue 38: was exit 0, "7 passed": P1 compares logits, which a recomputing target gets right."""
    pytester.makepyfile(recomputes=RECOMPUTES.replace("KV ==", f"{kv!r} ==", 1))
    ret, text = pytest_run("--pyargs", "mpt_kv.conformance.test_properties", "--target", "recomputes:build",
                           "--only-targets", "-m", "cpu", "-k", "P1/concat and fp32")
    assert ret == 1, text
    assert "7 passed" in text, text
    assert ("target recomputes:build: its cache properties passed (P1 passed 7 on concat) but show no cache: after a "
            f"prefill of 2 x 5 tokens on concat, float32: ") in text and why in text, text


def case(target, prop, outcome, path="concat", **more):
    """A result record as outcomes.collect makes it (an uncached P0 has no path; a cache property that
    passed carries the run layer's evidence that the cache exists, unless `more` says otherwise)."""
    evidence = {"cache": SHOWN} if outcome == "passed" and prop in gate.CACHE_PROPERTIES and prop != "P0" else {}
    return {"target": target, "property": prop, "outcome": outcome, **({} if prop == "P0" else {"path": path}),
            **evidence, **more}


def family(implementation, fam, prop, outcome, path="concat"):
    return case(f"{implementation}/{fam}", prop, outcome, path, implementation=implementation)


CHECKED = [case("t", "P0", "passed"), case("t", "P1", "passed")]


@pytest.mark.parametrize("results, problem", [
    pytest.param(CHECKED, None, id="a-cache-property-passed"),
    pytest.param([case("t", "P0", "passed"), case("t", "P3", "xfail")], None, id="a-known-failure-is-checked"),
    pytest.param([*CHECKED, case("optimum-habana", "P1", "skipped")], None, id="a-target-that-did-not-run-here"),
    pytest.param([family("transformers", "llama", "family-P1", "unsupported"),
                  family("transformers", "falcon", "family-memory", "passed")], None, id="families-by-implementation"),
    pytest.param([case("t", "P0", "passed")] * 7 + [case("t", "P1", "unsupported"), case("t", "P2", "unsupported", "static")],
                 "target t: no cache property passed (P0 passed 7; P1, P2 unsupported 2 on concat, static)",
                 id="only-P0-passed"),
    pytest.param([case("t", "P4", "passed"), case("t", "P1", "skipped")],
                 "target t: no cache property passed (P4 passed 1 on concat; P1 skipped 1 on concat)",
                 id="P4-checks-outputs-not-the-cache"),
    pytest.param([case("t", "mine", "passed")], "target t: no cache property passed (mine passed 1 on concat)",
                 id="a-projects-own-property-is-not-a-cache-check"),
    pytest.param([{k: v for k, v in case("t", "P1", "passed").items() if k != "path"}],
                 "target t: no cache property passed (P1 passed 1)",
                 id="not-on-a-cache-path"),
    pytest.param([*CHECKED, case("u", "P0", "passed")], "target u: no cache property passed (P0 passed 1)",
                 id="each-target-on-its-own"),
    pytest.param([*CHECKED, family("transformers", "llama", "family-P0", "passed"),
                  family("transformers", "llama", "family-P4", "passed")],
                 "target transformers (families): no cache property passed (family-P0, family-P4 passed 2 on concat)",
                 id="families-uncached-only"),
    pytest.param([{"outcome": "skipped", "nodeid": "m::t[x]", "no_target": "no family implementation"}],
                 "no target of this run applies to the conformance tests it selected (1 placeholder cases, e.g. m::t[x]",
                 id="placeholders-alone"),
    pytest.param([*CHECKED, {"outcome": "skipped", "nodeid": "m::t[x]", "no_target": "none"}], None,
                 id="placeholders-beside-cases"),
    pytest.param([case("t", "P0", "skipped"), case("t", "P1", "unsupported")],
                 "2 conformance cases were reported and none ran", id="none-ran"),
    pytest.param([*CHECKED, case("u", "P0", "skipped"), case("u", "P1", "unsupported")],
                 "target u: no cache property passed (P0 skipped 1; P1 unsupported 1 on concat)",
                 id="a-target-that-ran-nothing-beside-one-that-was-checked"),
    # issue 38: a "cache" that keeps the token ids and recomputes passes the value checks: a pass counts
    # only with the run layer's evidence that a cache exists
    pytest.param([case("t", "P0", "passed"), case("t", "P1", "passed", cache=None)],
                 "target t: its cache properties passed (P1 passed 1 on concat) but show no cache: the record carries "
                 "no evidence that a cache exists", id="a-pass-without-evidence-of-a-cache"),
    pytest.param([case("t", "P1", "passed", cache={"shown": False, "why": "a second read returned other storages"})],
                 "target t: its cache properties passed (P1 passed 1 on concat) but show no cache: a second read "
                 "returned other storages", id="a-cache-recomputed-at-each-read"),
    pytest.param([case("t", "P1", "xfail", cache=None)], None, id="a-known-failure-needs-no-evidence"),
    # issue 38: a run whose cache checks failed checked a cache: it says what failed, not "checked no cache"
    pytest.param([case("t", "P0", "passed"), case("t", "P3", "failed"), case("t", "ops-P3", "error", "static")],
                 "target t: no cache property passed: ops-P3 error 1 on static; P3 failed 1 on concat; their failures "
                 "above say what is wrong", id="red-cache-checks-say-what-failed"),
])
def test_the_rule_over_result_records(results, problem):
    problems = gate.run_problems(results)
    assert problems == [] if problem is None else (len(problems) == 1 and problem in problems[0]), problems
    if problem and "failed" in problem:
        assert "must not look green" not in problems[0], problems  # true of a run that checked nothing only


@pytest.mark.parametrize("results, allow_missing_device, allow_no_cache_check", [
    ([case("t", "P0", "passed")], False, True),
    ([case("t", "P0", "skipped"), case("t", "P1", "skipped")], True, False),
    # a target none of whose cases ran, beside one that was checked (nothing_ran does not see it)
    ([*CHECKED, case("u", "P0", "skipped"), case("u", "P1", "unsupported")], True, False),
])
def test_the_opt_outs(results, allow_missing_device, allow_no_cache_check):
    assert gate.run_problems(results, allow_missing_device, allow_no_cache_check) == []
    assert gate.run_problems(results) != []


def test_every_property_of_the_index_is_a_cache_check_or_not():
    """A property added to the index must be classified (or it never counts: a cache check that never greens)."""
    from mpt_kv.checks.registry import PROPERTIES
    from mpt_kv.checks.family import CHECKS
    from mpt_kv.plugin.report import PROPERTY_NAMES

    cache, other = set(gate.CACHE_PROPERTIES), set(gate.NOT_CACHE_PROPERTIES)
    assert not cache & other, cache & other
    assert cache | other == set(PROPERTY_NAMES) == set(PROPERTIES) | set(CHECKS), (cache | other) ^ set(PROPERTY_NAMES)


@pytest.mark.parametrize("opt_out, code", [(False, 1), (True, 0)])
def test_report_of_a_run_that_checked_no_cache_fails_unless_it_opted_out(tmp_path, capsys, opt_out, code):
    from mpt_kv.cli import report

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"results": [case("uncached_only:build", "P0", "passed"),
                                            case("uncached_only:build", "P1", "unsupported")],
                                "allow_no_cache_check": opt_out}))
    assert report.main([str(path)]) == code
    err = capsys.readouterr().err
    assert ("target uncached_only:build: no cache property passed (P0 passed 1; P1 unsupported 1 on concat)" in err) \
        is not opt_out, err
