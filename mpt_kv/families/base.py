"""What a family is: a decoder architecture of transformers with a KV cache, described by the
little the checks need to build it tiny and read its cache (one `Family` per module here).
"""

from __future__ import annotations

import logging
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


def per_layer(values: list) -> str:
    """A per-layer quantity in a message: the one value every layer has, or the list."""
    return str(values[0]) if len(set(values)) == 1 else str(values)


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
    `mpt_kv.targets.gaudi.load_gaudi_mpt_module`); None: `mpt_kv.families.ports.load_port_module`;
    state_dict: (transformers' state_dict, config) -> the same weights in the port's parameter
    layout, where a variant's port names them otherwise (llama's fused_qkv: one qkv_proj);
    None: transformers' state_dict as it is;
    needs_hpu: why the port cannot run off an HPU (an HPU kernel its forward calls with no CPU
    fallback and no stand-in), with its upstream line; without a real habana_frameworks the runner is
    then `TargetUnavailable` with that reason (on a Gaudi machine it runs). None: it runs on CPU;
    kernels: the HPU kernels the port calls on CPU with no CPU fallback, by their names in
    `mpt_kv.families.habana_standin.KERNELS` ("mixture_of_experts", "FusedSDPA", ...), with the
    upstream lines in a comment: off an HPU the port is imported under the kernel stand-in and every
    forward runs inside its scope (mpt_kv/families/hpu_kernels.py: the kernels by their documented
    semantics), and its cases are labelled `cpu+standin`; () (the default): none;
    hpu_branches: names of functions of the port's module whose CPU branch cannot run (each with its
    upstream line in a comment): while the port's forward runs under the kernel stand-in, each is its
    own code with its device test answered as on an HPU (`habana_standin.hpu_branch`), its kernels the
    stand-in's; () (the default): none.
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
    needs_hpu: str | None = None
    kernels: tuple = ()
    hpu_branches: tuple = ()

    def __post_init__(self):
        from mpt_kv.families.habana_standin import KERNELS

        unknown = [k for k in self.kernels if k not in KERNELS]
        if unknown or isinstance(self.kernels, str):
            raise ValueError(f"GaudiPort({self.module}): kernels {self.kernels!r}: a tuple of the stand-in's kernels "
                             f"{sorted(KERNELS)}")


