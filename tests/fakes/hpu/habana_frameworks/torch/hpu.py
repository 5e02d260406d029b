"""Fake `habana_frameworks.torch.hpu` (registered as `torch.hpu`)."""

import os

# the modules that exist on this fake machine, and the ones this process may use
PRESENT = [m.strip() for m in os.environ.get("MPT_KV_FAKE_HPU_MODULES", "0").split(",") if m.strip()]
VISIBLE = [m.strip() for m in os.environ.get("HABANA_VISIBLE_MODULES", "").split(",") if m.strip()] or PRESENT


def is_available() -> bool:
    return any(m in PRESENT for m in VISIBLE)  # a process that sees a live card has an HPU


def device_count() -> int:
    return len(PRESENT)  # like the real one, it does not read HABANA_VISIBLE_MODULES


def synchronize():
    pass


def memory_allocated(device=None) -> int:
    return 0


max_memory_allocated = memory_allocated


def reset_peak_memory_stats(device=None):
    pass


def memory_stats(device=None) -> dict:
    return {"InUse": 0, "MaxInUse": 0, "Limit": 96 << 30}
