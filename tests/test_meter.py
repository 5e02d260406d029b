"""The memory meters: CpuTracker counts to the byte; every meter proves it moves."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mpt_kv.memory.meter import CpuMeter, MeterError, meter_for


@pytest.fixture
def meter():
    m = meter_for("cpu")
    with torch.inference_mode(), m:
        yield m


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_empty_reads_exactly_its_bytes(meter):
    x = torch.empty(1000, dtype=torch.uint8)
    assert meter.allocated() == 1000
    y = torch.empty(3, 5, dtype=torch.float64)
    assert meter.allocated() == 1000 + 120
    del x, y


def test_view_adds_nothing_and_clone_adds_its_bytes(meter):
    x = torch.randn(4, 8)
    base = meter.allocated()
    v = x.view(8, 4).transpose(0, 1)[1:]
    assert meter.allocated() == base
    c = x.clone()
    assert meter.allocated() == base + nbytes(x)
    del v, c


def test_index_copy_adds_nothing(meter):
    cache = torch.zeros(2, 4, 16, 8)
    k, idx = torch.ones(2, 4, 1, 8), torch.tensor([5])
    base = meter.allocated()
    cache.index_copy_(2, idx, k)
    assert meter.allocated() == base
    assert cache[:, :, 5].eq(1).all()


def test_cat_adds_the_sum(meter):
    a, b = torch.randn(3, 5), torch.randn(4, 5)
    base = meter.allocated()
    c = torch.cat([a, b])
    assert meter.allocated() == base + nbytes(a) + nbytes(b)
    del c


def test_out_grows_by_the_resize(meter):
    a = torch.randn(6, 7)
    out = torch.empty(0)
    base = meter.allocated()
    torch.add(a, a, out=out)
    assert meter.allocated() == base + nbytes(a)


def test_storage_freed_only_when_last_view_dies(meter):
    x = torch.empty(256)
    v = x[10:20]
    base = meter.allocated()
    del x
    assert meter.allocated() == base  # v keeps the whole storage alive
    del v
    assert meter.allocated() == base - 256 * 4


def test_tensors_made_before_entering_are_not_counted():
    old = torch.randn(64)
    m = CpuMeter()
    with torch.inference_mode(), m:
        v = old[:8]
        assert m.allocated() == 0
        new = old * 2
        assert m.allocated() == nbytes(old)
    del v, new


def test_cat_decode_step_peaks_at_twice_the_cache(meter):
    # A concatenating cache: the old and the new cache coexist inside torch.cat.
    cache, tok = torch.randn(2, 4, 63, 16), torch.randn(2, 4, 1, 16)
    c, t = nbytes(cache), nbytes(tok)
    meter.reset_peak()
    cache = torch.cat([cache, tok], dim=2)
    assert meter.peak() == 2 * c + 2 * t  # old cache + token + new cache
    assert meter.peak() / c == pytest.approx(2.0, rel=0.05)
    assert meter.allocated() == c + 2 * t  # old cache freed


def _work(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a @ b
    d = torch.cat([c, c], dim=0)
    e = torch.softmax(d.clone(), dim=-1)
    f = e.t().contiguous()  # the transposed copy_ allocates scratch inside the kernel
    cache = torch.zeros(2, 4, 32, 8)
    cache.index_copy_(2, torch.tensor([5]), torch.ones(2, 4, 1, 8))
    return f


def test_tracker_agrees_with_the_profiler():
    a, b = torch.randn(64, 128), torch.randn(128, 96)
    with torch.inference_mode():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _work(a, b)
        m = CpuMeter()
        with m:
            _work(a, b)
    # A top-level event's cpu_memory_usage is what the op and its children left
    # allocated when it returned: its output storages. Kernel scratch (e.g. the
    # transposed copy's buffer) is allocated and freed inside the op, so it nets
    # to 0 there; frees of dead tensors come as negative "[memory]" events. So
    # the positive top-level sum is exactly the storages the tracker counts.
    top = [ev for ev in prof.events() if ev.cpu_parent is None]
    profiled = sum(ev.cpu_memory_usage for ev in top if ev.cpu_memory_usage > 0)
    assert profiled > 0, "profiler recorded no cpu memory: profile_memory not working"
    assert m.tracker.total == profiled
    # The profiler also sees the scratch the tracker cannot see: gross >= net.
    gross = sum(ev.self_cpu_memory_usage for ev in prof.events() if ev.self_cpu_memory_usage > 0)
    assert gross >= m.tracker.total


def test_self_check_passes_on_cpu():
    meter_for("cpu").self_check("cpu")


def test_self_check_catches_a_meter_that_reads_zero():
    class Broken(CpuMeter):
        def allocated(self) -> int:
            return 0

    with pytest.raises(MeterError, match=r"Broken on cpu.*1048576 bytes read as \+0"):
        Broken().self_check("cpu")


def test_unknown_device_type_is_an_error():
    with pytest.raises(MeterError, match="meta"):
        meter_for("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_meter_refuses_without_a_device():
    with pytest.raises(MeterError, match="no CUDA device"):
        meter_for("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_self_check():
    m = meter_for("cuda")
    assert (m.device_kind, m.exact) == ("cuda", False)
    m.self_check("cuda")


def test_cuda_meter_reads_the_caching_allocators_statistics_after_a_sync(fake_cuda, monkeypatch):
    """The documented API (torch.cuda.memory_allocated, max_memory_allocated, reset_peak_memory_stats), each
    read after torch.cuda.synchronize of the meter's device, on the simulated GPU (tests/fakes/cuda): an
    allocation reads as its bytes rounded up to the allocator's 512-byte blocks, the peak holds until reset."""
    m = meter_for("cuda:0")
    assert (type(m).__name__, m.device_kind, m.exact) == ("CudaMeter", "cuda", False)
    calls = []
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        real = getattr(torch.cuda, name)
        monkeypatch.setattr(torch.cuda, name, lambda device=None, _real=real, _name=name:
                            (calls.append((_name, device, len(fake_cuda.SYNCS))), _real(device))[1])
    base = m.allocated()
    m.reset_peak()
    x = torch.empty(1000, dtype=torch.uint8, device="cuda")  # 1000 bytes: two 512-byte blocks
    assert (m.allocated() - base, m.peak() - base) == (1024, 1024)
    del x
    assert (m.allocated() - base, m.peak() - base) == (0, 1024)
    m.reset_peak()
    assert m.peak() == m.allocated() == base
    assert {name for name, _, _ in calls} == {"memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"}
    assert all(device == torch.device("cuda", 0) for _, device, _ in calls), calls
    # every read comes after a synchronize of that device: the count of syncs grows before each call
    assert [n for _, _, n in calls] == sorted(n for _, _, n in calls) and calls[0][2] >= 1
    assert all(d == torch.device("cuda", 0) for d in fake_cuda.SYNCS), fake_cuda.SYNCS


def test_cuda_self_check_on_the_simulated_gpu(fake_cuda):
    m = meter_for("cuda")
    m.self_check("cuda")  # 1 MiB reads as 1 MiB (a multiple of 512), back to 0 after del


def test_cuda_self_check_fails_a_meter_that_reads_nothing(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    with pytest.raises(MeterError, match=r"CudaMeter on cuda.*1048576 bytes read as \+0"):
        meter_for("cuda").self_check("cuda")


_HABANA = importlib.util.find_spec("habana_frameworks") is not None


@pytest.mark.skipif(_HABANA, reason="habana_frameworks is installed")
def test_hpu_meter_refuses_without_habana():
    with pytest.raises(MeterError, match="habana_frameworks"):
        meter_for("hpu")


@pytest.mark.skipif(not _HABANA, reason="no HPU: habana_frameworks not installed (ships in Gaudi images)")
def test_hpu_self_check():
    m = meter_for("hpu")
    assert (m.device_kind, m.exact) == ("hpu", False)
    m.self_check("hpu")
