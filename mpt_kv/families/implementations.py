"""The implementations of a family the family checks run on: each a builder
`(family, variant, dtype=torch.float32, *, seed=0, **options) -> mpt_kv.targets.Runner` whose
model holds the state_dict of `mpt_kv.families.models.build(family, variant, seed)[0]`
(transformers' model of the tiny config, fp32, eager attention), cast to dtype.

transformers     transformers' own model, driven by `TransformersRunner`: concat = DynamicCache,
                 static = StaticCache where the installed transformers supports it for the family
                 (5.x: every family here; 4.x: where the model class's `_can_compile_fullgraph`
                 lets generate use one), crop and reorder through transformers' `Cache.crop` /
                 `reorder_cache`.
optimum-habana   optimum-habana's Gaudi port of the family on CPU (`mpt_kv.families.gaudi`).

A builder raises `TargetUnavailable(reason)` where it cannot be built here (the package is not
installed, the installed release has no port of the family); anything else it raises is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from mpt_kv.errors import InputError, Registry, TargetUnavailable
from mpt_kv.families.base import Family
from mpt_kv.versions import BUILTIN, transformers_major, transformers_version
from mpt_kv.targets import Capabilities, FamilyTarget, Runner
from mpt_kv.families.models import build
from mpt_kv.targets.wrappers import TransformersRunner
from mpt_kv.families import variants

# A tiny config's limit on positions, where the family has none (ALiBi: BLOOM): far past what the
# checks write (a prompt of 6-8 and a few steps)
UNLIMITED_POSITIONS = 2048
POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class Limits:
    """What a runner needs of the config, under one name for every family (their configs name
    them max_position_embeddings, n_positions, max_seq_len, or have none)."""

    max_seq_len: int
    vocab_size: int


def limits_of(config) -> Limits:
    for name in POSITION_LIMITS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return Limits(value, int(config.vocab_size))
    return Limits(UNLIMITED_POSITIONS, int(config.vocab_size))


def static_support(model) -> str | None:
    """None where the installed transformers supports a StaticCache for this model class, else the
    reason: 4.x generate refuses cache_implementation='static' where the class's
    `_can_compile_fullgraph` is False (4.55.4 generation/utils.py:2046); 5.x has no such gate."""
    if transformers_major() < 5 and not getattr(type(model), "_can_compile_fullgraph", False):
        return (f"transformers {transformers_version()}: {type(model).__name__}._can_compile_fullgraph is False: "
                "generate refuses cache_implementation='static' for it")
    return None


def check_options(who: str, options: dict, known: tuple[str, ...], why: str) -> None:
    """An implementation's runner options: one not in `known` is an InputError naming it and the known ones."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"{who}: unknown options {unknown}; it takes {list(known) or 'none'} ({why})")


def transformers_runner(family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                        **options) -> Runner:
    """transformers' implementation of the family (module doc)."""
    check_options("transformers_runner", options, (), "reuse_cache is optimum-habana's")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise TargetUnavailable(f"transformers is not installed ({e})") from e

    if family.remote_code:
        raise TargetUnavailable(f"transformers ships no {family.name} model: the architecture is Hub remote code "
                                f"({family.remote_code}); optimum-habana's port is its model and oracle")
    model, config = build(family, variant, seed)
    model.to(dtype)
    unsupported = {}
    reason = static_support(model)
    if reason:
        unsupported["static"] = reason
    return TransformersRunner(model, capabilities=Capabilities(unsupported), cfg=limits_of(config),
                              pad_static_mask=family.pad_static_mask)


def installed(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def gaudi_runner(family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                 **options) -> Runner:
    """optimum-habana's Gaudi port of the family on CPU (`mpt_kv.families.gaudi.gaudi_runner`).
    Not installed: TargetUnavailable. Installed, but mpt-kv's loader of its ports does not
    import: that ImportError, an error (never a skip: the run has optimum-habana)."""
    check_options("gaudi_runner", options, ("reuse_cache",), "optimum-habana's reuse_cache")  # before the install check
    if not installed("optimum-habana"):
        raise TargetUnavailable("optimum-habana is not installed")
    from mpt_kv.families.gaudi import gaudi_runner as build_port  # noqa: I001  (lazy: fam-gaudi's module)

    return build_port(family, variant, dtype, seed=seed, **options)


IMPLEMENTATIONS = Registry("implementation", {"transformers": transformers_runner, "optimum-habana": gaudi_runner})
# the cache paths each implementation has (the family matrix's rows): static+reuse is optimum-habana's
# reuse_cache on the static path
PATHS = {"transformers": ("concat", "static"), "optimum-habana": ("concat", "static", "static+reuse")}


def family_targets(implementations=tuple(IMPLEMENTATIONS)) -> list[FamilyTarget]:
    """Every variant of every family of the registry on each implementation, with its paths;
    transformers is family-P0's oracle (no P0 cell of its own), and a remote-code family's port
    is its own."""
    from mpt_kv.families import FAMILIES

    # a remote-code family's oracle is the port's own uncached forward: no P0 cell for it either
    return [FamilyTarget(impl, family, variant, PATHS[impl],
                         oracle=impl == "transformers" or bool(FAMILIES[family].remote_code))
            for impl in implementations for family, variant in variants()]
# the distribution whose absence makes an implementation's cases skip (the package map: mpt_kv.versions)
PACKAGES = {name: BUILTIN[name].requires[0] for name in IMPLEMENTATIONS}
