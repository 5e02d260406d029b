"""One memory meter API on every device: cpu, cuda, hpu.

    meter = meter_for("cpu")
    with torch.inference_mode(), meter:
        meter.reset_peak()
        ...                      # the code being measured
    print(meter.allocated(), meter.peak())

On cuda and hpu the meter reads the caching allocator's statistics (rounded to
the allocator's block sizes, hence `exact = False`). torch keeps no allocator
statistics on cpu, so there the meter is `CpuTracker`, a dispatch mode that
counts every storage an op creates, to the byte (`exact = True`). Whatever the
device, `self_check()` proves the meter moves when memory is allocated: a
meter that silently reads 0 fails loudly.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpt_kv.errors import MeterError  # noqa: F401  (raised here; its home is errors.py)

MiB = 1 << 20




class Meter:
    """Bytes allocated now and at peak on one device."""

    device_kind: str = ""  # "cpu" | "cuda" | "hpu"
    exact: bool = False  # True: reads to the byte; False: allocator rounding

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    def allocated(self) -> int:
        """Bytes live now (after synchronizing the device)."""
        raise NotImplementedError

    def peak(self) -> int:
        """Highest `allocated()` since the last `reset_peak()`."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def release_library_caches(self) -> None:
        """Free what the device's libraries keep for themselves through the allocator (not the
        target's memory), before a reading that is compared with one taken before them. Nothing on
        cpu and hpu."""

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def self_check(self, device: str | torch.device | None = None, nbytes: int = MiB) -> None:
        """Allocate `nbytes` on `device`, check the meter sees them come and go.

        cpu: the growth must be exactly `nbytes`, and exactly 0 after `del`.
        Allocators round a request up to their block size, so on cuda/hpu the
        growth must lie in [nbytes, max(1.25 * nbytes, nbytes + 2 MiB)] (2 MiB
        is the CUDA caching allocator's small-pool segment, the coarsest
        rounding it applies to a 1 MiB request) and fall back within that slack
        after `del`. Resets the peak.
        """
        device = torch.device(device) if device is not None else self.device
        slack = 0 if self.exact else max(nbytes // 4, 2 * MiB)
        with self:
            base = self.allocated()
            self.reset_peak()
            x = torch.empty(nbytes, dtype=torch.uint8, device=device)
            grown = self.allocated() - base
            peak_grown = self.peak() - base
            del x
            left = self.allocated() - base
        where = f"{type(self).__name__} on {device}"
        if self.exact:
            expected = f"exactly {nbytes}"
            ok = grown == nbytes and peak_grown == nbytes and left == 0
        else:
            expected = f"{nbytes}..{nbytes + slack}"
            ok = nbytes <= grown <= nbytes + slack and peak_grown >= nbytes and abs(left) <= slack
        if not ok:
            raise MeterError(
                f"{where}: allocating {nbytes} bytes read as +{grown} bytes "
                f"(peak +{peak_grown}); expected {expected}; after del it read {left:+d} "
                f"bytes (expected {'0' if self.exact else f'within {slack}'})"
            )


# ---------------------------------------------------------------------------
# cpu: an exact live-storage tracker


@dataclass
class _Entry:
    """One storage the tracker has seen: its size now, and how much of it it counted."""

    ref: weakref.ref
    size: int  # storage.nbytes() when last seen
    owned: int  # bytes counted in `live` for it (its growth if it predates the tracker)
    token: int  # tells this registration from a later storage at a reused address


def _storage(t: object) -> torch.UntypedStorage | None:
    """The cpu storage behind a tensor, or None (not a tensor, another device, no storage)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... tensors have none
        return None
    return s if s.device.type == "cpu" else None


# Ops whose output storage is an input but was made, unseen, just before the op:
# torch.tensor(data) builds the tensor outside dispatch, then calls lift_fresh on it.
_FRESH = {torch.ops.aten.lift_fresh.default}


class CpuTracker(TorchDispatchMode):
    """Exact live bytes of the cpu storages created while the mode is active.

    For every op, each output's untyped storage is looked up by identity
    (the C++ StorageImpl address, `storage._cdata`, checked against a weakref
    so a reused address is not mistaken for a dead storage):

    - new (not the storage of an input of the op, not tracked): add its
      `nbytes()` and register `weakref.finalize(storage, ...)` to subtract it
      when it dies. torch keeps the Python `UntypedStorage` object alive as long
      as the C++ storage lives, so the finalizer fires when the last view of it
      dies, not when one tensor goes away;
    - already tracked or an input's storage (views, in-place ops like
      `index_copy_`/`add_`, `out=`): add only its growth (a resize);
    - zero-byte storages are tracked too, since `out=` may grow them later.

    `live` is the bytes allocated inside the block that are still alive;
    `peak` the highest `live` since `reset_peak()`; `total` the sum of all
    allocations (growth included) since the tracker was made.

    Limits, by design:
    - storages created before entering are not counted (their growth inside
      is); measurements are of what happens inside the `with` block;
    - it sees only ops on the thread that entered it (modes are per thread);
    - it does not see memory a kernel allocates internally (e.g.
      scaled_dot_product_attention scratch, oneDNN/MKL workspaces), nor a
      transient old+new buffer during a resize;
    - run it under `torch.inference_mode()`: with grad on it also counts what
      autograd saves for backward, which is real memory but not the model's;
    - readers call `gc.collect()` first so tensors kept only by reference
      cycles are gone (`CpuMeter.allocated()` does).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.total = 0
        self._entries: dict[int, _Entry] = {}
        self._tokens = itertools.count()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _lookup(self, s: torch.UntypedStorage) -> _Entry | None:
        e = self._entries.get(s._cdata)
        return e if e is not None and e.ref() is s else None

    def _grow(self, e: _Entry, size: int) -> None:
        delta = size - e.size
        e.size, e.owned = size, e.owned + delta
        self.live += delta
        if delta > 0:
            self.total += delta
            self.peak = max(self.peak, self.live)

    def _track(self, s: torch.UntypedStorage, size: int, owned: int) -> _Entry:
        key, token = s._cdata, next(self._tokens)
        e = _Entry(weakref.ref(s), size=size - owned, owned=0, token=token)
        self._entries[key] = e
        weakref.finalize(s, self._free, key, token).atexit = False
        self._grow(e, size)  # counts `owned` as growth
        return e

    def _free(self, key: int, token: int) -> None:
        e = self._entries.get(key)
        if e is not None and e.token == token:
            del self._entries[key]
            self.live -= e.owned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        # Input storages and their sizes before the op (an out= may resize them).
        before: dict[int, int] = {}
        for t in flat_in:
            s = _storage(t)
            if s is not None:
                before[s._cdata] = s.nbytes()

        out = func(*args, **kwargs)

        flat_out, _ = tree_flatten(out)
        seen: set[int] = set()
        for t in flat_out:
            s = _storage(t)
            if s is None or s._cdata in seen:
                continue
            seen.add(s._cdata)
            size = s.nbytes()
            e = self._lookup(s)
            if e is not None:
                self._grow(e, size)  # tracked: count its growth only
            elif s._cdata in before and func not in _FRESH:
                if size != before[s._cdata]:  # predates the tracker: count its growth only
                    self._track(s, size, owned=size - before[s._cdata])
            else:
                self._track(s, size, owned=size)  # new storage
        return out


