"""A CPU stand-in for `habana_frameworks`, scoped to importing one optimum-habana model module.

Several Gaudi model modules of optimum-habana (falcon, gpt_bigcode, gptj, llama, qwen2,
starcoder2, ...) run `import habana_frameworks.torch.core as htcore` unconditionally, for
`htcore.mark_step()`, and import their fused kernels (`habana_frameworks.torch.hpex.kernels`)
inside try/except with a CPU fallback. On CPU that first import fails, so such a module cannot
be loaded at all. `import_with_standin(name)` registers, for the duration of that one import:

    habana_frameworks                     an empty package
    habana_frameworks.torch               an empty package
    habana_frameworks.torch.core          `mark_step()`: does nothing (no lazy graph on CPU)
    habana_frameworks.torch.hpu           `is_available()`: False

and nothing else: every kernel import fails as it would without an HPU stack, so the module
takes its own CPU fallbacks. Afterwards every stand-in entry is removed from `sys.modules`, so
`importlib.util.find_spec("habana_frameworks")` is None again and nothing outside that import
sees a Gaudi stack: `mpt_kv.devices` (which decides HPU presence from `find_spec` and from
`import habana_frameworks.torch` plus `torch.hpu.is_available()`) and the gate (`-m hpu`
requires an HPU: docs/gate.md) still see none. The imported module keeps its reference to the
stand-in `htcore`, whose `mark_step` stays a no-op. torch itself is never touched: `torch.hpu`
is not registered.

It is never used where a real `habana_frameworks` is installed: `standin()` refuses (the real
import path, with its real failures, is the caller's: mpt_kv/families/gaudi.py).

The kernel stand-in (`kernels=True`): a port that calls an HPU kernel with no CPU fallback
(`GaudiPort.kernels`: the mixture-of-experts ports' `torch.ops.hpu.mixture_of_experts`, MiniCPM3's
`FusedSDPA` imported at module level) is imported with, besides the above,

    habana_frameworks.torch.hpex                an empty package
    habana_frameworks.torch.hpex.kernels        FusedSDPA, RotaryPosEmbeddingHelperV2
    habana_frameworks.torch.hpex.normalization  FusedRMSNorm
    habana_frameworks.torch.hpu                 also wrap_in_hpu_graph (the module itself)

all of mpt_kv/families/hpu_kernels.py (CPU functions written from the kernels' documented semantics),
and removed again after the import, as the loading stand-in's. `torch.ops.hpu.mixture_of_experts` is
looked up when the port's forward runs, so it exists only then: `scope_forward(model, port)` puts
`kernel_scope` around every forward of the built model, which gives `torch.ops` an `hpu` namespace
holding that one op (and puts back what was there before), and applies the entry's `hpu_branches`
(gpt_oss: its RoPE's HPU branch, whose CPU branch cannot run). A stand-in kernel called outside such
a scope raises (`hpu_kernels.StandinOutOfScope`). `torch.hpu` is never touched and
`habana_frameworks.torch.hpu.is_available()` stays False; the cases that ran it are labelled
`cpu+standin` (`device_label`), never counted as HPU cases.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import types

PACKAGES = ("habana_frameworks", "habana_frameworks.torch")
MODULES = PACKAGES + ("habana_frameworks.torch.core", "habana_frameworks.torch.hpu")
# what the kernel stand-in adds (kernels=True)
KERNEL_PACKAGES = ("habana_frameworks.torch.hpex",)
KERNEL_MODULES = KERNEL_PACKAGES + ("habana_frameworks.torch.hpex.kernels", "habana_frameworks.torch.hpex.normalization")
# the kernels a port entry may declare (GaudiPort.kernels) -> where its port finds it
KERNELS = {"FusedSDPA": "habana_frameworks.torch.hpex.kernels.FusedSDPA",
           "RotaryPosEmbeddingHelperV2": "habana_frameworks.torch.hpex.kernels.RotaryPosEmbeddingHelperV2",
           "FusedRMSNorm": "habana_frameworks.torch.hpex.normalization.FusedRMSNorm",
           "mixture_of_experts": "torch.ops.hpu.mixture_of_experts"}
STANDIN_LABEL = "cpu+standin"
MARK = "__mpt_kv_standin__"  # set on every stand-in module: what is removed afterwards


def is_standin(module) -> bool:
    """Whether `module` is one of this stand-in's modules (never a real habana_frameworks)."""
    return bool(getattr(module, MARK, False))


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"mpt-kv's CPU stand-in for {name} (mpt_kv/families/habana_standin.py)")
    package = name in PACKAGES + KERNEL_PACKAGES
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="mpt_kv.families.habana_standin",
                                                     is_package=package)
    if package:
        module.__path__ = []  # a package with no submodules on disk: `...hpex.kernels` is not found
    setattr(module, MARK, True)
    return module