@dataclass(frozen=True)
class Family:
    """A decoder architecture.

    name: the registry key; model_type: transformers' model_type (`AutoConfig.for_model`);
    variants: variant name -> config kwargs over TINY (MQA/GQA variants where the architecture has
    them); fused: the attribute name of its fused q/k/v (or k/v) projection module, None where
    q, k and v are separate; kv_heads(config): cached key/value heads per layer (MQA/GQA aware), one
    int for every layer or a list with each layer's (decilm: a different number per layer);
    head_dim(config): their head dim; layers(config): layers that cache; stored_kv_heads(config):
    the K/V heads transformers' implementation actually caches where that is more than kv_heads
    (a known excess over the analytic size, kept as data with its upstream line), else None;
    gaudi: optimum-habana's port of the family (`GaudiPort`), None where there is none;
    windows(config): each caching layer's sliding window (None: a global layer), where the
    architecture has local layers (gemma2/3, gpt_oss: hybrid; mistral: every layer); such a layer
    holds at most the window (`layer_tokens`), and its oracle is the uncached forward with the
    window's mask (transformers' own); latent_width(config): the elements per token one layer
    caches where it caches a compressed latent instead of K and V (multi-head latent attention,
    deepseek_v2/v3: kv_lora_rank + qk_rope_head_dim), else None; design: the cache design in a
    word, for the matrix and docs ("full", "window", "hybrid", "latent", with "+moe", "+sinks" ...);
    remote_code: where transformers ships the architecture only as Hub remote code, which Hub
    files it is (the port's own modeling file is then the model, and its uncached forward the
    oracle: there is no "transformers" implementation); remote_config: the port's config class
    there, "<module>:<class>" (its tiny config is built from it, not from AutoConfig); pad_static_mask: whether
    transformers' runner passes the 2D mask padded to the cache length on the static path (as
    Bloom's generate does), False where the model derives positions from the mask (OPT's
    cumsum: a padded mask is a shape error, and generate passes the written part); stored_windows(config):
    only where transformers' cache keeps more of a local layer than its window (gpt_neo's local
    layers cache the whole history: a known excess, kept as data like stored_kv_heads); a function
    may return None where the installed transformers keeps the windows; stored_width(config):
    likewise the elements per token per layer transformers caches where it is not `layer_widths`'
    (transformers 4.x's DeepSeek caches the expanded K and V, not the latent; a remote-code family: what its
    remote code caches, MiniCPM3's expanded K and V), or None; port_note:
    where `gaudi` is None although optimum-habana ships a port, why mpt-kv does not drive it yet
    (the matrix's reason)."""

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
    windows: Callable | None = None
    latent_width: Callable | None = None
    design: str = "full"
    remote_code: str | None = None
    remote_config: str | None = None
    pad_static_mask: bool = True
    stored_windows: Callable | None = None
    stored_width: Callable | None = None
    port_note: str | None = None

    def config(self, variant: str):
        """The tiny config of one variant, built without the hub."""
        if variant not in self.variants:
            raise ValueError(f"family {self.name} has no variant {variant!r}: variants {sorted(self.variants)}")
        if self.remote_config is not None:  # the port's own config class (optimum-habana's copy of the Hub files)
            from mpt_kv.families.ports import load_config_module

            name = self.remote_config.split(":")[1]
            return getattr(load_config_module(self), name)(**{**self.tiny, **self.variants[variant]})
        from transformers import AutoConfig

        # transformers 5.x warns that a tiny vocabulary does not hold the Hub configs' special token ids (GPT-2's
        # 50256, Phi-3's 32000); no check reads them (the generate drive passes its own eos), and the warning,
        # printed at collection, was noise at the top of every run
        log = logging.getLogger("transformers.configuration_utils")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return AutoConfig.for_model(self.model_type, **{**self.tiny, **self.variants[variant]})
        finally:
            log.setLevel(level)

    def layer_windows(self, config, stored: bool = False) -> list:
        """Each caching layer's window (None: global), checked: a window is an int >= 2 (stored:
        the windows transformers' cache keeps, `stored_windows`, where the entry declares them)."""
        layers = self.layers(config)
        windows = self.stored_windows(config) if stored and self.stored_windows is not None else None
        if windows is None:
            windows = [None] * layers if self.windows is None else list(self.windows(config))
        if len(windows) != layers:
            raise ValueError(f"family entry {self.name}: windows(config) gives {len(windows)} layers, layers(config) "
                             f"{layers}")
        for w in windows:
            if w is not None:
                check_size(f"family entry {self.name}: a window of windows(config)", w - 1)
        return windows

    def layer_tokens(self, config, written: int, static_len: int | None = None, stored: bool = False,
                     recorded_from: int | None = None) -> list[int]:
        """The positions per row each caching layer holds after `written` tokens: a global layer all
        of them (static: the cache length); a local layer of window w the w - 1 latest on the concat
        path (the next query attends to itself and w - 1 before it: what transformers' 5.x
        DynamicSlidingWindowLayer keeps, cache_utils.py:244-247) and min(cache length, w) slots on
        the static path (StaticSlidingWindowLayer's buffer, cache_utils.py:540).

        `recorded_from`: the window's rule for what may stay while a cache keeps its past for a crop
        (assisted decoding: from its first k-token call, and from each crop on; None: it keeps none).
        A local layer may then hold its w - 1 positions before that point and every position written
        since, min(recorded_from, w - 1) + written - recorded_from, which a crop back to n restricts to
        min(n, w - 1) again (transformers 5.24's DynamicSlidingWindowLayer after activate_past_recording:
        update keeps the whole past, cache_utils.py:252; crop keeps the w - 1 before the cropped
        positions, :281-310; measured on gemma2's w = 4 layer: 6 positions after a 3-token call, 7 after a
        decode, 3 after a crop back 2, 4 after the next decode). That is the most it may hold: a window
        that keeps only its w - 1 (recorded_from None) is the other end of the range the family checks
        accept (`mpt_kv.checks.family_storage.analytic_range`)."""
        out = []
        for w in self.layer_windows(config, stored):
            if static_len is not None:
                out.append(static_len if w is None else min(static_len, w))
            elif w is None:
                out.append(written)
            elif recorded_from is None:
                out.append(min(written, w - 1))
            else:
                out.append(min(recorded_from, w - 1) + written - recorded_from)
        return out

    def layer_kv_heads(self, config, stored: bool = False) -> list[int]:
        """Each caching layer's K/V heads, checked ints >= 1: `kv_heads(config)` (stored: the entry's
        `stored_kv_heads` where it declares them) is one int for every layer, or a list with one per
        layer (decilm's num_key_value_heads_per_layer)."""
        fn, name = ((self.stored_kv_heads, "stored_kv_heads") if stored and self.stored_kv_heads is not None
                    else (self.kv_heads, "kv_heads"))
        layers = check_size(f"family entry {self.name}: layers(config)", self.layers(config))
        heads = fn(config)
        heads = list(heads) if isinstance(heads, (list, tuple)) else [heads] * layers
        if len(heads) != layers:
            raise ValueError(f"family entry {self.name}: {name}(config) gives {len(heads)} layers, layers(config) "
                             f"{layers}")
        return [check_size(f"family entry {self.name}: {name}(config)", h) for h in heads]

    def layer_widths(self, config, stored: bool = False) -> list[int]:
        """Elements per token each caching layer stores, one rule for every family: its latent's
        width where it caches a latent (`latent_width`: multi-head latent attention), else K and V
        of its own K/V heads (2 x `layer_kv_heads` x head dim: MHA, MQA, GQA, and per-layer heads
        as decilm's); stored: the width transformers caches where the entry declares more
        (`stored_width`, or `stored_kv_heads` in the K/V rule)."""
        layers = check_size(f"family entry {self.name}: layers(config)", self.layers(config))
        declared = self.stored_width(config) if stored and self.stored_width is not None else None
        if declared is not None:
            return [check_size(f"family entry {self.name}: stored_width(config)", declared)] * layers
        if self.latent_width is not None:
            return [check_size(f"family entry {self.name}: latent_width(config)", self.latent_width(config))] * layers
        head_dim = check_size(f"family entry {self.name}: head_dim(config)", self.head_dim(config))
        return [2 * heads * head_dim for heads in self.layer_kv_heads(config, stored)]

    def cache_bytes(self, config, dtype: torch.dtype, batch: int, written: int, static_len: int | None = None,
                    stored: bool = False, recorded_from: int | None = None) -> int:
        """The analytic bytes of a cache for `batch` rows after `written` tokens (static: of a
        cache of `static_len` slots): per layer its tokens (`layer_tokens`: a window's or the whole
        history) x its width (`layer_widths`: its K/V heads x head dim x 2, or a latent's); stored:
        what transformers' cache holds where the entry declares more (stored_kv_heads,
        stored_windows, stored_width); recorded_from: as `layer_tokens` (the most a window may hold while
        the cache keeps its past for a crop)."""
        size = torch.empty((), dtype=dtype).element_size()
        widths = self.layer_widths(config, stored)
        tokens = self.layer_tokens(config, written, static_len, stored, recorded_from)
        return sum(width * n for width, n in zip(widths, tokens, strict=True)) * batch * size

    @property
    def declares_stored(self) -> bool:
        return any(f is not None for f in (self.stored_kv_heads, self.stored_windows, self.stored_width))

    def describe_cache(self, config) -> str:
        """The analytic layout in words, for a failure's message."""
        if self.latent_width is not None:
            what = f"{self.layers(config)} layers x a latent of {self.latent_width(config)} per token"
        else:
            what = (f"{self.layers(config)} layers x {per_layer(self.layer_kv_heads(config))} K/V heads x head dim "
                    f"{self.head_dim(config)}")
        windows = self.layer_windows(config)
        if any(w is not None for w in windows):
            what += f", windows per layer {windows}"
        return what

    def kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """Analytic cached bytes per token per sequence: K and V (or the latent) of every layer,
        windows aside (`cache_bytes` counts them)."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(self.layer_widths(config)) * size

    def stored_kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """The bytes per token per sequence transformers' cache holds (the analytic size unless
        the family declares stored_kv_heads)."""
        if self.stored_kv_heads is None:
            return self.kv_bytes_per_token(config, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        return sum(self.layer_widths(config, stored=True)) * size

    def fused_modules(self, model) -> list[tuple[str, torch.nn.Module]]:
        """(qualified name, module) of every fused projection in the model, in order."""
        if self.fused is None:
            return []
        return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == self.fused]
