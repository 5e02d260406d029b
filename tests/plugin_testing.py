"""What the plugin's tests share (not a test file): a small pytest session in a subprocess, on a
simulated machine, and a stand-in for a pytest config.

Runs that must show an exit status run a small pytest session in a subprocess (pytester), so its
exit status, its environment and its devices are its own. HPU is simulated on this CPU-only
machine by the fakes in tests/fakes/ (put on PYTHONPATH of those subprocesses): one maps hpu onto
cpu, one fails every op, and the module list of the fake machine can leave a card out.
"""

from __future__ import annotations

import os
from pathlib import Path

from mpt_kv import devices

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
BASE = ("-p", "no:cacheprovider")
# The time limit of a subprocess in mpt-kv's own tests: a guard against a hang, never a judge of speed (a
# test's verdict must not depend on how busy the machine is). Far above any of them on a 2-core machine
# at load 30, and under CI's 90 minutes, so that a hang still ends in a failure that names its test.
HANG_S = 3000

ONE_CASE_PER_DEVICE = """
import torch

def test_add(device):
    x = torch.ones(2, device=device)
    assert (x + x).sum().item() == 4

def test_mul(device):
    assert (torch.ones(2, device=device) * 3).sum().item() == 6
"""
EVERY_CASE_SKIPS = """
import pytest

def test_case(device):
    pytest.skip("skipped on purpose")
"""


def subprocess_runner(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env) -> RunResult of pytest in a fresh subprocess, in
    pytester's folder, with `source` as test_gated.py, the fakes named on PYTHONPATH and `env` set
    (none of this run's device, card, profile or known-failures variables)."""
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "MPT_KV_HYPOTHESIS_PROFILE", "MPT_KV_KNOWN_FAILURES",
                devices.ENV_CARDS, "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "HABANA_VISIBLE_MODULES",
                "MPT_KV_FAKE_HPU", "MPT_KV_FAKE_HPU_MODULES", "MPT_KV_FAKE_HPU_LOG", "MPT_KV_FAKE_CUDA",
                "MPT_KV_FAKE_CUDA_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)

    def _run(source, *args, fakes=(), files=None, **env):
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *(str(FAKES / f) for f in fakes)]))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pytester.makepyfile(test_gated=source, **(files or {}))
        return pytester.runpytest_subprocess(*BASE, *args, timeout=HANG_S)

    return _run


def output(result) -> str:
    return "\n".join(result.outlines + result.errlines)


class FakeConfig:
    """What the plugin's functions read of a pytest config."""

    def __init__(self, **options):
        self.options = {"require_device": [], "device": None, "markexpr": "", "allow_missing_device": False,
                        "update_ceilings": False, "mpt_kv_report": None, "ceilings_dir": None, "target": [],
                        **options}
        self.stash = {}  # pytest's Stash, as the plugin uses it: keyed by StashKey

    def getoption(self, name, default=None):
        return self.options.get(name, default)

    def getini(self, name):
        return self.options.get(name, [])  # the project's ini options (mpt_kv_targets, ...): unset

    rootpath, inipath = ROOT, None  # the ceilings folder defaults to <rootdir>/mpt_kv_ceilings