def _mark_step(*args, **kwargs) -> None:
    """No-op: on CPU there is no lazy graph to execute."""


def _is_available() -> bool:
    return False


@contextlib.contextmanager
def standin(kernels=()):
    """The context in which the stand-in is importable (see the module docstring); with `kernels` (names
    of `KERNELS`) also the kernel stand-in's modules (hpex.kernels, hpex.normalization) holding those of
    them (a kernel not named fails to import there, as without an HPU stack: the port's fallback).

    RuntimeError where a real habana_frameworks is installed or already imported (the stand-in
    must never shadow it), or where another stand-in is active."""
    names = MODULES + (KERNEL_MODULES if kernels else ())
    if any(n in sys.modules for n in names):
        what = [n for n in names if n in sys.modules]
        kind = "a stand-in" if all(is_standin(sys.modules[n]) for n in what) else "the real habana_frameworks"
        raise RuntimeError(f"habana_frameworks stand-in refused: {kind} is already imported ({', '.join(what)})")
    if importlib.util.find_spec("habana_frameworks") is not None:
        raise RuntimeError("habana_frameworks stand-in refused: a real habana_frameworks is installed; import the "
                           "model module the normal way (its failures are the real ones)")
    sys.modules.update(_modules(kernels))
    try:
        yield
    finally:
        remove()


def _modules(kernels) -> dict:
    """The stand-in's modules by name (module doc), the kernel stand-in's with `kernels`."""
    names = MODULES + (KERNEL_MODULES if kernels else ())
    modules = {n: _module(n) for n in names}
    modules["habana_frameworks"].torch = modules["habana_frameworks.torch"]
    modules["habana_frameworks.torch"].core = modules["habana_frameworks.torch.core"]
    modules["habana_frameworks.torch"].hpu = modules["habana_frameworks.torch.hpu"]
    modules["habana_frameworks.torch.core"].mark_step = _mark_step
    modules["habana_frameworks.torch.hpu"].is_available = _is_available
    if kernels:
        from mpt_kv.families import hpu_kernels

        modules["habana_frameworks.torch"].hpex = modules["habana_frameworks.torch.hpex"]
        modules["habana_frameworks.torch.hpex"].kernels = modules["habana_frameworks.torch.hpex.kernels"]
        modules["habana_frameworks.torch.hpex"].normalization = modules["habana_frameworks.torch.hpex.normalization"]
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"habana_frameworks kernel stand-in: unknown kernels {unknown}; it has {sorted(KERNELS)}")
        for name, where in KERNELS.items():
            if name in kernels and where.startswith("habana_frameworks."):
                setattr(modules[where.rsplit(".", 1)[0]], name, getattr(hpu_kernels, name))
        modules["habana_frameworks.torch.hpu"].wrap_in_hpu_graph = hpu_kernels.wrap_in_hpu_graph
        if "FusedSDPA" in kernels:  # FusedSDPA's recompute context, which the ports open around it
            modules["habana_frameworks.torch.hpu"].sdp_kernel = hpu_kernels.sdp_kernel
    return modules


def remove() -> list[str]:
    """Remove every stand-in entry from sys.modules (and only those); the names removed."""
    gone = [n for n, m in list(sys.modules.items())
            if (n == "habana_frameworks" or n.startswith("habana_frameworks.")) and is_standin(m)]
    for n in gone:
        del sys.modules[n]
    importlib.invalidate_caches()
    return gone


def import_with_standin(name: str, kernels=()):
    """`importlib.import_module(name)` with the stand-in registered for that import only (with `kernels`:
    the kernel stand-in holding those)."""
    with standin(kernels):
        return importlib.import_module(name)


# --- the kernel stand-in while a port's forward runs ------------------------------------------------------------------

class _HpuOps:
    """What `torch.ops.hpu` holds inside a kernel scope: the stand-in of mixture_of_experts, nothing else
    (any other op is an AttributeError, as an op the HPU stack does not have)."""

    def __init__(self):
        from mpt_kv.families import hpu_kernels

        self.mixture_of_experts = hpu_kernels.mixture_of_experts

    def __repr__(self):
        return "<mpt-kv's CPU stand-in for torch.ops.hpu: mixture_of_experts only>"


_MISSING = object()


