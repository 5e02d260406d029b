"""The static-shape property: what HPU graphs, CUDA graphs and torch.compile need of the
`index_copy_` (static) path.

check_static_shape   across decode steps every op inside attention is handed tensors of the same
                     shapes and the same Python scalars, the cache storages never move (same
                     data pointers), and no decode step reads a device value on the host

A graph replays the operations it captured on the addresses it captured: a cache that moves is
read stale, a shape that changes is a new graph (on HPU a compilation of seconds per step). It
raises `PropertyFailure` naming step, layer and what changed. The decode step actually compiled
(torch.compile) and replayed from a CUDA graph is graph-capture's (`mpt_kv.checks.capture`); HPU
graphs run P1, P2 and P4 (`mpt_kv.checks.graphs`).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mpt_kv.checks.compare import PropertyFailure, describe
from mpt_kv.checks.properties import Context, greedy
from mpt_kv.targets.layouts import PagedLayout, QuantizedKV, layout_of


# --- host syncs ------------------------------------------------------------------------------------
# A host sync (.item(), int(t), float(t), bool(t) in an `if`, .tolist(), .cpu() of a device tensor)
# makes the host wait for the device: on HPU and CUDA the next step's launches cannot run ahead,
# every step. The dispatcher shows it on any device, CPU included: the scalar reads below, and a
# copy that takes a non-CPU tensor and returns a CPU one.
SCALAR_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")
# on CPU .tolist() and .numpy() read the memory without a scalar op: seen as torch functions
HOST_READ_METHODS = {torch.Tensor.tolist: "Tensor.tolist", torch.Tensor.numpy: "Tensor.numpy"}
# frames of torch and of this suite's checks are never "where": the target's own line is
_NOT_WHERE = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def short_path(filename: str) -> str:
    """`filename` relative to the sys.path entry it is under (transformers/models/mpt/modeling_mpt.py,
    mpt_kv/catalogue/variants.py), or as it is."""
    filename = os.path.abspath(filename)
    roots = [*filter(None, sys.path), *package_parents()]
    under = [os.path.relpath(filename, p) for p in map(os.path.abspath, roots)
             if filename.startswith(p.rstrip(os.sep) + os.sep)]
    return min(under, key=len) if under else filename


def package_parents() -> list[str]:
    """The folders that hold an imported top-level package: where an editable install or a
    path hook loaded it from, when that folder is not on sys.path (mpt_kv/catalogue/variants.py
    is named so then too)."""
    out = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__path__", None) if "." not in name else None
        out += [os.path.dirname(os.path.abspath(p)) for p in (path or []) if isinstance(p, str)]
    return [p for p in dict.fromkeys(out) if p != os.path.dirname(p)]  # never the filesystem's root


@dataclass(frozen=True)
class SyncSite:
    path: str      # short_path of the file
    lineno: int
    function: str  # its qualified name (Class.method), what Capabilities.host_syncs names
    line: str


def sync_site() -> SyncSite | None:
    """The innermost frame outside torch and mpt_kv/checks: the line that made the host sync."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_NOT_WHERE):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    return SyncSite(short_path(code.co_filename), frame.f_lineno, getattr(code, "co_qualname", code.co_name),
                    linecache.getline(code.co_filename, frame.f_lineno).strip())


class HostSyncs:
    """While active, records each host sync as (op, SyncSite): the scalar reads and device-to-host
    copies the dispatcher sees (TorchDispatchMode) and .tolist()/.numpy() (TorchFunctionMode)."""

    def __init__(self):
        self.syncs: list[tuple[str, SyncSite | None]] = []
        outer = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func.overloadpacket)  # e.g. aten._local_scalar_dense
                if name in SCALAR_READS:
                    outer.syncs.append((name, sync_site()))
                out = func(*args, **kwargs)
                if name not in SCALAR_READS and device_to_host(args, kwargs, out):
                    outer.syncs.append((f"{name} (a copy to the host)", sync_site()))
                return out

        class Methods(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in HOST_READ_METHODS:
                    outer.syncs.append((HOST_READ_METHODS[func], sync_site()))
                return func(*args, **(kwargs or {}))

        self._modes = (Methods(), Ops())

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def device_to_host(args, kwargs, out) -> bool:
    """An op that takes a tensor on a non-CPU device and returns one on the CPU (.cpu(), .to('cpu'),
    copy_ into a CPU tensor)."""
    def devices(tree):
        return {x.device.type for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)}
    return "cpu" in devices(out) and bool(devices((args, kwargs)) - {"cpu"})


