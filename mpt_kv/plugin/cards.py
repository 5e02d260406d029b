"""xdist card pinning: before a worker's pytest starts, the controller gives it one card of
each device kind in play (devices.CardPool) and sets it in the worker's environment, so the card
is pinned before anything in the worker imports torch (PyTorch >= 2.5 initialises device
backends at `import torch`). More workers than cards is a usage error; a crashed worker's
replacement takes the cards it gave back (docs/gate.md).
"""

from __future__ import annotations

import os

import pytest

from mpt_kv import devices
from mpt_kv.plugin.gate import device_survey
from mpt_kv.plugin.state import run_state


def check_pinned_in_worker() -> None:
    """In an xdist worker, at the earliest hook (before conftest files, which may import torch):
    the card the controller gave this worker is still in place."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            devices.check_pinned()
        except devices.DeviceUnavailable as e:
            raise pytest.UsageError(str(e)) from None


def set_up_pool(config, specs) -> None:
    """xdist controller, before any worker starts: one card of each kind in play per worker."""
    workers = len(specs)
    cards = {}
    for kind, info in device_survey(config).items():
        if info["reason"] is None:
            if workers > len(info["cards"]):
                raise pytest.UsageError(
                    f"-n {workers}: more xdist workers than {kind} cards ({len(info['cards'])}: "
                    f"{devices.VISIBLE[kind]} {','.join(info['cards'])}); each worker needs a card of its own: "
                    f"run with -n {len(info['cards'])} or fewer, or leave {kind} out (-m 'not {kind}' or --device)")
            cards[kind] = info["cards"]
    run_state(config).cards = devices.CardPool(cards) if cards else None


def pin_worker(node) -> None:
    """xdist controller, a worker process started but its pytest not yet: set its card in its
    environment (execnet's remote_exec, as xdist itself does for sys.path)."""
    pool = run_state(node.config).cards
    if pool is None:
        return
    env = devices.pin_env(pool.take(node.gateway.id))
    node.gateway.remote_exec(f"import os\nos.environ.update({env!r})").waitclose()


def give_back(node) -> None:
    """A worker finished or crashed: its cards go back to the pool (xdist starts a replacement
    under a new name, gwN beyond the card count, and it takes them)."""
    pool = run_state(node.config).cards
    if pool is not None:
        pool.give_back(node.gateway.id)


def summary(tw, config) -> None:
    pool = run_state(config).cards
    if pool is not None:
        tw.write_line("xdist cards: " + "; ".join(pool.log))