@contextlib.contextmanager
def kernel_scope(kernels, branches=(), importable: bool = False):
    """The stand-in kernels named (hpu_kernels; a port's `GaudiPort.kernels`) may run,
    `torch.ops.hpu.mixture_of_experts` exists where it is one of them, and each `(module, name, value)`
    of `branches` is set, for the duration; everything is put back after (nested scopes: the outermost
    one decides and puts it back). `importable`: the kernel stand-in's modules are in sys.modules for the
    duration too (a port's flash attention imports `habana_frameworks.torch.hpu` inside its forward, for
    `sdp_kernel`: models/gemma2/modeling_gemma2.py:304), and removed after, so that outside a forward
    `find_spec("habana_frameworks")` is None again. RuntimeError where a real habana_frameworks is
    installed: the real kernels run there."""
    from mpt_kv.families import hpu_kernels

    if importlib.util.find_spec("habana_frameworks") is not None:
        raise RuntimeError("habana_frameworks kernel stand-in refused: a real habana_frameworks is installed")
    outer = hpu_kernels._scope["depth"] == 0
    saved_ops, saved = _MISSING, []
    if outer and importable:
        sys.modules.update(_modules(tuple(kernels)))
    if outer:
        hpu_kernels._scope["kernels"] = frozenset(kernels)
        if "mixture_of_experts" in kernels:
            saved_ops = torch_ops().__dict__.get("hpu", _MISSING)
            torch_ops().hpu = _HpuOps()
        for module, name, value in branches:
            saved.append((module, name, module.__dict__.get(name, _MISSING)))
            setattr(module, name, value)
    hpu_kernels._scope["depth"] += 1
    try:
        yield
    finally:
        hpu_kernels._scope["depth"] -= 1
        if outer:
            for module, name, value in reversed(saved):
                if value is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, value)
            if "mixture_of_experts" in kernels:
                if saved_ops is _MISSING:
                    del torch_ops().hpu
                else:
                    torch_ops().hpu = saved_ops
            hpu_kernels._scope["kernels"] = frozenset()
            if importable:
                remove()


def torch_ops():
    import torch

    return torch.ops


def scope_forward(model, kernels, branches=(), importable: bool = False) -> None:
    """Every forward of `model` runs inside `kernel_scope(kernels, branches, importable)` (a forward pre-hook
    enters it, a forward hook that runs also when the forward raises leaves it)."""
    scopes = []

    def enter(module, args):
        scope = kernel_scope(kernels, branches, importable)
        scope.__enter__()
        scopes.append(scope)

    def leave(module, args, output):
        scopes.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def hpu_branches(module, names) -> list:
    """[(module, name, its HPU branch)] for `kernel_scope`: each function of the port's module named
    (`hpu_kernels.hpu_branch`)."""
    from mpt_kv.families import hpu_kernels

    return [(module, name, hpu_kernels.hpu_branch(getattr(module, name))) for name in names]


def device_label(target, device: str, path: str | None = None) -> str:
    """The device a family case is labelled with in its id, the matrix and the report: `cpu+standin`
    for an optimum-habana port whose entry declares stand-in kernels (`GaudiPort.kernels`) run on CPU
    where no real habana_frameworks is installed, or whose case's path is a recipe with
    --use_flash_attention (its flash branch calls the stand-in's FusedSDPA there: `families.gaudi.recipe_kernels`;
    tests/test_recipes.py holds every such cell to having run it), else `device` itself. The rule: such a case ran the
    port's own code on this CPU with mpt-kv's stand-ins in place of HPU kernels, so it is a cpu case for
    the device gate (its device parameter is cpu; it is never an HPU case) and a row of its own where a
    reader compares results (never mixed with plain cpu cells)."""
    if device != "cpu" or importlib.util.find_spec("habana_frameworks") is not None:
        return device
    family = getattr(target, "family", None)
    if isinstance(family, str):
        from mpt_kv.families import FAMILIES

        family = FAMILIES.get(family)
    port = getattr(family, "gaudi", None)
    impl = getattr(target, "implementation", None)
    ours = impl == "optimum-habana" or (getattr(impl, "__name__", "") == "gaudi_runner" and getattr(
        impl, "__module__", "") in ("mpt_kv.families.gaudi", "mpt_kv.families.implementations"))
    if not ours or port is None:
        return device
    if port.kernels:
        return STANDIN_LABEL
    from mpt_kv import recipes

    recipe = recipes.recipe_of(path) if path else None
    return STANDIN_LABEL if recipe is not None and recipe.use_flash_attention else device
