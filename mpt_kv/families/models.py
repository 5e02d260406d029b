"""transformers' model of a family variant's tiny config: built once per process (keyed by the config
itself, never by a name) and copied for each caller, so the oracle and every implementation of a
variant hold the same weights; and the cached tensors of a transformers cache, named.

    model, config = build(family, variant, seed)    # fp32, eager attention, seeded weights
    model, config = build(family, variant, seed, attention="sdpa")  # the same weights, sdpa attention
"""

from __future__ import annotations

import copy

import torch

from mpt_kv.families import FAMILIES
from mpt_kv.families.base import Family


def family_of(name) -> Family:
    if isinstance(name, Family):
        return name
    return FAMILIES[name]  # an unknown name: UnknownName, naming the families


def build(family: Family, variant: str, seed: int = 0, attention: str = "eager"):
    """transformers' model of a tiny config, random weights (seeded), eager attention (a fully
    padded query row gives uniform weights there, not the NaN of an all -inf softmax), or another of
    transformers' attention implementations (`attn_implementation`, which sets
    `config._attn_implementation`: "sdpa", ...) with the eager model's weights; for a remote-code
    family (`Family.remote_code`), the port's own model class (seeded)."""
    from transformers import AutoModelForCausalLM

    config = family_of(family).config(variant)
    key = (config_key(config), seed) + ((attention,) if attention != "eager" else ())
    if key in _built:  # copies of the model and config built once per process: the same weights, its own modules
        model, built_config = _built[key]
        return copy.deepcopy(model), copy.deepcopy(built_config)
    if attention != "eager":  # the eager model's weights, under the attention implementation asked for
        eager, config = build(family, variant, seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        model.load_state_dict(eager.state_dict())
        if model.config._attn_implementation != attention:  # fail closed: never an eager model under sdpa's name
            raise RuntimeError(f"{type(model).__name__} built with attn_implementation={attention!r} runs "
                               f"{model.config._attn_implementation!r}")
        _built[key] = (model.to(torch.float32).eval(), model.config)
        return copy.deepcopy(model), copy.deepcopy(model.config)
    torch.manual_seed(seed)
    if family_of(family).remote_code:  # the port's own model: transformers has none
        from mpt_kv.families.ports import load_port_module

        port = family_of(family).gaudi
        # a copy: transformers' PreTrainedModel takes the legacy `gradient_checkpointing` off the config
        # it is given, which the remote code reads (Baichuan: modeling_baichuan.py:929), so the port's
        # runner could not build a second model from the same config
        model = getattr(load_port_module(family_of(family)), port.causal_lm)(copy.deepcopy(config))
        # remote code leaves some parameters as torch.empty for a checkpoint to fill (Baichuan's
        # RMSNorm weight, modeling_baichuan.py:169, which its _init_weights does not reach): whatever
        # memory held, NaN included. A tiny random model's 1-D weights (the norms') are set to 1 and
        # its 1-D biases to 0, as their own init does elsewhere: the same model in every process
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
        from mpt_kv.families.ports import scope_kernels

        scope_kernels(model, family_of(family))  # a port run through the kernel stand-in (minicpm's FusedSDPA)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # no dtype: 4.x does not take it
    # the config as from_config left it (its attention implementation set: "eager"), for every later call too: a
    # port built from a fresh one picked transformers' default (sdpa in 4.55) in every case of its family but the
    # first of a process, so what the ports ran depended on xdist's order of the cases
    _built[key] = (model.to(torch.float32).eval(), config)
    return copy.deepcopy(model), copy.deepcopy(config)


def config_key(config) -> str:
    """What a transformers model built from `config` is: the config itself (its JSON, model_type
    included), never the family's name, which a Family copy with other variants or tiny settings
    shares."""
    return config.to_json_string(use_diff=False)


# (config, seed) -> (transformers' model, its config), per process (build copies them)
_built: dict = {}


def cached_kv(past) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, "key"/"value", tensor) of every cached tensor of a transformers cache, as it stores
    them: a 5.x Cache's `layers[i].keys/.values`, a 4.x DynamicCache's `key_cache/value_cache`,
    legacy tuples (a layer's single tensor, as GPT-BigCode's fused key_value in 4.x, is named
    "key_value")."""
    if hasattr(past, "layers"):
        pairs = [(layer.keys, layer.values) for layer in past.layers]
    elif hasattr(past, "key_cache"):
        pairs = list(zip(past.key_cache, past.value_cache))
    elif isinstance(past, (tuple, list)):
        pairs = [tuple(p) if isinstance(p, (tuple, list)) else (p,) for p in past]
    else:
        raise TypeError(f"unknown cache type {type(past).__name__}: expected a transformers Cache or legacy tuples")
    return named_kv(pairs)


def named_kv(pairs) -> list[tuple[int, str, torch.Tensor]]:
    """`Session.kv()`'s per-layer tuples -> (layer, "key"/"value"/"key_value", tensor)."""
    out = []
    for layer, pair in enumerate(pairs):
        pair = tuple(pair) if isinstance(pair, (tuple, list)) else (pair,)
        if len(pair) not in (1, 2):
            raise TypeError(f"kv() layer {layer}: {len(pair)} tensors, expected (key, value) or (key_value,)")
        names = ("key", "value") if len(pair) == 2 else ("key_value",)
        out += [(layer, n, t) for n, t in zip(names, pair) if t is not None]
    return out
