"""The devices a case can run on: `cpu` always, `cuda` when torch sees a GPU, `hpu` when
`habana_frameworks.torch` imports (Gaudi images ship it; it is on no public registry).

HPU runs in lazy mode by default: ops are queued into a graph that executes at
`htcore.mark_step()`, so `sync` marks a step before anything reads results or memory.
"""

from __future__ import annotations

import functools
import os

import torch

from mpt_kv.errors import DeviceUnavailable

KINDS = ("cpu", "cuda", "hpu")


@functools.cache
def _probe(kind: str) -> str | None:
    """None if usable here, else the reason it is not."""
    if kind == "cpu":
        return None
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no GPU or a CPU build of torch)"
        return None
    if kind == "hpu":
        try:
            import habana_frameworks.torch  # noqa: F401  registers torch.hpu
            import habana_frameworks.torch.core  # noqa: F401
        except ImportError as e:
            return f"habana_frameworks.torch does not import ({e}); it ships in Gaudi images only"
        if not torch.hpu.is_available():
            return "habana_frameworks.torch imported but torch.hpu.is_available() is False"
        return None
    raise DeviceUnavailable(f"unknown device kind {kind!r}: expected one of {KINDS}")


def unavailable_reason(kind: str) -> str | None:
    return _probe(kind)


def available_kinds() -> list[str]:
    return [k for k in KINDS if _probe(k) is None]


def torch_device(kind: str) -> torch.device:
    """The torch device for `kind`. Under pytest-xdist each worker takes its own card: CUDA by
    index; HPU through HABANA_VISIBLE_MODULES, which `pin_worker_to_card` sets before import."""
    reason = _probe(kind)
    if reason:
        raise DeviceUnavailable(f"device {kind} is not available: {reason}")
    if kind == "cuda":
        return torch.device("cuda", worker_index() % torch.cuda.device_count())
    return torch.device(kind)


def pin_worker_to_card() -> None:
    """Give each xdist worker one Gaudi card (a process sees the modules this variable lists).
    Must run before habana_frameworks is imported; an explicit setting is left alone."""
    if "PYTEST_XDIST_WORKER" in os.environ and "HABANA_VISIBLE_MODULES" not in os.environ:
        os.environ["HABANA_VISIBLE_MODULES"] = str(worker_index())


def worker_index() -> int:
    """pytest-xdist worker number (gw0 -> 0), 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


def sync(kind: str) -> None:
    """Make queued work finish: before reading results, timings or memory."""
    if kind == "cuda":
        torch.cuda.synchronize()
    elif kind == "hpu":
        import habana_frameworks.torch.core as htcore

        htcore.mark_step()
        torch.hpu.synchronize()
