"""optimum-habana's Gaudi port of a family, loaded and driven on CPU: the "optimum-habana"
implementation of `mpt_kv.families.implementations` (docs/families.md, "optimum-habana's ports").

What a family's `gaudi=GaudiPort(...)` (mpt_kv/families/base.py) names is loaded the way
mpt_kv/targets/gaudi.py loads MPT, generalized:

1. `load_port_module(family)`: the port's module alone. Its parent packages are registered bare
   (their `__init__` files need an HPU stack: a Synapse version check, habana_frameworks
   imports), then the module is imported; one that imports `habana_frameworks.torch.core` at
   module level (`GaudiPort.standin`) is imported under the CPU stand-in
   (mpt_kv/families/habana_standin.py), which is gone again afterwards; one that calls HPU kernels
   with no CPU fallback (`GaudiPort.kernels`) under the kernel stand-in, its runner's every forward
   inside the kernel scope (mpt_kv/families/hpu_kernels.py; its cases `cpu+standin`). Where a real
   habana_frameworks is installed, the module is imported normally and its failure is the real one.
2. `port_patches(family, module)`: that family's lines of `adapt_transformers_to_gaudi`, parsed
   from the installed modeling_utils.py (`mpt_kv.targets.gaudi.model_patches`), applied while the
   model is built (`gaudi_classes`), undone afterwards: transformers' own classes stay untouched
   for the "transformers" implementation in the same process.
3. `build_port(family, variant, dtype, seed, device)`: `GaudiPort.causal_lm` of the tiny config
   holding the state_dict of transformers' model of that config (`mpt_kv.families.models.build`,
   fp32, eager), strict, cast to dtype and moved to device, `model.generation_config` set as
   optimum-habana's generate sets it.
4. `gaudi_runner(family, variant, dtype, *, seed, device, reuse_cache)`: a `GaudiPortRunner`, whose
   sessions drive the port as optimum-habana's generate does (`GaudiPortSession`): `past_key_values`
   None at the prefill, then what the port returned, fed back as it is (generate prepares no
   Cache object: `_prepare_cache_for_generation` returns without one when `cache_implementation`
   is None, generation/utils.py:1177); concat = no `token_idx`, static = `token_idx` and the
   port's own preallocated cache; crop through optimum-habana's own assisted crop and reorder
   through its own `_temporary_reorder_cache` (mpt_kv/targets/gaudi_generation.py), so what
   fails there fails here.

Where it cannot be built: `TargetUnavailable` "optimum-habana is not installed ..." (absent),
"<release> has no port of <family> ..." (the installed release does not ship that module, or
mpt-kv's entry of the family has no `gaudi`), "... reuse_cache ..." (asked of a port without it).
A port that is installed but fails to import or build raises `PortError` with the real
exception chained: an error, never a skip.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import sys
import types

import torch

from mpt_kv import recipes
from mpt_kv.errors import InputError, PortError, TargetUnavailable
from mpt_kv.families import habana_standin
from mpt_kv.families.base import Family
from mpt_kv.targets import Capabilities
from mpt_kv.targets import gaudi as gaudi_target
from mpt_kv.targets.gaudi_generation import pad_past_key_values
from mpt_kv.targets.wrappers import GaudiStyleSession, ModelRunner
from mpt_kv.families import FAMILIES
from mpt_kv.families.models import build as build_transformers
from mpt_kv.families.ports import _port, load_port_module, scope_kernels
from mpt_kv.model.session import check_prompt

__all__ = ["PortError", "load_port_module", "port_patches", "fork_loader", "build_port", "gaudi_runner",
           "GaudiPortRunner", "GaudiPortSession", "max_positions"]




def port_patches(family: Family, module) -> list:
    """The lines of the installed release's `adapt_transformers_to_gaudi` that write into the
    family's transformers module (`GaudiPatch`: line, name, attribute, value), in file order, each
    value looked up in `module`: the release's port module, or a fork of it (`fork_loader`),
    which must define or re-export every name those lines assign."""
    source = gaudi_target.optimum_habana_root() / "transformers" / "modeling_utils.py"
    return gaudi_target.model_patches(module, _port(family).hf_module, family.name, source)


def fork_loader(family_name: str, module_name: str):
    """`GaudiPort.load` for a fork of a port: a module of your own (importable as `module_name`)
    that imports from optimum-habana's port module and overrides what it changes. The release's
    port of `family_name` is loaded first (its parent packages bare, under the stand-in where the
    registry's entry says so), then the fork, under the stand-in too where that entry needs it.
    Where a real habana_frameworks is installed, the fork is imported normally."""
    FAMILIES[family_name]  # an unknown family: UnknownName now, naming the families, not at the first load

    def load():
        family = FAMILIES[family_name]
        load_port_module(family)
        if module_name in sys.modules:
            return sys.modules[module_name]
        try:
            port = family.gaudi
            if (port.standin or port.kernels) and importlib.util.find_spec("habana_frameworks") is None:
                return habana_standin.import_with_standin(module_name, kernels=port.kernels)
            return importlib.import_module(module_name)
        except Exception as e:
            raise PortError(f"the fork {module_name} of {gaudi_target.release()}'s {family_name} port fails to "
                            f"import: {type(e).__name__}: {e}") from e

    load.__qualname__ = f"fork_loader({family_name!r}, {module_name!r})"
    return load


def max_positions(config) -> int:
    """The longest sequence the tiny config takes: its position table, or 64 where it has none
    (ALiBi: BLOOM)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 64


def set_generation_settings(model, settings: dict) -> None:
    """What optimum-habana's generate sets on `model.generation_config` before the first forward
    and the port's forward reads there (llama: `use_fused_rope`, `reuse_cache`, ...)."""
    for name, value in settings.items():
        setattr(model.generation_config, name, value)


def build_port(family: Family, variant: str, dtype: torch.dtype = torch.float32, seed: int = 0, device="cpu"):
    """(port model, its config): the port of the tiny config with the weights of transformers'
    model of it (`mpt_kv.families.models.build(family, variant, seed)`), strict, cast to dtype, on
    device (an HPU: the real habana_frameworks, which `load_port_module` imports normally)."""
    port = _port(family)
    module = load_port_module(family)
    reference, config = build_transformers(family, variant, seed)
    cls = getattr(module, port.causal_lm, None)
    if cls is None:
        raise PortError(f"{gaudi_target.release()}: {port.module} has no {port.causal_lm} (mpt_kv/families/"
                        f"{family.name}.py names it)")
    # a remote-code family's model is the port's own class: no transformers class to patch
    patches = [] if family.remote_code else port_patches(family, module)
    try:
        with gaudi_target.gaudi_classes(module, patches):
            torch.manual_seed(seed)
            model = cls(copy.deepcopy(config) if family.remote_code else config)
        patch_instances(model, module, patches)
        weights = reference.state_dict()
        if port.state_dict is not None:  # the same weights in the port's layout (llama's fused_qkv)
            weights = port.state_dict(weights, config)
        model.load_state_dict(weights, strict=True)
    except TargetUnavailable:
        raise
    except Exception as e:
        raise PortError(f"{gaudi_target.release()}: {port.causal_lm} of {family.name}/{variant} does not build with "
                        f"transformers' weights: {type(e).__name__}: {e}") from e
    model.to(device=device, dtype=dtype).eval()
    # what from_pretrained(torch_dtype=dtype) records, and a port reads to allocate its reuse_cache buffers
    # (llama's allocate_kv_cache: `dtype = self.config.torch_dtype`, modeling_llama.py:531)
    model.config.torch_dtype = dtype
    set_generation_settings(model, port.generation)
    if port.prepare is not None:
        port.prepare(model)
    return model, config


_instance_classes: dict[tuple, type] = {}


def patch_instances(model, module, patches) -> None:
    """The attribute lines (`GPTNeoXModel.forward = gaudi_gpt_neox_model_forward`) on the built
    model's own modules. adapt_transformers_to_gaudi sets them on transformers' class in place, so
    they reach every instance of it, also one built through a name the port's module imported
    itself (`from transformers...modeling_gpt_neox import GPTNeoXModel`), which `gaudi_classes`'
    swap of the module's names does not reach. Here each module of the model whose class gets
    that attribute from transformers' class (or from nowhere: `BloomPreTrainedModel.
    _convert_to_standard_cache`) is moved to a subclass that has it; transformers' classes stay
    untouched for the "transformers" implementation."""
    hf = importlib.import_module(patches[0].hf_module) if patches else None
    for p in patches:
        if p.attribute is None:
            continue
        original = getattr(hf, p.name)
        value = getattr(module, p.value)
        for sub in model.modules():
            cls = type(sub)
            if not isinstance(sub, original):
                continue
            owner = next((k for k in cls.__mro__ if p.attribute in k.__dict__), None)
            if owner is not None and owner is not original:
                continue  # a Gaudi class defines it, or the attribute was already patched
            key = (cls, p.attribute, value)
            if key not in _instance_classes:
                _instance_classes[key] = type(cls.__name__, (cls,), {p.attribute: value, "__module__": module.__name__,
                                                                     "__qualname__": cls.__qualname__})
            sub.__class__ = _instance_classes[key]


def gaudi_runner(family: Family, variant: str, dtype: torch.dtype = torch.float32, *, seed: int = 0,
                 device="cpu", reuse_cache: bool = False, recipe: str | None = None) -> "GaudiPortRunner":
    """The "optimum-habana" implementation of `family` (mpt_kv.families.implementations) on `device`:
    reuse_cache=True is optimum-habana's reuse_cache (`allocate_kv_cache`; path "static+reuse"),
    TargetUnavailable naming why for a port without it; recipe: the name of one of optimum-habana's
    text-generation recipes (`mpt_kv.recipes.RECIPES`: its static sessions driven with that command line's
    flags, its reuse_cache included; path "<base>@<recipe>"). A port that needs an HPU
    (`GaudiPort.needs_hpu`) is TargetUnavailable on any other device, and without a real habana_frameworks."""
    port = _port(family)
    device = torch.device(device)
    if recipe is not None and recipe not in recipes.RECIPES:
        raise InputError(f"gaudi_runner: unknown recipe {recipe!r}: recipes {sorted(recipes.RECIPES)}")
    cook = recipes.RECIPES.get(recipe)
    reuse_cache = reuse_cache or bool(cook and cook.reuse_cache)
    if port.needs_hpu and (device.type != "hpu" or importlib.util.find_spec("habana_frameworks") is None):
        where = "off an HPU" if device.type != "hpu" else "without habana_frameworks"
        raise TargetUnavailable(f"{gaudi_target.release()}'s port of {family.name} ({port.causal_lm}) cannot run "
                                f"{where}: {port.needs_hpu}")
    if reuse_cache and port.reuse_cache is not None:
        raise TargetUnavailable(f"{gaudi_target.release()}'s port of {family.name} ({port.causal_lm}) has no "
                                f"reuse_cache: {port.reuse_cache}")
    if cook is None:
        model, config = build_port(family, variant, dtype, seed, device)
        return GaudiPortRunner(family, variant, model, config, reuse_cache=reuse_cache, device=device)
    kernels, branches = recipe_kernels(family, cook)
    with habana_standin.kernel_scope(kernels, branches, importable=True) if branches else contextlib.nullcontext():
        model, config = build_port(family, variant, dtype, seed, device)  # ModuleFusedSDPA(FusedSDPA) is made in __init__
    if branches:
        habana_standin.scope_forward(model, kernels, branches, importable=True)
        model._mpt_kv_kernel_scope = True  # scope_kernels: its own kernels are among these
    return GaudiPortRunner(family, variant, model, config, reuse_cache=reuse_cache, device=device, recipe=cook)


# --- recipes: optimum-habana's text-generation command lines on a port (mpt_kv/recipes.py) ----------------------

def recipe_kernels(family: Family, recipe) -> tuple[tuple, list]:
    """(kernels, branches) for a recipe's cells on a port off an HPU: a recipe with --use_flash_attention
    on a port whose module imported no FusedSDPA here (a try/except import under the loading stand-in:
    None) runs its flash branch with the kernel stand-in's FusedSDPA (`hpu_kernels.fused_sdpa`, Habana's
    documented semantics), set as that module's names for the model's build and each forward (with
    `sdp_kernel` and `SDPContext` where the module imports them at module level: falcon,
    models/falcon/modeling_falcon.py:21-26; the others import `habana_frameworks.torch.hpu` in the forward)
    (`habana_standin.kernel_scope`); its cells are `cpu+standin` (`habana_standin.device_label`). ((), [])
    where nothing is stood in: no flash, a real habana_frameworks (the real kernel runs), or a port whose
    module has its FusedSDPA already (a kernel stand-in port: its own scope)."""
    if not recipe.use_flash_attention or importlib.util.find_spec("habana_frameworks") is not None:
        return (), []
    from mpt_kv.families import hpu_kernels

    module = load_port_module(family)
    port = _port(family)
    fused = getattr(module, "FusedSDPA", None)
    # the module's own kernel, or the stand-in its port declares (scoped by its own forward): nothing to add. The
    # stand-in alone, where the port declares none, came from another port's stand-in import of this module (mixtral's
    # port imports llama's): kept there, it is called outside any scope unless this recipe's scope opens
    if fused is not None and (fused is not hpu_kernels.FusedSDPA or "FusedSDPA" in port.kernels):
        return (), []
    branches = [(module, "FusedSDPA", hpu_kernels.FusedSDPA)]
    if "SDPContext" in vars(module):  # its try/except import of sdp_kernel failed here: as it succeeds on an HPU
        branches += [(module, "sdp_kernel", hpu_kernels.sdp_kernel), (module, "SDPContext", True)]
    branches += habana_standin.hpu_branches(module, port.hpu_branches)
    return tuple(dict.fromkeys(tuple(port.kernels) + ("FusedSDPA",))), branches



def takes(model, name: str) -> bool:
    """Whether the model's forward names the keyword `name` (a **kwargs catch-all does not count:
    every port has one, and a keyword it swallows is a keyword it ignores)."""
    return name in inspect.signature(model.forward).parameters


def batch_positions(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Each row's positions, a tensor of its own (as generate's `position_ids`, made from the
    mask's cumsum): XGLM's sinusoidal embedding adds its offset into them in place (transformers
    4.55.4 models/xglm/modeling_xglm.py, `position_ids += self.offset`), which an expanded view
    refuses."""
    return positions.unsqueeze(0).repeat(batch, 1)


class GaudiPortSession(GaudiStyleSession):
    """`GaudiStyleSession` for a family's port: the same token_idx protocol, plus what each
    forward of optimum-habana's generate carries for this port:

    - `position_ids` and `cache_position` (where the forward names them): the slot of each
      token (prefill 0..S-1, step t at t), which is what transformers' forward makes itself
      without them, so the uncached logits (none passed) are the same function; without them a
      port's static path counts its positions from the preallocated cache's length, and a port
      with reuse_cache reads a torch.Size as a tensor (phi: modeling_phi.py:377);
    - the port's `forward_kwargs`, and `reuse_cache=True` with the runner option;
    - the cache as the port returned it (`kv()` reads it through `GaudiPort.kv`)."""

    def __init__(self, runner: "GaudiPortRunner", path, max_len, bucket=None):
        super().__init__(runner, path, max_len, bucket)
        self.port = runner.port
        self.reuse = runner.reuse_cache and path == "static"
        self.started = False  # the prefill ran (with reuse_cache the port returns no tensors)
        # a recipe's flags (mpt_kv/recipes.py): its static session is the recipe's; its concat session gets
        # the flags that do not need static shapes (generate with static_shapes off: no reuse_cache, no buckets)
        self.recipe = runner.recipe
        self.padded = False  # bucket_internal: generate padded the prefill's cache, and keeps it from then on
        self.valid_lengths = None

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.path == "concat":
            token_idx = None
        start = self.written if self.started else 0
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        extra = dict(self.port.forward_kwargs)
        if self.runner.takes("position_ids"):  # BLOOM (ALiBi) takes none: its generate passes none
            extra["position_ids"] = batch_positions(positions, input_ids.shape[0])
        if self.runner.takes("cache_position"):  # generate always passes one (_get_initial_cache_position)
            extra["cache_position"] = positions
        if token_idx is not None:
            extra["token_idx"] = token_idx
        if self.runner.takes("first_token"):
            # generate's own flag: True until the first step's outputs come back (generation/utils.py:622,
            # _update_model_kwargs_for_generation), passed by the port's prepare_inputs_for_generation
            # (deepseek_v2: its prefill and decode attentions differ, modeling_deepseek_v2.py:1432-1452)
            extra["first_token"] = not self.started
        recipe = self.recipe
        if recipe is not None:
            extra.update(recipe.forward_kwargs(self.runner.takes))
        static_recipe = recipe is not None and self.path == "static"
        if (self.reuse or (static_recipe and recipe.prefill_prompt_only)) and not self.started:
            # generate with reuse_cache (or bucket_internal): the prefill feeds only the prompt and its mask
            # (prepare_inputs_for_generation: `input_ids[:, :token_idx]`), after allocate_kv_cache with reuse_cache
            prompt_len = int(token_idx.reshape(-1)[0])
            input_ids, mask = input_ids[:, :prompt_len], mask[:, :prompt_len]
            for name in ("position_ids", "cache_position"):
                if name in extra:
                    extra[name] = extra[name][..., :prompt_len]
            if self.reuse:
                self.port.allocate(self.runner.model, input_ids.shape[0], self.max_len, prompt_len)
        if self.reuse:
            extra["reuse_cache"] = True
        if recipe is not None and recipe.flash_attention_causal_mask and self.runner.takes("valid_sequence_lengths"):
            if self.valid_lengths is None:  # each row's unpadded prompt length (run_generation.py:827-832)
                self.valid_lengths = mask.sum(-1, dtype=torch.int32)
            extra["valid_sequence_lengths"] = self.valid_lengths
        if static_recipe and recipe.bucket is not None:
            if recipe.pads_returned_cache and self.runner.takes("kv_cache_len"):
                extra["kv_cache_len"] = self.max_len  # prepare_inputs_for_generation passes it then (llama :1574-1576)
            if self.started and self.runner.takes("cache_idx"):
                cache_idx = recipe.cache_idx(int(token_idx.reshape(-1)[0]), self.max_len)
        if cache_idx is not None:
            if not self.started and self.port.blocks is not None:
                for block in self.runner.blocks():
                    block.kv_cache_len = self.max_len  # what prepare_inputs_for_generation sets
            extra["cache_idx"] = cache_idx
        out = self.runner.model(input_ids, attention_mask=mask, past_key_values=self.past, use_cache=True, **extra)
        if not self.padded:  # generate keeps its padded cache and ignores what the decode returns (shapes)
            self.past = out.past_key_values
        if static_recipe and recipe.pads_returned_cache and not self.started:
            self._pad(input_ids.shape[1])
        self.started = True
        return out.logits

    def _pad(self, fed: int) -> None:
        """generate's padding of the prefill's cache with bucket_internal (`pad_past_key_values`: its own
        `_pad_past_key_values`), where it pads: the returned K/V as long as the tokens fed (MQA: dim 1) and
        more than one token to generate (generation/utils.py:2953-2979)."""
        mqa = self.family_mqa()
        first = self.past[0] if mqa else self.past[0][0]
        if first.shape[1 if mqa else 2] == fed and self.max_len - fed > 1:
            self.past = pad_past_key_values(self.runner.model, self.past, self.max_len, self.max_len - fed, mqa)
        self.padded = True

    def family_mqa(self) -> bool:
        """generate's MQA test for the padding (`self.config.model_type == "gpt_bigcode" and multi_query`)."""
        config = self.runner.model.config
        return config.model_type == "gpt_bigcode" and bool(getattr(config, "multi_query", False))

    def _reorder_cache(self, index):
        """As optimum-habana's `_beam_search` (generation/utils.py:3460-3465): with reuse_cache on,
        the port's own `reorder_kv_cache(beam_idx)`; else its `_temporary_reorder_cache`."""
        if self.reuse:
            self.past = self.runner.model.reorder_kv_cache(index)
        else:
            super()._reorder_cache(index)

    def kv(self):
        if self.reuse:
            return self.port.reuse_kv(self.runner.model)
        return self.port.kv(self.past)


class GaudiPortRunner(ModelRunner):
    """One family's optimum-habana port on CPU (see the module docstring). Capabilities: the
    port's declared `unsupported`, plus "static" where its forward has no `token_idx` and
    "bucket" where it has no `cache_idx` or the entry gives no `blocks`."""

    def __init__(self, family: Family, variant: str, model, config, *, reuse_cache: bool = False, device=None,
                 recipe=None):
        self.family, self.variant, self.port, self.reuse_cache = family, variant, family.gaudi, reuse_cache
        self.recipe = recipe  # a mpt_kv.recipes.Recipe, or None
        detected = {}
        name = type(model).__name__
        if not takes(model, "token_idx"):
            detected["static"] = f"{name}.forward has no token_idx parameter (optimum-habana's static path)"
        if not takes(model, "cache_idx"):
            detected["bucket"] = f"{name}.forward has no cache_idx parameter (optimum-habana's bucketed cache)"
        elif self.port.blocks is None:
            detected["bucket"] = (f"{name}.forward takes cache_idx, but mpt_kv/families/{family.name}.py gives no "
                                  "GaudiPort.blocks (the attention modules whose kv_cache_len generate sets)")
        scope_kernels(model, family)  # its HPU kernels by mpt-kv's CPU stand-ins, inside every forward only
        limits = types.SimpleNamespace(max_seq_len=max_positions(config), vocab_size=config.vocab_size)
        super().__init__(model, device, name=f"optimum-habana/{family.name}", cfg=limits,
                         capabilities=Capabilities(dict(self.port.unsupported)), detected=detected)
        self.version = gaudi_target.release()
        if reuse_cache:  # static sessions reuse the preallocated cache; a concat session is the plain one
            self.capabilities = Capabilities(self.capabilities.unsupported, cache_pool=True)
        if recipe is not None:
            dropped = recipe.dropped(self.takes)
            if len(dropped) == len(recipe.flags) - recipe.limit_hpu_graphs - (recipe.bucket_size > 0):
                raise TargetUnavailable(f"{self.version}'s port of {family.name} ({name}) drops every flag of the recipe "
                                        f"{recipe.name} ({recipe.describe()}): its forward names none of them, so its "
                                        "cells would be the plain path's")
            self.recipe_dropped = dropped

    def logits(self, input_ids, attention_mask):
        check_prompt(input_ids, attention_mask, self.vocab_size, self.max_seq_len)
        extra = dict(self.port.forward_kwargs)
        if self.takes("position_ids"):
            # each token's slot, as the sessions pass: transformers' forward makes these itself,
            # while a port may count them from the mask instead (gpt_bigcode,
            # models/gpt_bigcode/modeling_gpt_bigcode.py:569-572): another function on padded rows
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            extra["position_ids"] = batch_positions(positions, input_ids.shape[0])
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=False, **extra).logits
        self.sync()
        return out

    def takes(self, name: str) -> bool:
        """Whether the port's forward names the keyword `name` (see `takes`)."""
        return takes(self.model, name)

    def blocks(self):
        return self.port.blocks(self.model)

    def fused_modules(self):
        return self.family.fused_modules(self.model)

    def session(self, path, max_len, bucket=None):
        self.require(path, "bucket" if bucket else None)
        return GaudiPortSession(self, path, max_len, bucket)
