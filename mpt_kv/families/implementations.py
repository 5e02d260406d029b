"""The implementations of a family the family checks run on: each a builder
`(family, variant, dtype=torch.float32, *, seed=0, device="cpu", **options) -> mpt_kv.targets.Runner`
whose model holds the state_dict of `mpt_kv.families.models.build(family, variant, seed)[0]`
(transformers' model of the tiny config, fp32, eager attention), cast to dtype and moved to device,
and whose sessions wait for the device's queued work after each call (`mpt_kv.devices.sync`: HPU's
`mark_step` in lazy mode).

transformers     transformers' own model, driven by `TransformersRunner`: concat = DynamicCache,
                 static = StaticCache where the installed transformers supports it for the family
                 (5.x: every family here; 4.x: where the model class's `_can_compile_fullgraph`
                 lets generate use one), crop and reorder through transformers' `Cache.crop` /
                 `reorder_cache`; built with one of transformers' attention implementations (its
                 attention axis, `ATTENTION`: the runner option `attention`, default eager).
optimum-habana   optimum-habana's Gaudi port of the family (`mpt_kv.families.gaudi`): on an HPU with
                 the real habana_frameworks, elsewhere on CPU.

Which run where: transformers' models are plain torch and run on every device the suite knows (cpu,
cuda, hpu: transformers has no HPU code of its own, and its eager attention is matmuls and a
softmax); optimum-habana's ports run on HPU and, most of them, elsewhere too (their HPU kernels are
imported in try/except with a plain-torch fallback beside each, as MPT's port runs on CPU and CUDA);
a port whose forward calls an HPU kernel with no fallback (`GaudiPort.needs_hpu`) runs on an HPU
only, and is unavailable with that reason on any other device.

A builder raises `TargetUnavailable(reason)` where it cannot be built here (the package is not
installed, the installed release has no port of the family); anything else it raises is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from mpt_kv.errors import InputError, Registry, TargetUnavailable
from mpt_kv.families.base import Family
from mpt_kv.versions import BUILTIN, transformers_major, transformers_version, with_attention
from mpt_kv.targets import Capabilities, FamilyDeclaration, FamilyTarget, Runner
from mpt_kv.families.models import build
from mpt_kv.targets.wrappers import TransformersRunner
from mpt_kv.families import variants
from mpt_kv.recipes import recipes_of

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


@dataclass(frozen=True)
class Attention:
    """One of transformers' attention implementations, the `attn_implementation` a model is built with
    (transformers' ALL_ATTENTION_FUNCTIONS, or eager: the attention written out in the model file).

    supports: the model class's attribute transformers itself reads to accept it
    (modeling_utils.py `get_correct_attn_implementation` and the `_*_can_dispatch` it calls): False
    there, transformers refuses the implementation for that class (None: every class has it);
    runs_on: the device kinds its cases are generated for; elsewhere: why not on the others (measured)."""

    name: str
    supports: str | None
    runs_on: tuple[str, ...] = ("cpu", "cuda", "hpu")
    elsewhere: str = ""


# transformers' attention axis, in the matrix's order: sdpa first, what `from_pretrained` picks for every
# class that supports it (modeling_utils.py `get_correct_attn_implementation`: None -> "sdpa", and "eager"
# where the class has no `_supports_sdpa`), then eager, the oracle's (ORACLE_ATTENTION)
ATTENTION = {a.name: a for a in (
    Attention("sdpa", "_supports_sdpa"),
    Attention("eager", None),
    # transformers runs flex_attention through torch.compile (integrations/flex_attention.py,
    # WrappedFlexAttention: 5.24.0 line 90, 4.55.4 line 79), whatever the device: on CPU inductor
    # compiles C++ for every new shape
    Attention("flex_attention", "_supports_flex_attn", ("cuda",),
              "transformers runs flex_attention through torch.compile (integrations/flex_attention.py): on CPU with "
              "torch 2.13.0 a tiny llama's first cached step failed to compile, after minutes (5.24.0: the decode "
              "step's C++; 4.55.4: the prefill's return_lse; docs/families.md)"),
    Attention("flash_attention_2", "_supports_flash_attn", ("cuda",),
              "flash_attention_2 runs on CUDA only: transformers refuses it without the flash_attn package and, "
              "with it, for a model on CPU with no GPU (modeling_utils.py `_flash_attn_can_dispatch`)"),
)}
ORACLE_ATTENTION = "eager"  # the oracle's: the attention written out in each model file, every family has it


def attention_support(model_class, attention: str) -> str | None:
    """None where the installed transformers accepts `attention` for the model class, else why not,
    read from transformers itself (the class's `_supports_sdpa`, `_supports_flex_attn`, ...)."""
    flag = ATTENTION[attention].supports
    if flag is None or getattr(model_class, flag, False):
        return None
    default = ("; from_pretrained falls back to eager for it" if attention == "sdpa" else "")
    return (f"transformers {transformers_version()}: {model_class.__name__}.{flag} is False: its attention is not "
            f"{attention}{default} (modeling_utils.py get_correct_attn_implementation)")


def generated_attention(kinds=("cpu",)) -> list[str]:
    """The attention implementations whose family targets are generated for cases on `kinds`, in
    ATTENTION's order (the family cases run on cpu)."""
    return [name for name, a in ATTENTION.items() if any(k in a.runs_on for k in kinds)]


def users_attention(family: str, variant: str, kinds=("cpu",)) -> str:
    """The attention implementation `from_pretrained` gives the family's model class, of those generated on
    `kinds`: the first of ATTENTION's order the class supports (sdpa where it has it, else eager). The
    generate cells run this one: generate as users run it."""
    from transformers import AutoModelForCausalLM

    from mpt_kv.families import FAMILIES

    config = FAMILIES[family].config(variant)
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    return next(a for a in generated_attention(kinds) if attention_support(model_class, a) is None)


def attention_left_out(kinds=("cpu",)) -> dict[str, str]:
    """{transformers[<attention>]: why} for the attention implementations no family target is generated
    for on `kinds` (the run's summary line says so)."""
    return {with_attention("transformers", name): a.elsewhere for name, a in ATTENTION.items()
            if name not in generated_attention(kinds)}


def check_options(who: str, options: dict, known: tuple[str, ...], why: str) -> None:
    """An implementation's runner options: one not in `known` is an InputError naming it and the known ones."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"{who}: unknown options {unknown}; it takes {list(known) or 'none'} ({why})")


def transformers_runner(family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                        device="cpu", **options) -> Runner:
    """transformers' implementation of the family (module doc), on `device`; option `attention`: one of
    ATTENTION (default eager), TargetUnavailable where the model class does not support it."""
    check_options("transformers_runner", options, ("attention",), "reuse_cache is optimum-habana's")
    attention = options.get("attention", ORACLE_ATTENTION)
    if attention not in ATTENTION:
        raise InputError(f"transformers_runner: unknown attention {attention!r}; transformers' attention "
                         f"implementations here: {list(ATTENTION)}")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise TargetUnavailable(f"transformers is not installed ({e})") from e

    if family.remote_code:
        raise TargetUnavailable(f"transformers ships no {family.name} model: the architecture is Hub remote code "
                                f"({family.remote_code}); optimum-habana's port is its model and oracle")
    model, config = build(family, variant, seed)
    reason = attention_support(type(model), attention)
    if reason:
        raise TargetUnavailable(reason)
    if attention != ORACLE_ATTENTION:
        model, config = build(family, variant, seed, attention=attention)
    model.to(device=device, dtype=dtype)
    unsupported = {}
    reason = static_support(model)
    if reason:
        unsupported["static"] = reason
    return TransformersRunner(model, device, capabilities=Capabilities(unsupported), cfg=limits_of(config),
                              pad_static_mask=family.pad_static_mask)


def installed(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def gaudi_runner(family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                 device="cpu", **options) -> Runner:
    """optimum-habana's Gaudi port of the family on `device` (`mpt_kv.families.gaudi.gaudi_runner`).
    Not installed: TargetUnavailable. Installed, but mpt-kv's loader of its ports does not
    import: that ImportError, an error (never a skip: the run has optimum-habana)."""
    check_options("gaudi_runner", options, ("reuse_cache", "recipe"),
                  "optimum-habana's reuse_cache and text-generation recipes")  # before the install check
    if not installed("optimum-habana"):
        raise TargetUnavailable("optimum-habana is not installed")
    from mpt_kv.families.gaudi import gaudi_runner as build_port  # noqa: I001  (lazy: fam-gaudi's module)

    return build_port(family, variant, dtype, seed=seed, device=device, **options)


IMPLEMENTATIONS = Registry("implementation", {"transformers": transformers_runner, "optimum-habana": gaudi_runner})
# the cache paths each implementation has (the family matrix's rows): static+reuse is optimum-habana's
# reuse_cache on the static path
PATHS = {"transformers": ("concat", "static"), "optimum-habana": ("concat", "static", "static+reuse")}


def family_targets(implementations=tuple(IMPLEMENTATIONS)) -> list[FamilyTarget]:
    """Every variant of every family of the registry on each built-in implementation, with its paths;
    transformers once per attention implementation generated here (`generated_attention`: sdpa, then
    eager, the oracle's: transformers with eager attention is family-P0's oracle, no P0 cell of its
    own; another attention implementation's P0 cell compares it with eager), and a remote-code
    family's port is its own oracle (transformers has no model of it, nor an attention axis). A user's
    family declaration among them (`mpt_kv.FamilyModel`) gives its own targets."""
    from mpt_kv.families import FAMILIES

    def targets(impl, family, variant):
        remote = bool(FAMILIES[family].remote_code)
        if impl != "transformers" or remote:  # a remote-code family's oracle is the port's own uncached forward
            return [FamilyTarget(impl, family, variant, PATHS[impl] + recipe_paths(impl, family, variant),
                                 oracle=impl == "transformers" or remote)]
        return [FamilyTarget(impl, family, variant, PATHS[impl], oracle=attention == ORACLE_ATTENTION,
                             attention=attention) for attention in generated_attention()]

    return [target for impl in implementations for target in (
        impl.targets() if isinstance(impl, FamilyDeclaration) else
        [t for family, variant in variants() for t in targets(impl, family, variant)])]


def recipe_paths(implementation: str, family: str, variant: str) -> tuple[str, ...]:
    """The recipe paths of a port (mpt_kv/recipes.py: the recipes optimum-habana documents for its family), on
    the one variant each recipe names (the documented models' attention layout; docs/cost.md: a recipe's
    flags change the attention's branch, not the layout a variant changes)."""
    if implementation != "optimum-habana":
        return ()
    return tuple(r.path for r in recipes_of(family, variant))
# the distribution whose absence makes an implementation's cases skip (the package map: mpt_kv.versions)
PACKAGES = {name: BUILTIN[name].requires[0] for name in IMPLEMENTATIONS}
