"""optimum-habana's `GaudiMptForCausalLM`, in its concat path (no `token_idx`) and its static
`token_idx` path (with and without `cache_idx` buckets).

On a Gaudi machine it is imported normally and `adapt_transformers_to_gaudi()` swaps the
classes. Elsewhere `import optimum.habana` fails (its `__init__` checks the Synapse version
and its models package imports habana_frameworks), but the MPT module itself guards its one
HPU import and runs on CPU: `load_gaudi_mpt_module` registers the parent packages as bare
namespace modules so their `__init__` never runs, then imports just that module (measured on 1.21.2).

Public API (docs/targets.md): `load_gaudi_mpt_module()` returns optimum-habana's MPT module,
on CPU too (TargetUnavailable with the reason where it cannot); `gaudi_classes(module)` is the
context in which `module.GaudiMptForCausalLM(config)` builds Gaudi blocks. A fork of
optimum-habana installed in its place loads the same way. `GaudiStyleRunner` (defined in
`mpt_kv.targets.wrappers`, imported here too) drives any model with the same forward signature.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

from mpt_kv.errors import TargetUnavailable
from mpt_kv.targets.wrappers import GaudiStyleRunner, GaudiStyleSession  # noqa: F401  (public here too)

__all__ = ["load_gaudi_mpt_module", "gaudi_classes", "GaudiStyleRunner", "GaudiStyleSession", "build"]

MPT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"


def load_gaudi_mpt_module():
    """optimum-habana's MPT module (GaudiMptForCausalLM), on HPU or CPU.

    TargetUnavailable says why not. Only "optimum-habana is not installed" means the package is
    absent; every other message is a package that is installed but does not load, which the
    plugin reports as an error, never as a skip. Where habana_frameworks imports, the module is
    imported normally, and its failure is reported as it is (it is not "needs HPU")."""
    if MPT_MODULE in sys.modules:
        return sys.modules[MPT_MODULE]
    spec = importlib.util.find_spec("optimum")
    root = next((Path(p) / "habana" for p in (spec.submodule_search_locations or []) if (Path(p) / "habana").is_dir()),
                None) if spec else None
    if root is None:
        raise TargetUnavailable("optimum-habana is not installed (pip install --no-deps optimum-habana, "
                                "or tox -e ohabana)")
    if importlib.util.find_spec("habana_frameworks") is not None:
        # an HPU stack is installed: the normal import path, and any failure is the real one
        try:
            import habana_frameworks.torch  # noqa: F401
        except Exception as e:
            raise TargetUnavailable(f"habana_frameworks is installed but does not import ({type(e).__name__}: {e}), "
                                    f"so {MPT_MODULE} cannot be loaded either") from e
        try:
            return importlib.import_module(MPT_MODULE)
        except Exception as e:
            raise TargetUnavailable(f"optimum-habana is installed and habana_frameworks imports, but {MPT_MODULE} "
                                    f"fails to import: {type(e).__name__}: {e}") from e
    # CPU: its package __init__ files need HPU (a Synapse version check, habana_frameworks imports); the MPT module itself does not
    for name, folder in [("optimum.habana", root), ("optimum.habana.transformers", root / "transformers"),
                         ("optimum.habana.transformers.models", root / "transformers" / "models"),
                         ("optimum.habana.transformers.models.mpt", root / "transformers" / "models" / "mpt")]:
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(folder)]
            sys.modules[name] = pkg
    with contextlib.redirect_stdout(None):  # it prints one line about FusedSDPA at import
        try:
            return importlib.import_module(MPT_MODULE)
        except Exception as e:
            raise TargetUnavailable(f"optimum-habana is installed but {MPT_MODULE} fails to import on CPU (its parent "
                                    f"packages bypassed, see mpt_kv/targets/gaudi.py): {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def gaudi_classes(module):
    """Swap transformers' MPT classes for the Gaudi ones while constructing, as
    `adapt_transformers_to_gaudi` does, so the inherited __init__ builds Gaudi blocks."""
    import transformers.models.mpt.modeling_mpt as hf

    names = {"MptModel": module.GaudiMptModel, "MptBlock": module.GaudiMptBlock, "MptAttention": module.GaudiMptAttention}
    saved = {n: getattr(hf, n) for n in names}
    try:
        for n, cls in names.items():
            setattr(hf, n, cls)
        yield
    finally:
        for n, cls in saved.items():
            setattr(hf, n, cls)


def build(cfg, state_dict, device, dtype):
    module = load_gaudi_mpt_module()
    with gaudi_classes(module):
        model = module.GaudiMptForCausalLM(cfg.to_hf())
    model.load_state_dict(state_dict, strict=True)
    model.to(device=device, dtype=dtype).eval()
    return GaudiStyleRunner(model, device)
