"""optimum-habana's `GaudiMptForCausalLM`, in its concat path (no `token_idx`) and its static
`token_idx` path (with and without `cache_idx` buckets).

On a Gaudi machine it is imported normally and `adapt_transformers_to_gaudi()` swaps the
classes. Elsewhere `import optimum.habana` fails (its `__init__` checks the Synapse version
and its models package imports habana_frameworks), but the MPT module itself guards its one
HPU import and runs on CPU: `load_gaudi_mpt_module` registers the parent packages as bare
namespace modules so their `__init__` never runs, then imports just that module (FACTS.md).

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
    if MPT_MODULE in sys.modules:
        return sys.modules[MPT_MODULE]
    spec = importlib.util.find_spec("optimum")
    if spec is None or not spec.submodule_search_locations:
        raise TargetUnavailable("optimum-habana is not installed (tox -e ohabana installs it)")
    root = next((Path(p) / "habana" for p in spec.submodule_search_locations if (Path(p) / "habana").is_dir()), None)
    if root is None:
        raise TargetUnavailable("optimum is installed but optimum-habana is not (tox -e ohabana installs it)")
    try:  # on a Gaudi machine the package imports normally
        import habana_frameworks.torch  # noqa: F401

        return importlib.import_module(MPT_MODULE)
    except ImportError:
        pass
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
            raise TargetUnavailable(f"cannot import {MPT_MODULE} without HPU: {type(e).__name__}: {e}") from e


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