def fail_on_host_syncs(syncs, runner, step: int, c: Context) -> None:
    """A PropertyFailure for the first host sync that `runner.capabilities.host_syncs` does not allow."""
    for op, site in syncs:
        if site and host_sync_allowed(runner.capabilities, site.path, site.function):
            continue
        line = f"{site.path}:{site.lineno} in {site.function} (`{site.line}`)" if site else "an unknown line"
        raise PropertyFailure(
            f"static-shape: decode step {step} made a host sync: {op} from {line}: each one stalls a graph's "
            "pipeline (HPU graphs, CUDA graphs: the host waits for the device every step); keep the value on the "
            f"device, or declare Capabilities(host_syncs={{'{site.path if site else '?'}:"
            f"{site.function if site else '?'}': 'why'}}) [{describe(c.ctx(step=step))}]")


def host_sync_allowed(capabilities, path: str, func: str) -> str | None:
    """The declared reason (Capabilities.host_syncs) a host sync made by `func` (a qualified name,
    Class.method) in the file `path` is allowed, or None: the key's path matches as the end of
    `path` at a '/', its function exactly."""
    for key, reason in capabilities.host_syncs.items():
        suffix, _, name = key.rpartition(":")
        if name == func and (path == suffix or path.endswith("/" + suffix)):
            return reason
    return None


# --- shapes and pointers -------------------------------------------------------------------------

def attention_modules(runner) -> list[torch.nn.Module]:
    """Each layer's attention module: the parent of its fused `Wqkv` projection."""
    mods = dict(runner.model.named_modules())
    found = [mods[name.rsplit(".", 1)[0]] for name in mods if name.endswith("Wqkv")]
    if not found:
        raise RuntimeError(f"{runner.name}: no '*Wqkv' module, so no attention module to watch")
    return found


