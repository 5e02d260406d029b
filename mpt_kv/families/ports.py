"""optimum-habana's port module of a family, loaded on HPU or on CPU (its parent packages bare, under
the habana_frameworks stand-in where the registry's entry says so, the kernel stand-in where it declares
`GaudiPort.kernels`): below the family registry's
Family (which loads a remote-code family's config from it) and the builders of families/gaudi.py and
families/models.py, so that none of them imports another in a circle."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys

from mpt_kv.errors import PortError, TargetUnavailable
from mpt_kv.families import habana_standin
from mpt_kv.targets import gaudi as gaudi_target


def _port(family):
    if family.gaudi is None:
        why = f": {family.port_note}" if family.port_note else ""
        raise TargetUnavailable(f"mpt-kv has no optimum-habana port entry for family {family.name} (no gaudi= in "
                                f"mpt_kv/families/{family.name}.py; docs/families.md, \"optimum-habana's ports\"){why}")
    return family.gaudi


def load_port_module(family):
    """optimum-habana's module of `family`'s port, on HPU or CPU (see the module docstring)."""
    port = _port(family)
    if port.load is not None:  # a family whose loader exists already (mpt: mpt_kv.targets.gaudi)
        return port.load()
    if port.module in sys.modules:
        return sys.modules[port.module]
    root = gaudi_target.optimum_habana_root()  # TargetUnavailable "optimum-habana is not installed"
    path = gaudi_target.module_file(root, port.module)
    if not path.is_file():
        raise TargetUnavailable(f"{gaudi_target.release()} has no port of {family.name}: {path} does not exist")
    if importlib.util.find_spec("habana_frameworks") is not None:
        # an HPU stack is installed: the normal import path, and any failure is the real one
        try:
            return importlib.import_module(port.module)
        except Exception as e:
            raise PortError(f"{gaudi_target.release()} is installed with habana_frameworks, but {port.module} fails "
                            f"to import: {type(e).__name__}: {e}") from e
    gaudi_target.register_bare_parents(root, port.module)
    how = ("under the habana_frameworks kernel stand-in" if port.kernels else
           "under the habana_frameworks stand-in" if port.standin else "its parent packages bypassed")
    with contextlib.redirect_stdout(None):  # some print a line about their fused kernels at import
        try:
            if port.standin or port.kernels:
                return habana_standin.import_with_standin(port.module, kernels=port.kernels)
            return importlib.import_module(port.module)
        except Exception as e:
            raise PortError(f"{gaudi_target.release()} is installed but {port.module} fails to import on CPU ({how}, "
                            f"mpt_kv/families/gaudi.py): {type(e).__name__}: {e}") from e


def scope_kernels(model, family) -> None:
    """Every forward of `model`, a port of `family` that declares stand-in kernels (`GaudiPort.kernels`),
    inside the kernel scope (`habana_standin.scope_forward`), once; nothing where the port declares none
    or a real habana_frameworks is installed (its own kernels run). Applied where a port's model is made:
    its runner (families/gaudi.py) and a remote-code family's model, the oracle too (families/models.py)."""
    port = _port(family)
    if not port.kernels or importlib.util.find_spec("habana_frameworks") is not None \
            or getattr(model, "_mpt_kv_kernel_scope", False):
        return
    habana_standin.scope_forward(model, port.kernels,
                                 habana_standin.hpu_branches(load_port_module(family), port.hpu_branches))
    model._mpt_kv_kernel_scope = True  # a deep copy of the model keeps it (and its hooks)


def load_config_module(family):
    """The module of a remote-code family's config class (`Family.remote_config`, "<module>:<class>"):
    optimum-habana's copy of the Hub's configuration file, which imports transformers alone. It is
    imported by itself (its parent packages bare, as the port's), not through the port's modeling
    module: a port that cannot import off an HPU (`GaudiPort.needs_hpu`) still has its config, so its rows
    say why they do not run."""
    name = family.remote_config.split(":")[0]
    if name in sys.modules:
        return sys.modules[name]
    root = gaudi_target.optimum_habana_root()  # TargetUnavailable "optimum-habana is not installed"
    path = gaudi_target.module_file(root, name)
    if not path.is_file():
        raise TargetUnavailable(f"{gaudi_target.release()} has no port of {family.name}: {path} does not exist")
    if importlib.util.find_spec("habana_frameworks") is None:
        gaudi_target.register_bare_parents(root, name)
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise PortError(f"{gaudi_target.release()} is installed but {name} (the config of {family.name}) fails to "
                        f"import: {type(e).__name__}: {e}") from e
