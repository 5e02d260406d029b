"""Targets: the implementations the properties run against, all with the same weights.

A target is a factory `build(cfg, state_dict, device, dtype) -> Runner`. Built-in targets:
`reference`, `transformers`, `optimum-habana`. A user's own is named
`package.module:factory` (pytest `--target`, the ini option `mpt_kv_targets`), or passed as
the factory itself to the Python API (`mpt_kv.parametrize_with_checks`). A target that cannot
be imported raises `TargetUnavailable` with the reason. docs/targets.md documents the API;
`mpt_kv.targets.wrappers` has ready-made runners for the common model shapes.

A spec is resolved once, where it enters (a check's call, the pytest plugin's `target` fixture),
into a `ResolvedTarget` (`resolve_target`): its name, its factory and what it declares. That
object is what travels; `target_name`, `resolve` and `build` accept it as they accept a spec.

The same spec may name a model of another decoder family instead of an MPT factory: a
`FamilyDeclaration` (`mpt_kv.FamilyModel`, mpt_kv/families/own.py), which `resolve_target` returns
named by the spec; its cases are `FamilyTarget`s, one per variant of its family, that the family
checks run (docs/targets.md, "A model of another family").
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import nn

from mpt_kv import versions
from mpt_kv.devices import as_device
from mpt_kv.model.config import ModelConfig, as_dtype, check_state_dict, random_state_dict
from mpt_kv.errors import AdapterError, DeviceUnavailable, InputError, TargetBroken, TargetUnavailable, Unsupported
from mpt_kv.model.session import Session

PATHS = ("concat", "static")

# What a target may declare it does not implement, and what that means. A case that needs one
# is skipped with the target's reason (`Unsupported`); cases that do not need it still run.
FEATURES = {
    "concat": "the concat (torch.cat) cache path",
    "static": "the static (preallocated, index_copy_) cache path",
    "bucket": "cache_idx buckets on the static path",
    "clip_qkv": "clip_qkv: mixed_qkv clamped to [-clip_qkv, clip_qkv] before the split",
    "fp32": "float32 weights and activations",
    "bf16": "bfloat16 weights and activations",
    "cpu": "the cpu device",
    "cuda": "the cuda device",
    "hpu": "the hpu (Gaudi) device",
    "extend": "Session.extend: k tokens per row in one cached call (assisted decoding, chunked prefill)",
    "crop": "Session.crop: keep the first n positions (assisted decoding after rejected candidates)",
    "reorder": "Session.reorder: rows taken from a (B,) index, repeats allowed (beam search)",
}


@dataclass(frozen=True)
class Capabilities:
    """What a target implements, declared instead of found by reading its code.

    unsupported    feature (a key of FEATURES) -> the target's reason it does not implement it
    graph_outputs  its forward returns buffers that a later call overwrites, as HPU graphs and
                   CUDA graphs do (a replay returns the graph's static output); the suite copies
                   every result at once either way, and the output-reuse check then passes
    cache_pool     it keeps its cache allocation across generations on purpose (optimum-habana's
                   reuse_cache): memory is then judged by growth over repeated generations
    host_syncs     "path/file.py:function" -> why: where a static decode step may read a device
                   value on the host (.item(), int(t), bool(t), .tolist(), .cpu()); the
                   static-shape check fails every other one (checks/static_shape.py)
    """

    unsupported: Mapping[str, str] = field(default_factory=dict)
    graph_outputs: bool = False
    cache_pool: bool = False
    host_syncs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.unsupported, Mapping):
            raise TypeError(f"Capabilities.unsupported={self.unsupported!r} ({type(self.unsupported).__name__}): "
                            "give a mapping feature -> reason, e.g. Capabilities({'bf16': 'our kernels are fp32 "
                            f"only'}}); features: {sorted(FEATURES)}")
        for name in ("graph_outputs", "cache_pool"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # "no" would be truthy: a declaration must be True or False
                raise TypeError(f"Capabilities.{name}={value!r} ({type(value).__name__}): must be True or False")
        unknown = sorted(set(self.unsupported) - set(FEATURES))
        if unknown:
            raise ValueError(f"Capabilities.unsupported: unknown features {unknown}; known: {sorted(FEATURES)}")
        for feature, reason in self.unsupported.items():
            if not isinstance(reason, str) or not reason.strip():
                raise ValueError(f"Capabilities.unsupported[{feature!r}]: give the reason as a non-empty string")
        object.__setattr__(self, "unsupported", MappingProxyType(dict(self.unsupported)))
        check_host_syncs(self.host_syncs)
        object.__setattr__(self, "host_syncs", MappingProxyType(dict(self.host_syncs)))

    def reason(self, feature: str | None) -> str | None:
        """Why `feature` is not implemented, or None if it is (None: nothing needed)."""
        if feature is None:
            return None
        if feature not in FEATURES:  # a session's path reaches here first (Runner.require)
            raise InputError(f"unknown cache path or feature {feature!r}: the cache paths are {', '.join(PATHS)}; "
                             f"the features {', '.join(FEATURES)}")
        return self.unsupported.get(feature)


HOST_SYNC_EXAMPLE = ("Capabilities(host_syncs={'mypkg/sampler.py:Sampler.stop_early': 'reads the stop flag "
                     "once per step, by design'})")


def check_host_syncs(host_syncs) -> None:
    """Each key names ONE function: "path.py:function", the path matched as the end of the
    syncing frame's file at a '/' (so "model.py:f" is any model.py's f), the function by its
    qualified name ("Attention.forward"). Narrow on purpose: a new host sync elsewhere still fails."""
    if not isinstance(host_syncs, Mapping):
        raise TypeError(f"Capabilities.host_syncs={host_syncs!r} ({type(host_syncs).__name__}): give a mapping "
                        f"'path.py:function' -> reason, e.g. {HOST_SYNC_EXAMPLE}")
    for where, reason in host_syncs.items():
        path, _, func = where.rpartition(":") if isinstance(where, str) else ("", "", "")
        if not (path.endswith(".py") and path.strip("/") == path and " " not in path
                and all(part.isidentifier() or (part[:1], part[-1:]) == ("<", ">") for part in func.split("."))):
            raise ValueError(f"Capabilities.host_syncs key {where!r}: expected 'path.py:function' (a file, or the end "
                             f"of its path, and the name of the function that syncs), e.g. {HOST_SYNC_EXAMPLE}")
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"Capabilities.host_syncs[{where!r}]: give the reason as a non-empty string")


class Runner:
    """One loaded model of one target on one device and dtype (docs/targets.md).

    A subclass gives `model` (the nn.Module: the memory checks count its weights, the aliasing
    check hooks its `*Wqkv` modules), `logits` (an uncached full forward), `session` (one
    generation: `mpt_kv.model.session.Session`) and, if it lacks something, `capabilities`.
    `mpt_kv.targets.wrappers` has runners for optimum-habana-style models, transformers-style
    models with Cache objects, and models built from the reference's pieces."""

    name: str
    model: nn.Module
    capabilities: Capabilities = Capabilities()

    @property
    def unsupported(self) -> Mapping[str, str]:
        return self.capabilities.unsupported

    def require(self, *features: str | None) -> None:
        """Raise `Unsupported` with the target's reason if it lacks one of `features` (None: skipped)."""
        for feature in features:
            reason = self.capabilities.reason(feature)
            if reason is not None:
                raise Unsupported(f"{getattr(self, 'name', type(self).__name__)}: {reason}")

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Uncached full forward: (B, T) -> (B, T, V)."""
        raise NotImplementedError

    def session(self, path: str, max_len: int, bucket: int | None = None) -> Session:
        raise NotImplementedError

    def wqkv_modules(self) -> list[nn.Module]:
        """Each layer's fused projection, in layer order: the aliasing check hooks its output."""
        mods = [m for name, m in self.model.named_modules() if name.endswith("Wqkv")]
        if not mods:
            raise TargetUnavailable(f"{self.name}: no module named '*Wqkv' to hook; override wqkv_modules()")
        return mods


