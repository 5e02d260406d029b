"""What a family is: a decoder architecture of transformers with a KV cache, described by the
little the checks need to build it tiny and read its cache (one `Family` per module here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mpt_kv.model.cache import check_size

# Every tiny config: 2 layers, vocab 128, hidden 32-64 (the families' own names for these are
# mapped by each config's attribute_map; families whose config spells them otherwise say so).
TINY = {"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}


def legacy_kv(past) -> list[tuple]:
    """The per-layer tuples of a legacy cache (a tuple/list of [key, value] per layer): each
    layer's tensors as the cache stores them."""
    return [tuple(layer) for layer in past]


def allocate_kv_cache(model, batch: int, max_len: int, prompt_len: int) -> None:
    """What optimum-habana's generate calls with reuse_cache on, static shapes (the prompt padded
    to max_len): `allocate_kv_cache(batch * num_beams, max_len, token_idx)`."""
    model.allocate_kv_cache(batch, max_len, prompt_len)


# What optimum-habana's generate passes the llama-style ports' forward by default (its
# GaudiGenerationConfig's defaults, off an HPU): shared by the entries that read them.
GENERATE_FORWARD_KWARGS = {"lazy_mode": False, "use_flash_attention": False, "attn_softmax_bf16": False,
                           "trim_logits": False}
# Why no port but MPT's drives cache_idx buckets here.
NO_BUCKETS = {"bucket": "optimum-habana's bucket_internal pads the returned cache in generate "
                        "(_pad_past_key_values), which this driver does not do"}


def self_attn_kv_caches(model) -> list[tuple]:
    """With reuse_cache a llama-style port returns only shapes as past_key_values; its cache is
    each layer's `self_attn.k_cache` / `v_cache` KVCache buffers (models/modeling_all_models.py)."""
    return [(layer.self_attn.k_cache.cache, layer.self_attn.v_cache.cache) for layer in model.model.layers]


@dataclass(frozen=True)
class GaudiPort:
    """optimum-habana's Gaudi port of a family, as `mpt_kv.families.gaudi` loads and drives it
    on CPU (docs/families.md, "optimum-habana's ports").

    module: the port's module (`optimum.habana.transformers.models.gpt2.modeling_gpt2`);
    causal_lm: its ForCausalLM class in that module (`GaudiGPT2LMHeadModel`);
    hf_module: transformers' module its lines of `adapt_transformers_to_gaudi` write into
    (`transformers.models.gpt2.modeling_gpt2`);
    standin: whether the module needs the `habana_frameworks` stand-in to import on CPU
    (`import habana_frameworks.torch.core` at module level: mpt_kv/families/habana_standin.py);
    generation: attribute -> value set on `model.generation_config` before the first forward,
    what optimum-habana's generate sets there and the port's forward reads;
    forward_kwargs: extra keyword arguments of every forward (cached or not);
    unsupported: Capabilities feature ("static", "bucket", "extend", "crop", "reorder") -> why
    the port (or this driver of it) does not do it;
    reuse_cache: None where the port has optimum-habana's reuse_cache (`allocate_kv_cache`,
    the runner option `reuse_cache=True`), else why it has not;
    kv: the session's cache (what the port returned as past_key_values) -> one tuple per caching
    layer of the tensors as stored, (key, value) or (key_value,);
    blocks: model -> the attention modules whose `kv_cache_len` the cache_idx path sets (only
    where the port takes cache_idx);
    allocate: (model, batch, max_len, prompt_len) -> None: what optimum-habana's generate calls
    before the prefill with reuse_cache on (default: `model.allocate_kv_cache(batch, max_len,
    prompt_len)`, generation/utils.py:1641);
    reuse_kv: model -> the per-layer tuples of the preallocated cache with reuse_cache on (the
    port then returns no tensors as past_key_values; only where reuse_cache is None);
    prepare: (model) -> None: run once after the weights are loaded (optional);
    load: () -> the port's module, for a family whose loader exists already (mpt:
    `mpt_kv.targets.gaudi.load_gaudi_mpt_module`); None: `mpt_kv.families.gaudi.load_port_module`;
    state_dict: (transformers' state_dict, config) -> the same weights in the port's parameter
    layout, where a variant's port names them otherwise (llama's fused_qkv: one qkv_proj);
    None: transformers' state_dict as it is.
    """

    module: str
    causal_lm: str
    hf_module: str
    standin: bool = False
    generation: dict = field(default_factory=dict)
    forward_kwargs: dict = field(default_factory=dict)
    unsupported: dict = field(default_factory=dict)
    reuse_cache: str | None = "the port has no reuse_cache (no allocate_kv_cache)"
    kv: Callable = legacy_kv
    blocks: Callable | None = None
    allocate: Callable = allocate_kv_cache
    reuse_kv: Callable | None = None
    prepare: Callable | None = None
    load: Callable | None = None
    state_dict: Callable | None = None


@dataclass(frozen=True)
class Family:
    """A decoder architecture.

    name: the registry key; model_type: transformers' model_type (`AutoConfig.for_model`);
    variants: variant name -> config kwargs over TINY (MQA/GQA variants where the architecture has
    them); fused: the attribute name of its fused q/k/v (or k/v) projection module, None where
    q, k and v are separate; kv_heads(config): cached key/value heads per layer (MQA/GQA aware);
    head_dim(config): their head dim; layers(config): layers that cache; stored_kv_heads(config):
    the K/V heads transformers' implementation actually caches where that is more than kv_heads
    (a known excess over the analytic size, kept as data with its upstream line), else None;
    gaudi: optimum-habana's port of the family (`GaudiPort`), None where there is none."""

    name: str
    model_type: str
    variants: dict[str, dict]
    fused: str | None = None
    kv_heads: Callable = field(default=lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim: Callable = field(default=lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    layers: Callable = field(default=lambda c: c.num_hidden_layers)
    tiny: dict = field(default_factory=lambda: dict(TINY))
    stored_kv_heads: Callable | None = None
    gaudi: GaudiPort | None = None  # optimum-habana's port of this family (mpt_kv/families/gaudi.py)

    def config(self, variant: str):
        """The tiny config of one variant, built without the hub."""
        if variant not in self.variants:
            raise ValueError(f"family {self.name} has no variant {variant!r}: variants {sorted(self.variants)}")
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **{**self.tiny, **self.variants[variant]})

    def kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """Analytic cached bytes per token per sequence: K and V of every layer."""
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.cache_dims(config) * size

    def stored_kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """The bytes per token per sequence transformers' cache holds (the analytic size unless
        the family declares stored_kv_heads)."""
        if self.stored_kv_heads is None:
            return self.kv_bytes_per_token(config, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.cache_dims(config, stored=True) * size

    def cache_dims(self, config, stored: bool = False) -> int:
        """layers x K/V heads x head dim of `config`, each checked an int >= 1: an entry that
        gives 0 heads is the entry's error, not an implementation's memory failure."""
        product = 1
        heads = ("stored_kv_heads", self.stored_kv_heads) if stored else ("kv_heads", self.kv_heads)
        for name, fn in (("layers", self.layers), heads, ("head_dim", self.head_dim)):
            value = fn(config)
            check_size(f"family entry {self.name}: {name}(config)", value)
            product *= value
        return product

    def fused_modules(self, model) -> list[tuple[str, torch.nn.Module]]:
        """(qualified name, module) of every fused projection in the model, in order."""
        if self.fused is None:
            return []
        return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == self.fused]
