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
MARK = "__mpt_kv_standin__"  # set on every stand-in module: what is removed afterwards


def is_standin(module) -> bool:
    """Whether `module` is one of this stand-in's modules (never a real habana_frameworks)."""
    return bool(getattr(module, MARK, False))


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"mpt-kv's CPU stand-in for {name} (mpt_kv/families/habana_standin.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="mpt_kv.families.habana_standin",
                                                     is_package=name in PACKAGES)
    if name in PACKAGES:
        module.__path__ = []  # a package with no submodules on disk: `...hpex.kernels` is not found
    setattr(module, MARK, True)
    return module


def _mark_step(*args, **kwargs) -> None:
    """No-op: on CPU there is no lazy graph to execute."""


def _is_available() -> bool:
    return False


@contextlib.contextmanager
def standin():
    """The context in which the stand-in is importable (see the module docstring).

    RuntimeError where a real habana_frameworks is installed or already imported (the stand-in
    must never shadow it), or where another stand-in is active."""
    if any(n in sys.modules for n in MODULES):
        what = [n for n in MODULES if n in sys.modules]
        kind = "a stand-in" if all(is_standin(sys.modules[n]) for n in what) else "the real habana_frameworks"
        raise RuntimeError(f"habana_frameworks stand-in refused: {kind} is already imported ({', '.join(what)})")
    if importlib.util.find_spec("habana_frameworks") is not None:
        raise RuntimeError("habana_frameworks stand-in refused: a real habana_frameworks is installed; import the "
                           "model module the normal way (its failures are the real ones)")
    modules = {n: _module(n) for n in MODULES}
    modules["habana_frameworks"].torch = modules["habana_frameworks.torch"]
    modules["habana_frameworks.torch"].core = modules["habana_frameworks.torch.core"]
    modules["habana_frameworks.torch"].hpu = modules["habana_frameworks.torch.hpu"]
    modules["habana_frameworks.torch.core"].mark_step = _mark_step
    modules["habana_frameworks.torch.hpu"].is_available = _is_available
    sys.modules.update(modules)
    try:
        yield
    finally:
        remove()


def remove() -> list[str]:
    """Remove every stand-in entry from sys.modules (and only those); the names removed."""
    gone = [n for n, m in list(sys.modules.items())
            if (n == "habana_frameworks" or n.startswith("habana_frameworks.")) and is_standin(m)]
    for n in gone:
        del sys.modules[n]
    importlib.invalidate_caches()
    return gone


def import_with_standin(name: str):
    """`importlib.import_module(name)` with the stand-in registered for that import only."""
    with standin():
        return importlib.import_module(name)