Factory = Callable[[ModelConfig, dict, torch.device, torch.dtype], Runner]
Target = "str | Factory | ResolvedTarget"  # a spec ('reference', 'package.module:factory'), the factory, or resolved
# the tiny model a target's capabilities are read from (the plugin's `target` fixture builds it too)
PROBE = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)

# the Capabilities feature of each dtype (mpt_kv.model.config.DTYPES names)
DTYPE_FEATURES = {torch.float32: "fp32", torch.bfloat16: "bf16"}

BUILTIN = {name: builtin.factory for name, builtin in versions.BUILTIN.items()}  # the package map: mpt_kv.versions


@dataclass(frozen=True)
class FamilyTarget:
    """A target of the family checks (docs/families.md): one implementation of one variant of another
    decoder family, checked against transformers' own model of the same weights.

    implementation  "transformers", "optimum-habana" (mpt_kv.families.implementations), or a builder
                    `(family, variant, dtype, *, seed, **options) -> Runner` (a fork's `gaudi_runner`)
    family          a family's name or its `mpt_kv.families.Family` (a fork: a copy of the entry)
    variant         one of the family's variants ("mha", "gqa", "alibi", ...)
    paths           the cache paths the implementation has (the family checks' cells: index paths)
    oracle          the implementation is transformers itself, family-P0's oracle (no P0 cell)
    attention       transformers' attention implementation the model is built with ("sdpa", "eager",
                    ...: `mpt_kv.families.implementations.ATTENTION`, the implementation's attention
                    axis); None: the builder's own (eager for transformers)

    Named "<implementation>/<family>/<variant>" in test ids, the matrix and known failures, the
    implementation with its attention as "transformers[sdpa]" (`versions.with_attention`); a spec
    string of that form resolves to one (`family_target`)."""

    implementation: object
    family: object
    variant: str
    paths: tuple[str, ...] = ("concat", "static")
    oracle: bool = False
    attention: str | None = None

    @property
    def implementation_name(self) -> str:
        impl = self.implementation
        return impl if isinstance(impl, str) else (getattr(impl, "implementation_name", None)
                                                  or getattr(impl, "__name__", "custom"))

    @property
    def family_name(self) -> str:
        return self.family if isinstance(self.family, str) else self.family.name

    @property
    def implementation_label(self) -> str:
        """The implementation as named: 'transformers[sdpa]' (with its attention), 'optimum-habana'."""
        return versions.with_attention(self.implementation_name, self.attention)

    @property
    def name(self) -> str:
        return f"{self.implementation_label}/{self.family_name}/{self.variant}"


