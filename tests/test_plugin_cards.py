"""xdist and cards on a simulated HPU (mpt_kv/plugin/cards.py, mpt_kv/devices.py; docs/gate.md rows
5-9, "xdist and cards"): one card per worker, pinned before anything imports torch; a missing or
broken card fails its cases and the gate; more workers than cards is a usage error; a crashed
worker's replacement takes a card that exists."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from mpt_kv import devices

from plugin_testing import ONE_CASE_PER_DEVICE, output, subprocess_runner

pytest_plugins = ["pytester"]


@pytest.fixture
def run(pytester, monkeypatch):
    """run(source, *args, fakes=(), files={}, **env): pytest in a fresh subprocess (plugin_testing)."""
    return subprocess_runner(pytester, monkeypatch)


# --- the simulated HPU: present, broken, a card missing ------------------------------------------------------------

def card_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fake_hpu_one_card_per_worker_pinned_before_torch_and_a_missing_card_fails(run, pytester):
    """`pytest -m hpu -n 2` on a machine with cards 0 and 1 listed, card 1 gone: gw0's cases run
    on its card and pass; gw1's fail naming the card (they do not skip) and gw1 is not restarted.
    Each worker already saw its own card when `import torch` loaded the HPU backend (autoload)."""
    log = pytester.path / "cards.jsonl"
    result = run(ONE_CASE_PER_DEVICE + ONE_CASE_PER_DEVICE.replace("def test_", "def test_again_"), "-m", "hpu",
                 "-n", "2", "-rA", fakes=["hpu"], HABANA_VISIBLE_MODULES="0,1", MPT_KV_FAKE_HPU_MODULES="0",
                 MPT_KV_FAKE_HPU_LOG=str(log))
    text = output(result)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, text
    passed = {line.split("::")[1] for line in result.outlines if line.startswith("PASSED")}
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("ERROR")}
    assert passed and failed and len(passed | failed) == 4, text
    assert "xdist worker gw1 was given hpu card 1 (HABANA_VISIBLE_MODULES=1) but hpu is not available in it" in text
    assert "xdist cards: gw0: hpu 0; gw1: hpu 1" + "\n" in text + "\n", text  # nobody restarted
    seen = {r["worker"]: r["visible"] for r in card_log(log) if r["worker"]}
    assert seen == {"gw0": "0", "gw1": "1"}, seen


def test_broken_hpu_fails_every_case_and_the_gate(run):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", fakes=["hpu"], MPT_KV_FAKE_HPU="broken")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, output(result)
    result.assert_outcomes(failed=2, deselected=2)  # the cpu cases; cuda, which -m hpu cannot select, is not generated
    assert "RuntimeError: synStatus 26" in output(result)
    # every hpu case failed: the gate says which, not that the run checked nothing (issue 38)
    assert "no hpu case passed: 2 of the 2 hpu cases failed (test_gated.py::test_add[hpu], " in output(result)


def test_more_workers_than_cards_is_a_usage_error(run):
    result = run(ONE_CASE_PER_DEVICE, "-m", "hpu", "-n", "3", fakes=["hpu"], MPT_KV_FAKE_HPU_MODULES="0,1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output(result)
    assert "ERROR: -n 3: more xdist workers than hpu cards (2: HABANA_VISIBLE_MODULES 0,1)" in output(result)


CRASHES_ONCE = """
import os
import pytest
import torch

@pytest.mark.parametrize("i", range(4))
def test_case(device, i):
    if i == 0 and not os.path.exists("crashed"):
        open("crashed", "w").close()
        os._exit(1)  # the worker dies; xdist starts another one under a new name
    assert torch.ones(2, device=device).sum().item() == 2
"""


@pytest.mark.slow  # three workers start: ~15 s
def test_a_crashed_workers_replacement_takes_a_card_that_exists(run, pytester):
    log = pytester.path / "cards.jsonl"
    result = run(CRASHES_ONCE, "-m", "hpu", "-n", "2", fakes=["hpu"], MPT_KV_FAKE_HPU_MODULES="0,1",
                 MPT_KV_FAKE_HPU_LOG=str(log))
    result.assert_outcomes(failed=1, passed=3)  # the crash is a failure of the case that crashed
    assert re.search(r"gw2: hpu (\d) \(given back by gw\1\)", output(result)), output(result)
    seen = {r["worker"]: r["visible"] for r in card_log(log) if r["worker"]}
    assert set(seen) == {"gw0", "gw1", "gw2"} and set(seen.values()) == {"0", "1"}, seen


def test_card_pool_hands_out_each_card_once_and_takes_it_back():
    pool = devices.CardPool({"hpu": ["4", "5"]})
    assert pool.take("gw0") == {"hpu": "4"} and pool.take("gw1") == {"hpu": "5"}
    assert pool.take("gw2") == {"hpu": None}  # none left: that worker fails its hpu cases
    pool.give_back("gw1")
    assert pool.take("gw3") == {"hpu": "5"}
    assert pool.log[-1] == "gw3: hpu 5 (given back by gw1)"


def test_pin_env_and_a_pin_that_would_come_too_late(monkeypatch):
    env = devices.pin_env({"hpu": "3", "cuda": "1"})
    assert env == {"HABANA_VISIBLE_MODULES": "3", "CUDA_VISIBLE_DEVICES": "1",
                   devices.ENV_CARDS: '{"hpu": "3", "cuda": "1"}'}
    monkeypatch.setenv(devices.ENV_CARDS, json.dumps({"hpu": "3"}))
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0")
    assert "torch" in sys.modules  # this process imported it: too late to change the card
    with pytest.raises(devices.DeviceUnavailable, match="HABANA_VISIBLE_MODULES is '0', not its card '3', and torch "
                                                        "is already imported"):
        devices.check_pinned()
    monkeypatch.delitem(sys.modules, "torch")  # as in a worker before anything imported it
    devices.check_pinned()
    assert os.environ["HABANA_VISIBLE_MODULES"] == "3"


def test_gaudi_modules_come_from_hl_smi_when_not_listed(tmp_path, monkeypatch):
    """Without HABANA_VISIBLE_MODULES the cards are the module IDs hl-smi lists (Intel Gaudi's
    documented way to map cards), not 0..n-1: a container may hold modules 4-7 only."""
    hl_smi = tmp_path / "hl-smi"
    hl_smi.write_text("#!/bin/sh\nprintf '6\\n4\\n7\\n5\\n'\n")
    hl_smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    assert devices._hpu_modules() == ["4", "5", "6", "7"]
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "2,3")
    assert devices._hpu_modules() == ["2", "3"]


def test_the_plugin_does_not_import_torch_at_import(pytester):
    """An xdist worker loads the plugin before its card is pinned (PyTorch >= 2.5 initialises
    device backends at `import torch`)."""
    result = pytester.run(sys.executable, "-c", "import sys, mpt_kv.plugin, mpt_kv.devices; "
                                                "print('torch' in sys.modules)")
    assert result.outlines[-1] == "False", output(result)
