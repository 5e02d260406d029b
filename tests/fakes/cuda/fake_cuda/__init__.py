"""Fake CUDA (tests/fakes/README.md): `torch.cuda` on a CPU build of torch, every `cuda` device argument
mapped onto cpu, so the cuda code paths of mpt-kv (the memory meter, CUDA graph capture, `pytest -m cuda`,
the device check) run end to end on a CPU machine. Loaded by `import torch` through the `torch.backends`
entry point when this folder is on PYTHONPATH (as the HPU fake is); `install()` / `uninstall()` do the
same in a running process.

What it simulates, and how far:

- the caching allocator's statistics (`memory_allocated`, `max_memory_allocated`,
  `reset_peak_memory_stats`, `mem_get_info`): every storage a torch function returns while the fake is
  installed, each rounded up to the allocator's 512-byte blocks, counted until it dies (the storages a
  composite op makes inside itself are not seen, nor anything inside a torch.compile'd region);
- CUDA graphs (`torch.cuda.CUDAGraph`, `torch.cuda.graph`): the capture records every aten op and, as a
  real capture, leaves the memory it writes as it was (the ops run to get their outputs, then each
  tensor written in place is put back); a host read while capturing (`.item()`, `bool(t)`) raises as
  CUDA does ("operation not permitted when stream is capturing"); `replay()` runs the recorded ops again
  on the captured tensors, copying each new result into the captured output. Python code is not run
  again: a Python value the capture used stays baked in, as on a GPU;
- streams: one stream, every stream call a no-op; `synchronize()` counts its calls (`SYNCS`);
- cuBLAS's workspace: 32 MiB allocated at the first matmul and kept until
  `torch._C._cuda_clearCublasWorkspaces()`, as on an H200.

Environment: MPT_KV_FAKE_CUDA=cpu (default) or broken (claims a GPU, every op given the cuda device
raises); MPT_KV_FAKE_CUDA_DEVICES=N (default 1).
"""

import contextlib
import os
import types
import weakref


def _autoload():
    """The entry point torch calls at the end of `import torch` (defined before `import torch` below)."""


import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
TOTAL = 141 << 30  # an H200's memory, what mem_get_info reports as the total
SYNCS = []  # the device argument of every torch.cuda.synchronize() call


def _mode() -> str:
    return os.environ.get("MPT_KV_FAKE_CUDA", "cpu")


def _is_cuda(x) -> bool:
    return (isinstance(x, torch.device) and x.type == "cuda") or (isinstance(x, str) and x.split(":")[0] == "cuda")


def _cpu(x):
    return torch.device("cpu") if _is_cuda(x) else x