class FamilyDeclaration:
    """What a spec names when it names a model of another decoder family instead of an MPT factory:
    `mpt_kv.FamilyModel` (mpt_kv/families/own.py) is the one kind. `resolve_target` returns it named by
    the spec that loaded it (`named`); the family checks run its `targets()`, one `FamilyTarget` per
    variant, with the declaration itself as their implementation (a builder `(family, variant, dtype, *,
    seed, **options) -> Runner`)."""

    name: str | None = None

    def named(self, name: str) -> "FamilyDeclaration":
        """This declaration under `name` (the spec that loaded it), unless it names itself."""
        raise NotImplementedError

    def targets(self) -> list[FamilyTarget]:
        raise NotImplementedError


def family_target(target) -> FamilyTarget:
    """A FamilyTarget; its spec "<implementation>/<family>/<variant>", where the implementation is a
    built-in one's name (checked where the family checks build it) or the spec of a family declaration
    ("mypkg.mpt_kv_target:build/mistral/gqa"); or a family declaration of one variant. Anything else is
    an InputError naming the forms."""
    if isinstance(target, FamilyTarget):
        return target
    if isinstance(target, FamilyDeclaration):
        found = target.targets()
        if len(found) != 1:
            raise InputError(f"family target {target.name} runs {len(found)} variants ("
                             f"{', '.join(t.variant for t in found)}): give one of its targets() or "
                             f"'{target.name}/<family>/<variant>'")
        return found[0]
    parts = target.split("/") if isinstance(target, str) else []
    if len(parts) != 3 or not all(parts):
        raise InputError(f"a family check's target is a FamilyTarget or '<implementation>/<family>/<variant>' "
                         f"(e.g. 'transformers/gpt2/mha', 'mypkg.mpt_kv_target:build/mistral/gqa'), not {target!r}")
    if ":" not in parts[0]:
        implementation, attention = versions.split_attention(parts[0])
        return FamilyTarget(implementation, *parts[1:], attention=attention)
    declared = resolve_target(parts[0])
    if not isinstance(declared, FamilyDeclaration):
        raise InputError(f"{target!r}: {parts[0]} is an MPT target's factory, not a family declaration "
                         "(mpt_kv.FamilyModel): the family checks cannot run it")
    found = [t for t in declared.targets() if (t.family_name, t.variant) == tuple(parts[1:])]
    if not found:
        raise InputError(f"{target!r}: {declared.name} runs "
                         f"{', '.join(f'{t.family_name}/{t.variant}' for t in declared.targets())}, not "
                         f"{parts[1]}/{parts[2]}")
    return found[0]