class CpuMeter(Meter):
    """cpu meter: `CpuTracker` must be active (`with meter:`) while the measured code runs.

    Re-entrant: nested `with meter:` blocks share one tracker.
    """

    device_kind = "cpu"
    exact = True

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__(device)
        self.tracker = CpuTracker()
        self._depth = 0

    def __enter__(self) -> CpuMeter:
        if self._depth == 0:
            self.tracker.__enter__()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.tracker.__exit__(*exc)

    def allocated(self) -> int:
        gc.collect()  # drop tensors kept only by reference cycles
        return self.tracker.live

    def peak(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        gc.collect()
        self.tracker.reset_peak()


# ---------------------------------------------------------------------------
# cuda and hpu: the allocator's own statistics


class CudaMeter(Meter):
    device_kind = "cuda"
    exact = False

    def __init__(self, device: str | torch.device = "cuda") -> None:
        super().__init__(device)
        if not torch.cuda.is_available():
            raise MeterError(f"no CUDA device here (torch {torch.__version__}): cannot meter {self.device}")

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_library_caches(self) -> None:
        """cuBLAS allocates its workspace (32 MiB on an H200: 8 chunks of 4 MiB) through the caching
        allocator at a stream's first matmul and keeps it: `memory_allocated` then reads 32 MiB more
        after a first generation than before it, with nothing of the target's alive (measured on an
        H200, torch 2.11: the memory checks' "per-generation state" on the reference). PyTorch's own
        leak check (CudaMemoryLeakCheck, torch/testing/_internal/common_utils.py) frees it the same way."""
        torch.cuda.synchronize(self.device)
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()


class HpuMeter(Meter):
    """Gaudi: needs habana_frameworks, which ships only inside Habana's images.

    In lazy mode ops are queued until `mark_step()`, so every read flushes the
    queue and waits for the device before asking the allocator.
    """

    device_kind = "hpu"
    exact = False

    def __init__(self, device: str | torch.device = "hpu") -> None:
        super().__init__(device)
        try:  # importing it registers torch.hpu
            import habana_frameworks.torch.core as htcore
        except ImportError as e:
            raise MeterError(
                "no HPU here: habana_frameworks is not importable "
                f"({e}); it ships in Habana's Gaudi images, not on a package registry"
            ) from e
        self._htcore = htcore

    def _sync(self) -> None:
        self._htcore.mark_step()
        torch.hpu.synchronize()

    def allocated(self) -> int:
        self._sync()
        return int(torch.hpu.memory_allocated())

    def peak(self) -> int:
        self._sync()
        return int(torch.hpu.max_memory_allocated())

    def reset_peak(self) -> None:
        self._sync()
        torch.hpu.reset_peak_memory_stats()


_METERS: dict[str, type[Meter]] = {"cpu": CpuMeter, "cuda": CudaMeter, "hpu": HpuMeter}


def meter_for(device: str | torch.device) -> Meter:
    """The meter for `device`; MeterError if that device cannot be metered here."""
    device = torch.device(device)
    if device.type not in _METERS:
        raise MeterError(f"no meter for device type {device.type!r}; known: {sorted(_METERS)}")
    return _METERS[device.type](device)