class OpShapes(TorchFunctionMode):
    """Records, for every torch call made while active, (op, its operands): a tensor as its shape
    and dtype, a Python scalar (an index, a slice bound) as its value. A graph captures both; only
    tensor contents may change from one replay to the next."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((op_name(func), tuple(operand(x) for x in tree_flatten((args, kwargs))[0])))
        return func(*args, **kwargs)


SCALARS = (int, float, bool, str, slice, type(None), type(Ellipsis), torch.dtype, torch.device, torch.Size)


def operand(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    return x if isinstance(x, SCALARS) else type(x).__name__


def op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name == "__get__" and hasattr(func, "__self__"):  # a tensor property such as .shape or .T
        return "." + getattr(func.__self__, "__name__", "?")
    return name


class AttentionShapeRecorder:
    """Wraps each attention module's forward: `calls[layer]` is the op/shape list of its latest call.
    Every op inside attention is seen: the k, v the cache hands back, the scores, the mask slice."""

    def __init__(self, modules):
        self.calls: list[list | None] = [None] * len(modules)
        self.modules = modules
        for i, m in enumerate(modules):
            m.forward = self._wrap(i, m.forward)

    def _wrap(self, i, forward):
        def wrapped(*args, **kwargs):
            mode = OpShapes()
            with mode:
                out = forward(*args, **kwargs)
            self.calls[i] = mode.ops
            return out
        return wrapped

    def close(self):
        for m in self.modules:
            del m.forward  # the instance attribute; the class's forward shows through again


def cache_tensors(session) -> list[tuple[str, int | None, torch.Tensor]]:
    """(what, layer, tensor) for every tensor the cache lives in: each layer's cached key and value,
    or for a paged cache (`Session.cache_layout()`) each layer's key and value pool and the block
    table, whose `kv()` is a gathered copy that moves by design."""
    layout = layout_of(session)
    if isinstance(layout, PagedLayout):
        pools = [(f"{name} pool of layer {i}", i, t) for i, pair in enumerate(layout.pools)
                 for name, t in zip(("key", "value"), pair)]
        return [*pools, ("block table", None, layout.block_table)]
    if isinstance(layout, QuantizedKV):  # kv() is dequantized copies; the cache is its codes and scales
        return [(f"cached {what} of layer {i}", i, t) for i, what, t in layout.stored()]
    return [(f"cached {name} of layer {i}", i, t) for i, pair in enumerate(session.kv())
            for name, t in zip(("key", "value"), pair)]


def check_static_shape(runner, c: Context) -> None:
    """Decode `c.case.new_tokens` steps on the static path. Against the first decode step: every op
    inside every attention module sees the same operand shapes and the same Python scalars, and
    every layer's cached key and value keep their data pointer and shape. With `c.bucket`, shapes change by design when the
    bucket (cache_idx) grows: they are compared within a bucket; pointers never move.

    No decode step makes a host sync (`HostSyncs`) outside the places `Capabilities.host_syncs`
    allows. Watched: the target's own step, `session._decode`; not the Session's input checks
    (`Session.decode`, before it), nor the reference's `validate` (off for the decode steps)."""
    if c.path != "static":
        raise ValueError(f"the static-shape property is about the static path, not {c.path!r}")
    ids, mask = c.case.inputs(c.device)
    recorder = AttentionShapeRecorder(attention_modules(runner))
    try:
        with torch.inference_mode():
            session = runner.session("static", c.case.total_len, c.bucket)
            logits = session.prefill(ids, mask)[:, -1]
            first = [(what, t.data_ptr(), tuple(t.shape)) for what, _, t in cache_tensors(session)]
            seen: dict[int, tuple[int, list]] = {}  # bucket -> (step, op shapes per layer)
            target_decode = session._decode
            for step in range(c.case.new_tokens):
                pos = session.written + 1        # token_idx of this step
                syncs, ran = HostSyncs(), []

                def watched(tokens):
                    ran.append(True)
                    with syncs, validation_off(runner.model):
                        return target_decode(tokens)
                session._decode = watched  # an instance attribute: Session.decode calls it after its checks
                try:
                    logits = session.decode(greedy(logits))
                finally:
                    del session._decode
                if not ran:  # fail closed: a decode that bypasses _decode would pass unwatched
                    raise RuntimeError(f"{runner.name}: {type(session).__name__}.decode did not call _decode, so "
                                       "no host sync of its step could be seen: implement _decode or _extend "
                                       "(docs/targets.md), not decode")
                fail_on_host_syncs(syncs.syncs, runner, step, c)
                now = cache_tensors(session)
                if len(now) != len(first):
                    raise PropertyFailure(f"static-shape: the cache had {len(first)} tensors after the prefill, "
                                          f"{len(now)} at decode step {step} [{describe(c.ctx(step=step))}]")
                for (what, p, s), (_, layer, t) in zip(first, now):
                    if t.data_ptr() != p or tuple(t.shape) != s:
                        raise PropertyFailure(
                            f"static-shape: {what} moved at decode step {step}: "
                            f"data_ptr {p:#x} -> {t.data_ptr():#x}, shape {s} -> {tuple(t.shape)} "
                            f"(a graph replays against the captured storage) [{describe(c.ctx(step=step, layer=layer))}]")
                key = -(-pos // c.bucket) if c.bucket else 0
                if key not in seen:
                    seen[key] = (step, list(recorder.calls))
                    continue
                first_step, first_calls = seen[key]
                for layer, (was, now) in enumerate(zip(first_calls, recorder.calls)):
                    compare_ops(was, now, layer, first_step, step, c)
    finally:
        recorder.close()


def compare_ops(was, now, layer, first_step, step, c: Context) -> None:
    where = describe(c.ctx(step=step, layer=layer))
    if len(was) != len(now):
        raise PropertyFailure(f"static-shape: attention of layer {layer} ran {len(was)} ops at decode step "
                              f"{first_step} but {len(now)} at step {step} [{where}]")
    for i, ((op_a, shapes_a), (op_b, shapes_b)) in enumerate(zip(was, now)):
        if op_a != op_b or shapes_a != shapes_b:
            raise PropertyFailure(
                f"static-shape: attention of layer {layer}, op #{i} {op_b}: operands {fmt(shapes_a)} at decode "
                f"step {first_step} became {fmt(shapes_b)} at step {step}"
                + (f" (op was {op_a})" if op_a != op_b else "")
                + " (a captured graph fixes shapes and Python scalars; only tensor contents may change)"
                + f" [{where}]")


def fmt(operands) -> str:
    return "(" + ", ".join(f"tensor{list(x[1])}" if isinstance(x, tuple) and x[:1] == ("tensor",) else repr(x)
                           for x in operands) + ")"


# --- graph capture needs the reference's input checks off ---------------------------------------------

@contextlib.contextmanager
def validation_off(model):
    """The reference validates its inputs with host syncs (.item()): fine eagerly, not in a graph."""
    old = getattr(model, "validate", None)
    if old is not None:
        model.validate = False
    try:
        yield
    finally:
        if old is not None:
            model.validate = old