def target_name(target: Target) -> str:
    """How a target is named in test ids, messages, known failures and reports: the spec as
    given, or `module:qualname` for a factory passed as a callable (the spec that would load it)."""
    if isinstance(target, (ResolvedTarget, FamilyTarget)):
        return target.name
    if isinstance(target, FamilyDeclaration):
        return target.named(None).name  # its own name, or the spec that loads it
    if isinstance(target, str):
        return target
    if not callable(target):
        raise TypeError(f"a target is a spec string or a factory callable, not {type(target).__name__}")
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if name and getattr(sys.modules.get(module), name, None) is target:
        return f"{module}:{name}"  # what `package.module:factory` would load
    qualname = getattr(target, "__qualname__", None) or name or type(target).__name__
    return f"{module}:{name if '<locals>' in qualname and name else qualname}"  # a made factory: its own name


def required_features(path: str | None = None, bucket: int | None = None, dtype: torch.dtype | None = None,
                      device=None, clip_qkv: float | None = None, operations=()) -> list[str]:
    """The Capabilities features a case needs: its cache path, buckets, dtype, device kind, clip_qkv,
    and the Session operations it calls ("extend", "crop", "reorder")."""
    out = [path] if path else []
    out += list(operations)
    if bucket:
        out.append("bucket")
    if dtype is not None:
        out.append(DTYPE_FEATURES.get(dtype, str(dtype)))
    if device is not None:
        out.append(torch.device(device).type)
    if clip_qkv:
        out.append("clip_qkv")
    return [f for f in out if f in FEATURES]


@dataclass(frozen=True)
class ResolvedTarget:
    """A target resolved once (`resolve_target`): what checks and the plugin pass on.

    name     how it is named in test ids, messages, known failures and reports (`target_name`)
    factory  build(cfg, state_dict, device, dtype) -> Runner
    spec     as it was given: a spec string or the factory itself
    """

    name: str
    factory: Factory
    spec: object = field(compare=False, repr=False)

    def build(self, cfg: ModelConfig, state_dict: dict, device, dtype) -> Runner:
        """One runner of this target; a factory that returns something else is a TypeError naming it."""
        check_state_dict(cfg, state_dict)  # once here, for every target: a mismatch names the key and the config
        device, dtype = as_device(device), as_dtype(dtype)
        try:
            runner = self.factory(cfg, state_dict, device, dtype)
        except (InputError, TargetUnavailable, DeviceUnavailable, Unsupported, AdapterError):
            raise  # mpt-kv's own: they already say what is wrong (or why it is skipped)
        except Exception as e:  # one message for every caller (checks, plugin, CLIs), the factory's error named
            raise TargetBroken(f"target {self.name} does not build on {device}: {type(e).__name__}: {e}") from e
        if not isinstance(runner, Runner):
            raise TypeError(f"target {self.name}: the factory returned {type(runner).__name__}, expected a "
                            "mpt_kv.targets.Runner (see docs/targets.md; mpt_kv.targets.wrappers has ready-made ones)")
        runner.name = getattr(runner, "name", None) or self.name
        return runner

    def capabilities(self, device, dtype: torch.dtype) -> Capabilities:
        """What it declares, read from a tiny runner (`PROBE`) built once per device and dtype."""
        device, dtype = str(as_device(device)), as_dtype(dtype)
        try:
            return _declared(self, device, dtype)
        except TypeError as e:  # an unhashable factory (a callable object): read it without the cache
            if "unhashable" not in str(e):
                raise
            return self.build(PROBE, random_state_dict(PROBE), device, dtype).capabilities


@functools.lru_cache(maxsize=64)
def _declared(target: ResolvedTarget, device: str, dtype: torch.dtype) -> Capabilities:
    return target.build(PROBE, random_state_dict(PROBE), device, dtype).capabilities


