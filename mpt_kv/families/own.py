"""A user's own model of a family, as a target: `mpt_kv.FamilyModel` (docs/targets.md, "A model of
another family").

    build = mpt_kv.FamilyModel("mistral", build_model)            # your model, your adapter
    build = mpt_kv.FamilyModel("mistral", module="mypkg.modeling_mistral", fork_of="transformers")
    build = mpt_kv.FamilyModel("gpt_neox", module="mypkg.neox_fork", fork_of="optimum-habana")

named as any target (`--target mypkg.mpt_kv_target:build`, ini `mpt_kv_targets`, or the object in
`parametrize_with_checks([build])`). Its cases are the family checks' (family-P0 ... family-memory,
mpt_kv/checks/family.py), one `FamilyTarget` per variant of the family (`targets()`), named
`<its spec>/<family>/<variant>`; the declaration is their implementation: a builder
`(family, variant, dtype, *, seed, device, **options) -> Runner` (mpt_kv.families.implementations),
whose model holds the weights of transformers' model of the variant's tiny config, which is the
oracle (`mpt_kv.families.models.build`).

Three ways to say what runs:

build=      `build_model(config, state_dict, device, dtype) -> Runner`, as an MPT target's factory:
            `config` is transformers' config of the family's tiny variant (`MistralConfig`, ...),
            `state_dict` transformers' model's weights of it; any Runner (`CallableRunner` for a
            model with its own forward, `TransformersRunner` for a transformers-style one).
module= with fork_of="transformers"
            your copy of transformers' `modeling_<family>.py`, edited (its relative imports made
            absolute, as Hub remote code writes them): its ForCausalLM class (transformers' class
            name, or `causal_lm=`) is built from the config and driven with transformers' own caches,
            as the `transformers` implementation drives transformers' model. Nothing of transformers
            is patched.
module= with fork_of="optimum-habana"
            your fork of optimum-habana's port of the family (it imports the port and overrides what it
            changes): loaded after the release's port (`mpt_kv.families.gaudi.fork_loader`) and driven
            as the `optimum-habana` implementation drives the port.

A module must run code of its own: a model built from it in which no class or function is the
module's (a module that re-exports transformers' or the port's and overrides nothing the model
reaches) is refused (`AdapterError`), since its cases would check upstream's code under your name.

Known failures (docs/targets.md, "A model of another family", and mpt_kv.findings.known): the cases
are named by the declaration, so no entry about a built-in implementation applies to them by name.
`fork_of` names the implementation whose shipped entries it inherits (for its family, the variants and
paths it runs), each a strict xfail of only the failure its pattern names; `fixes={check id: why}`
stops inheriting an entry the fork fixed (a pass of an inherited entry fails the case as XPASS,
saying so). Its own entries go in the project's known-failures file, target `<spec>/<family>/<variant>`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

import torch

from mpt_kv.errors import AdapterError, InputError, TargetBroken, TargetUnavailable
from mpt_kv.families import FAMILIES
from mpt_kv.families.base import Family
from mpt_kv.families.implementations import PATHS, gaudi_runner, limits_of, static_support
from mpt_kv.families.models import build as build_reference
from mpt_kv.targets import Capabilities, FamilyDeclaration, FamilyTarget, Runner
from mpt_kv.targets.wrappers import TransformersRunner

FORKS = tuple(PATHS)  # what a module may be a fork of: the built-in implementations


@dataclass(frozen=True, eq=False)
class FamilyModel(FamilyDeclaration):
    """A model of the family `family` (a name of `mpt_kv.families.FAMILIES`) as a target (module doc).

    build     build_model(config, state_dict, device, dtype) -> Runner (or module=, not both)
    module    the importable name of your modeling module: a copy of transformers' file
              (fork_of="transformers") or a fork of optimum-habana's port (fork_of="optimum-habana")
    fork_of   the built-in implementation your model derives from: how a module loads, and whose
              shipped known failures its cases inherit (strict); required with module=
    fixes     {family check id or property: why}: inherited entries your fork fixed ("family-P3/concat")
    variants  the family's variants your model implements (default: all of them)
    causal_lm the class of module= to build (default: the name of transformers' class of the family)
    name      how it is named (default: the spec that loads it, `package.module:attribute`)
    """

    family: str
    build: Callable | None = None
    module: str | None = None
    fork_of: str | None = None
    fixes: Mapping[str, str] = field(default_factory=dict)
    variants: tuple[str, ...] | None = None
    causal_lm: str | None = None
    name: str | None = None
    where: str | None = field(default=None, repr=False)  # the module that made it (finds its spec)

    def __post_init__(self):
        family = FAMILIES[self.family] if isinstance(self.family, str) else None  # UnknownName, naming the families
        if family is None:
            raise InputError(f"FamilyModel family={self.family!r}: give a family's name ({', '.join(FAMILIES)})")
        if (self.build is None) == (self.module is None):
            raise InputError("FamilyModel: give build= (a function building your model's Runner) or module= (your "
                             "modeling module's name), one of them")
        if self.build is not None and not callable(self.build):
            raise InputError(f"FamilyModel build={self.build!r}: expected build_model(config, state_dict, device, "
                             "dtype) -> Runner")
        if self.fork_of is not None and self.fork_of not in FORKS:
            raise InputError(f"FamilyModel fork_of={self.fork_of!r}: one of {', '.join(FORKS)}")
        if self.module is not None and self.fork_of is None:
            raise InputError(f"FamilyModel module={self.module!r}: say what it is a fork of, fork_of='transformers' "
                             "(a copy of transformers' modeling file) or 'optimum-habana' (a fork of its port)")
        if self.fixes and self.fork_of is None:
            raise InputError("FamilyModel fixes=: it names inherited known failures your fork fixed; without fork_of "
                             "nothing is inherited")
        if not isinstance(self.fixes, Mapping) or not all(isinstance(r, str) and r.strip() for r in self.fixes.values()):
            raise InputError(f"FamilyModel fixes={self.fixes!r}: a mapping check id -> why (a non-empty reason)")
        object.__setattr__(self, "fixes", types.MappingProxyType(dict(self.fixes)))
        variants = tuple(family.variants) if self.variants is None else tuple(self.variants)
        unknown = [v for v in variants if v not in family.variants]
        if not variants or unknown or isinstance(self.variants, str):
            raise InputError(f"FamilyModel variants={self.variants!r}: a non-empty list of {family.name}'s variants "
                             f"({', '.join(family.variants)})")
        object.__setattr__(self, "variants", variants)
        if self.where is None:  # the caller's module: `package.module:attribute` is found there
            frame = inspect.currentframe()
            while frame is not None and frame.f_globals.get("__name__") in (__name__, "dataclasses"):
                frame = frame.f_back
            object.__setattr__(self, "where", frame.f_globals.get("__name__") if frame is not None else None)

    # --- as a target ---------------------------------------------------------------------------------------

    def named(self, name: str | None) -> "FamilyModel":
        """This declaration named `name` (the spec that loaded it), unless it was given a name; with None,
        the spec of the attribute that holds it in the module that made it."""
        if self.name is not None:
            return self
        if name is None:
            holder = sys.modules.get(self.where or "")
            attrs = [a for a, v in vars(holder).items() if v is self] if holder is not None else []
            if not attrs:
                raise InputError(f"FamilyModel({self.family!r}, ...) made in {self.where}: no module attribute holds "
                                 "it, so it has no spec name; give it one (name='mypkg.mpt_kv_target:build')")
            name = f"{self.where}:{attrs[0]}"
        return replace(self, name=name)

    @property
    def implementation_name(self) -> str:
        return self.named(None).name

    def __str__(self) -> str:  # in a case id: its name (a print of an unnamed one must not raise)
        try:
            return self.implementation_name
        except InputError:
            return f"FamilyModel({self.family!r}, unnamed)"

    @property
    def paths(self) -> tuple[str, ...]:
        """Its cells: a fork of the port has the port's paths (static+reuse: reuse_cache); the rest
        concat and static (a path the model lacks is declared in its Runner's Capabilities)."""
        return PATHS["optimum-habana"] if self.fork_of == "optimum-habana" and self.module else PATHS["transformers"]

    def targets(self) -> list[FamilyTarget]:
        """One FamilyTarget per variant: the family checks' cases of this model (family-P0 included:
        transformers' model is its oracle)."""
        named = self.named(None)
        return [FamilyTarget(named, self.family, v, self.paths) for v in self.variants]

    # --- as an implementation (mpt_kv.families.implementations' builder protocol) ---------------------------

    def __call__(self, family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                 **options) -> Runner:
        """Its Runner of `variant` (the family checks' builder protocol)."""
        if self.fork_of == "optimum-habana" and self.module is not None:
            fork = fork_family(family, self.module)
            return owns_code(gaudi_runner(fork, variant, dtype, seed=seed, **options), self.module, self.name)
        device = torch.device(options.pop("device", "cpu"))
        if options:
            raise InputError(f"{self.name}: unknown runner options {sorted(options)} (reuse_cache is optimum-habana's)")
        reference, config = build_reference(family, variant, seed)
        if self.module is not None:
            return owns_code(self.transformers_copy(family, reference, config, dtype, device), self.module, self.name)
        try:
            runner = self.build(config, reference.state_dict(), device, dtype)
        except (InputError, TargetUnavailable, AdapterError):
            raise
        except Exception as e:  # its own error, named: an error of the case, never a finding
            raise TargetBroken(f"target {self.name} does not build {family.name}/{variant} on {device}: "
                               f"{type(e).__name__}: {e}") from e
        if not isinstance(runner, Runner):
            raise AdapterError(f"target {self.name}: build returned {type(runner).__name__}, expected a "
                               "mpt_kv.Runner (CallableRunner, TransformersRunner, ...: docs/targets.md)")
        return runner

    def transformers_copy(self, family: Family, reference, config, dtype, device) -> Runner:
        """module= with fork_of="transformers": its ForCausalLM built from the config with transformers'
        weights, eager attention, driven with transformers' caches (`TransformersRunner`)."""
        module = import_module(self.module, self.name)
        name = self.causal_lm or type(reference).__name__
        cls = getattr(module, name, None)
        if cls is None:
            raise AdapterError(f"target {self.name}: {self.module} has no {name} (give causal_lm= the class to build)")
        torch.manual_seed(0)
        model = (cls._from_config(config, attn_implementation="eager") if hasattr(cls, "_from_config")
                 else cls(config))
        model.load_state_dict(reference.state_dict(), strict=True)
        model.to(device=device, dtype=dtype).eval()
        reason = static_support(model)
        return TransformersRunner(model, device, name=self.name, cfg=limits_of(config),
                                  capabilities=Capabilities({"static": reason} if reason else {}),
                                  pad_static_mask=family.pad_static_mask)


def import_module(name: str, target: str):
    """The user's modeling module; one that does not import is the target's error (`TargetBroken`: an error
    of every case, never a skip), with how to fix a copy that kept transformers' relative imports."""
    try:
        return importlib.import_module(name)
    except Exception as e:
        relative = "relative import" in str(e)
        hint = (": a copy of transformers' file keeps its relative imports (`from ...cache_utils import`); make "
                "them absolute (`from transformers.cache_utils import`), as Hub remote code writes them") if relative \
            else " (is its folder on sys.path? `python -m pytest` from the project's folder, or PYTHONPATH)" \
            if isinstance(e, ModuleNotFoundError) else ""
        raise TargetBroken(f"target {target}: cannot import {name} ({type(e).__name__}: {e}){hint}") from e


def fork_family(family: Family, module: str) -> Family:
    """The family's entry with its port loaded from `module`, a fork of it (after the release's port)."""
    from mpt_kv.families.gaudi import fork_loader  # lazy: it loads optimum-habana's machinery

    return replace(family, gaudi=replace(family.gaudi, load=fork_loader(family.name, module)))


def owns_code(runner: Runner, module: str, target: str) -> Runner:
    """The runner, if its model runs a class or function defined in `module`; else an AdapterError: its
    checks would check upstream's code under your name (a module that re-exports and overrides nothing
    the model reaches)."""
    for sub in runner.model.modules():
        for cls in type(sub).__mro__:  # functions, not classes: the port's loader names classes it makes after the module
            for value in vars(cls).values():
                code = getattr(value, "__func__", value)
                if inspect.isfunction(code) and code.__module__ == module:
                    return runner
    raise AdapterError(f"target {target}: the model built from {module} runs no class or function of {module}: "
                       "every one it reaches is upstream's (the module re-exports and overrides nothing the model "
                       "builds through), so its checks would check upstream under your name; override the classes the "
                       "model builds (docs/families.md, \"Writing a fork of a port\")")