class Allocator:
    """Live and peak bytes of the storages seen, each rounded up to BLOCK."""

    def __init__(self):
        self.live = self.peak = 0
        self.seen: dict[int, weakref.ref] = {}

    def track(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = s._cdata
            ref = self.seen.get(key)
            if ref is not None and ref() is s:
                continue
            size = -(-s.nbytes() // BLOCK) * BLOCK
            self.seen[key] = weakref.ref(s)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(s, self._free, key, size).atexit = False

    def _free(self, key, size):
        self.seen.pop(key, None)
        self.live -= size


ALLOCATOR = Allocator()

# cuBLAS's workspace: allocated through the caching allocator at the first matmul and kept until
# torch._C._cuda_clearCublasWorkspaces() (32 MiB on an H200, measured there)
WORKSPACE_BYTES = 32 << 20
MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.nn.functional.linear, torch.Tensor.__matmul__, torch.Tensor.matmul}
_workspace: list = []


def _clear_cublas_workspaces():
    _workspace.clear()


class CudaOnCpu(TorchFunctionMode):
    """Every `cuda` device argument becomes `cpu` (broken mode: raises); `Tensor.cuda()` is the tensor
    itself; every tensor returned is counted by the allocator. Inside a torch.compile'd region it only
    calls through (dynamo traces this method; the allocator's bookkeeping is not traceable)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is not torch.device and any(_is_cuda(a) for a in (*args, *kwargs.values())):
            if _mode() == "broken":
                raise RuntimeError(f"CUDA error: unspecified launch failure (fake broken CUDA: {func.__name__})")
            args = tuple(_cpu(a) for a in args)
            kwargs = {k: _cpu(v) for k, v in kwargs.items()}
        if func in MATMULS and not _workspace:  # its first matmul since the workspace was freed
            _workspace.append(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8))
            ALLOCATOR.track(_workspace[0])
        out = func(*args, **kwargs)
        ALLOCATOR.track(out)
        return out


# --- CUDA graphs -------------------------------------------------------------------------------------------

HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")
CAPTURING = []  # the graph being captured, if any


def _storages(tree) -> set:
    return {t.untyped_storage()._cdata for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class _Recorder(TorchDispatchMode):
    """Records (op, args, kwargs, out) while a graph captures; a tensor an op writes in place is saved
    first (once), so that the capture can leave memory as it found it."""

    def __init__(self):
        super().__init__()
        self.ops, self.saved = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in HOST_READS:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing (fake CUDA: {name} "
                               "reads a device value on the host during graph capture)")
        for i, arg in enumerate(func._schema.arguments):  # the arguments the op writes (self of add_, out=)
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.saved:
                    self.saved[t.untyped_storage()._cdata] = (t, t.clone())
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class CUDAGraph:
    def __init__(self):
        self.ops = None

    def replay(self):
        if self.ops is None:
            raise RuntimeError("fake CUDA: replay() of a graph that was never captured")
        for func, args, kwargs, out in self.ops:
            again = func(*args, **kwargs)
            inputs = _storages((args, kwargs))
            for new, old in zip(tree_flatten(again)[0], tree_flatten(out)[0]):
                if isinstance(old, torch.Tensor) and old.untyped_storage()._cdata not in inputs:
                    old.copy_(new)

    def reset(self):
        self.ops = None


class graph:
    """torch.cuda.graph(cuda_graph): records the block's ops into `cuda_graph`, leaving memory as it was."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.cuda_graph = cuda_graph

    def __enter__(self):
        self.recorder = _Recorder()
        self.recorder.__enter__()
        CAPTURING.append(self.cuda_graph)
        return self

    def __exit__(self, *exc):
        self.recorder.__exit__(*exc)
        CAPTURING.pop()
        for t, before in reversed(list(self.recorder.saved.values())):  # a capture runs nothing on a GPU
            t.copy_(before)
        self.cuda_graph.ops = self.recorder.ops
        return False


class Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


_STREAM = Stream()


# --- torch.cuda --------------------------------------------------------------------------------------------

def _count() -> int:
    return int(os.environ.get("MPT_KV_FAKE_CUDA_DEVICES", "1"))


def synchronize(device=None):
    SYNCS.append(device)


def memory_allocated(device=None) -> int:
    return ALLOCATOR.live


def max_memory_allocated(device=None) -> int:
    return ALLOCATOR.peak


def reset_peak_memory_stats(device=None):
    ALLOCATOR.peak = ALLOCATOR.live


PATCHES = {
    "is_available": lambda: _count() > 0,
    "device_count": _count,
    "current_device": lambda: 0,
    "get_device_name": lambda device=None: "fake CUDA (cpu underneath: tests/fakes/cuda)",
    "get_device_capability": lambda device=None: (9, 0),
    "get_device_properties": lambda device=None: types.SimpleNamespace(
        name="fake CUDA (cpu underneath: tests/fakes/cuda)", total_memory=TOTAL, major=9, minor=0,
        multi_processor_count=132),
    "synchronize": synchronize,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "mem_get_info": lambda device=None: (TOTAL - ALLOCATOR.live, TOTAL),
    "empty_cache": lambda: None,
    "Stream": Stream,
    "stream": lambda stream=None: contextlib.nullcontext(),
    "current_stream": lambda device=None: _STREAM,
    "CUDAGraph": CUDAGraph,
    "graph": graph,
    "is_current_stream_capturing": lambda: bool(CAPTURING),
    # dynamo saves and restores the CUDA RNG state around a compile wherever CUDA is available
    "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
    "set_rng_state": lambda new_state, device="cuda": None,
}

_saved: dict = {}
_mode_on: list = []


def install() -> None:
    """torch.cuda patched (PATCHES) and cuda arguments mapped onto cpu, in this process."""
    if _mode_on:
        return
    for name, value in PATCHES.items():
        _saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, value)
    _saved["_C._cuda_clearCublasWorkspaces"] = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch._C._cuda_clearCublasWorkspaces = _clear_cublas_workspaces
    mode = CudaOnCpu()
    mode.__enter__()  # stays on the mode stack of this thread
    _mode_on.append(mode)


def uninstall() -> None:
    if not _mode_on:
        return
    _mode_on.pop().__exit__(None, None, None)
    clear = _saved.pop("_C._cuda_clearCublasWorkspaces")
    if clear is None:
        del torch._C._cuda_clearCublasWorkspaces
    else:
        torch._C._cuda_clearCublasWorkspaces = clear
    for name, value in _saved.items():
        setattr(torch.cuda, name, value)
    _saved.clear()
    _workspace.clear()


install()