def resolve_target(target: Target) -> "ResolvedTarget | FamilyDeclaration":
    """A built-in name, `package.module:factory`, a factory (or a ResolvedTarget, returned as it is)
    -> the ResolvedTarget; a spec (or object) that is a family declaration -> that declaration, named
    by the spec. TargetUnavailable if a spec does not load, TypeError if it is no callable."""
    if isinstance(target, ResolvedTarget):
        return target
    name = target_name(target)  # TypeError for anything that is neither a string nor callable
    factory = target if not isinstance(target, str) else _load(target)
    if isinstance(factory, FamilyDeclaration):  # `--target mypkg.module:build` naming a model of another family
        return factory.named(name)
    check_factory(name, factory)
    return ResolvedTarget(name, factory, target)


def is_family_declaration(target) -> bool:
    """Whether a resolved target is a family declaration (its cases are the family checks')."""
    return isinstance(target, FamilyDeclaration)


def factory_error(e: BaseException) -> BaseException:
    """The factory's own exception where `build` wrapped it in a TargetBroken (what a one-line
    report names after "does not build on <device>: "), else `e`."""
    return e.__cause__ if isinstance(e, TargetBroken) and e.__cause__ is not None else e


def check_factory(name: str, factory) -> None:
    """A factory takes (cfg, state_dict, device, dtype): one that cannot is a TypeError naming its
    signature now, not a TypeError from deep inside the first check that builds it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: its call will tell
        return
    try:
        signature.bind(PROBE, {}, torch.device("cpu"), torch.float32)
    except TypeError as e:
        raise TypeError(f"target {name}: the factory {getattr(factory, '__qualname__', factory)!r}{signature} cannot be "
                        f"called as build(cfg, state_dict, device, dtype) ({e})") from None


def _load(spec: str) -> Factory:
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise TargetUnavailable(
            f"target {spec!r} is neither built in ({', '.join(BUILTIN)}) nor 'package.module:factory'")
    module_name, attr = path.split(":", 1)
    if not module_name or not attr:
        raise TargetUnavailable(f"target {spec!r}: expected 'package.module:factory', both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetUnavailable(f"target {spec!r}: cannot import {module_name} ({e}){_sys_path_hint(module_name, e)}") \
            from e
    except Exception as e:  # a SyntaxError, or the module raising as it runs: the same "does not load", its error named
        raise TargetUnavailable(f"target {spec!r}: importing {module_name} raised {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if factory is None:
        raise TargetUnavailable(f"target {spec!r}: {module_name} has no {attr!r}")
    if not callable(factory):
        raise TargetUnavailable(f"target {spec!r}: {module_name}.{attr} is a {type(factory).__name__}, not a "
                                "factory build(cfg, state_dict, device, dtype) nor a family declaration "
                                "(mpt_kv.FamilyModel)")
    return factory


def _sys_path_hint(module_name: str, error: ImportError) -> str:
    """How to put a target's own module on sys.path, where that module itself (not one it
    imports) was not found: the `pytest` command does not add the current folder."""
    top = module_name.split(".")[0]
    if not isinstance(error, ModuleNotFoundError) or error.name not in (top, module_name):
        return ""
    here = [p for p in (f"{top}.py", top) if os.path.exists(p)]
    where = f"{here[0]} is in the current folder, but the `pytest` command does not put that folder on sys.path" \
        if here else f"{top} is not on sys.path"
    return (f". {where}: run `python -m pytest ...` from the folder that holds it (python -m puts the current "
            "folder on sys.path), or set PYTHONPATH (e.g. PYTHONPATH=src), or pytest's `pythonpath` ini option")


def resolve_mpt(spec: Target) -> ResolvedTarget:
    """`resolve_target` of a spec that must be an MPT target: a family declaration is an InputError
    naming where its cases run."""
    resolved = resolve_target(spec)
    if isinstance(resolved, FamilyDeclaration):
        raise InputError(f"target {resolved.name} is a model of another family ({', '.join(sorted({t.family_name for t in resolved.targets()}))}), "
                         "not an MPT factory: the family checks run it (mpt_kv.conformance.test_families, "
                         "parametrize_with_checks([it]), or a family check id such as CHECKS['family-P1/concat'])")
    return resolved


def resolve(spec: Target) -> Factory:
    """A built-in name, `package.module:factory` or a factory -> the factory (TargetUnavailable if not)."""
    return resolve_mpt(spec).factory


def build(spec: Target, cfg: ModelConfig, state_dict: dict, device, dtype) -> Runner:
    """A runner of `spec` (a spec, a factory or a ResolvedTarget: resolve once and pass that on)."""
    return resolve_mpt(spec).build(cfg, state_dict, device, dtype)
