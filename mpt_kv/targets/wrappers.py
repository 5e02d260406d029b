"""Ready-made runners for the common model shapes: a target's factory is then a few lines.

    GaudiStyleRunner(model, device)    optimum-habana's forward signature: `model(input_ids,
                                       attention_mask=, past_key_values=, use_cache=, token_idx=,
                                       cache_idx=)` returning `.logits` and `.past_key_values`
                                       (a per-layer [key, value] list). `token_idx` and
                                       `cache_idx` are optional: a forward without them declares
                                       the static path / cache_idx buckets unsupported.
    TransformersRunner(model, device)  a transformers-style model with Cache objects:
                                       `DynamicCache` for concat, `StaticCache` for static.
    ReferenceRunner                    a model built from the reference's pieces
                                       (`mpt_kv.model.reference`): subclass it, set `model_class`.

Each takes `capabilities=Capabilities({...})` for what the model does not implement (with the
reason), merged with what the wrapper finds in the forward signature. docs/targets.md shows a
factory for each.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import torch
from torch import nn

from mpt_kv.model.session import Session, TokenIdxSession, check_prompt
from mpt_kv.versions import transformers_major, transformers_version  # noqa: F401  (public here before)
from mpt_kv.targets import Capabilities, Runner
from mpt_kv.targets.reference import ReferenceRunner, ReferenceSession
from mpt_kv.devices import sync
from mpt_kv.targets.gaudi_generation import assisted_crop
from mpt_kv.targets.gaudi_generation import temporary_reorder_cache
from mpt_kv.targets.hf_generation import reorder_as_beam_search, reorder_route
from mpt_kv.errors import AdapterError, Unsupported

__all__ = ["GaudiStyleRunner", "GaudiStyleSession", "TransformersRunner", "TransformersSession",
           "ReferenceRunner", "ReferenceSession", "forward_accepts"]


def forward_accepts(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes the keyword `name` (a **kwargs catch-all counts)."""
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def device_sync(device) -> Callable[[], None]:
    """What makes queued work finish on `device` (cuda synchronize, hpu mark_step); None: nothing."""
    if device is None:
        return lambda: None
    kind = torch.device(device).type
    return lambda: sync(kind)


def with_declared(detected: dict[str, str], declared: Capabilities | None) -> Capabilities:
    """The user's declaration wins where both name a feature; detected gaps are added to it."""
    if declared is not None and not isinstance(declared, Capabilities):  # a dict would fail inside dataclasses.replace
        raise TypeError(f"capabilities={declared!r} ({type(declared).__name__}): pass a mpt_kv.Capabilities, e.g. "
                        "Capabilities({'bf16': 'our kernels are fp32 only'})")
    declared = declared or Capabilities()
    return dataclasses.replace(declared, unsupported={**detected, **declared.unsupported})


# the names a config gives its longest sequence: mpt-kv's ModelConfig and MPT's, then transformers' other families'
POSITION_LIMITS = ("max_seq_len", "max_position_embeddings", "n_positions", "seq_length")


def model_limits(model: nn.Module, cfg) -> tuple[int, int]:
    """(max_seq_len, vocab_size) from `cfg` (a ModelConfig, or a family's transformers config: its
    max_position_embeddings) or else the model's own config."""
    source = cfg if cfg is not None else getattr(model, "config", None)
    limit = next((getattr(source, n) for n in POSITION_LIMITS if isinstance(getattr(source, n, None), int)), None)
    try:
        if limit is None:
            raise AttributeError(f"{type(source).__name__} has none of {', '.join(POSITION_LIMITS)}")
        return int(limit), int(source.vocab_size)
    except AttributeError as e:  # one sentence, no chain: the fix is the adapter's, at the runner's construction
        missing = "no cfg= and the model has no .config" if source is None else f"{e}"
        raise AdapterError(f"{type(model).__name__}: pass cfg= (the factory's ModelConfig) to the runner, or give the "
                           f"model a .config with max_seq_len and vocab_size ({missing}; a family target's transformers "
                           "config, with max_position_embeddings, serves as cfg= too)") from None


class ModelRunner(Runner):
    """What the ready-made wrappers share: a model that takes `attention_mask=` and `use_cache=`
    and returns `.logits`, its limits, and the wait for its queued work. Arguments as
    `GaudiStyleRunner`; `detected`: what the wrapper found the model lacks."""

    def __init__(self, model, device=None, *, name: str | None = None, capabilities: Capabilities | None = None,
                 cfg=None, sync: Callable[[], None] | None = None, detected: dict[str, str] | None = None):
        self.model = model
        self.sync = sync or device_sync(device)
        self.name = name or self.name
        self.max_seq_len, self.vocab_size = model_limits(model, cfg)
        self.capabilities = with_declared(detected or {}, capabilities)

    def logits(self, input_ids, attention_mask):
        check_prompt(input_ids, attention_mask, self.vocab_size, self.max_seq_len)  # before the model crashes inside
        out = self.model(input_ids, attention_mask=attention_mask, use_cache=False).logits
        self.sync()
        return out


# --- optimum-habana's forward signature -------------------------------------------------------------

class GaudiStyleSession(TokenIdxSession):
    """optimum-habana's generation protocol (`TokenIdxSession`) over a model's own per-layer cache."""

    def __init__(self, runner: "GaudiStyleRunner", path, max_len, bucket=None):
        super().__init__(path, max_len, bucket, runner.sync, max_seq_len=runner.max_seq_len,
                         vocab_size=runner.vocab_size)
        self.runner = runner
        self.past = None

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.path == "concat":
            token_idx = None  # the concat path is the one without token_idx
        extra = dict(self.runner.forward_kwargs)  # only what the model takes: an older release has no cache_idx
        if token_idx is not None:
            extra["token_idx"] = token_idx
        if cache_idx is not None:
            if self.past is None:
                for block in self.runner.blocks():
                    block.attn.kv_cache_len = self.max_len  # what prepare_inputs_for_generation sets
            extra["cache_idx"] = cache_idx
        out = self.runner.model(input_ids, attention_mask=mask, past_key_values=self.past, use_cache=True, **extra)
        self.past = out.past_key_values
        return out.logits

    def _crop_cache(self, n):
        """As optimum-habana's `_assisted_decoding`: `past_key_values.crop(n)` (gaudi_generation.py);
        a tuple/list cache has no crop (AttributeError, as there). The session has already moved
        token_idx and the mask back."""
        self.past = assisted_crop(self.past, n, model=self.runner.model)

    def _reorder_cache(self, index):
        """As optimum-habana's `_beam_search` with reuse_cache off: its own
        `_temporary_reorder_cache(model, past_key_values, beam_idx)` (gaudi_generation.py)."""
        self.past = temporary_reorder_cache(self.runner.model, self.past, index)

    def kv(self):
        return [(layer[0], layer[1]) for layer in self.past]


class GaudiStyleRunner(ModelRunner):
    """A model with optimum-habana's forward signature, e.g. `GaudiMptForCausalLM` or a port of it.

    model         the nn.Module, already on its device and dtype, in eval mode
    device        where it runs: its queued work is synchronized before results are read
    name          how reports name it (default: the target's spec)
    capabilities  what it does not implement, with reasons; a forward without `token_idx`
                  (static path) or `cache_idx` (buckets) is detected and added
    cfg           the factory's ModelConfig, if the model has no `.config` with max_seq_len and
                  vocab_size
    sync          instead of `device`: a callable that waits for queued work
    """

    name = "optimum-habana"
    forward_kwargs: dict = {}  # keyword arguments every cached forward gets (a recipe's flags: targets/gaudi.py)

    def __init__(self, model, device=None, *, name: str | None = None, capabilities: Capabilities | None = None,
                 cfg=None, sync: Callable[[], None] | None = None):
        detected = {}
        if not forward_accepts(model, "token_idx"):
            detected["static"] = f"{type(model).__name__}.forward has no token_idx parameter (optimum-habana's static path)"
        if not forward_accepts(model, "cache_idx"):
            detected["bucket"] = f"{type(model).__name__}.forward has no cache_idx parameter (optimum-habana's bucketed cache)"
        super().__init__(model, device, name=name, capabilities=capabilities, cfg=cfg, sync=sync, detected=detected)

    def blocks(self):
        """The layers whose `attn.kv_cache_len` the cache_idx path sets (optimum-habana's layout)."""
        return self.model.transformer.blocks

    def session(self, path, max_len, bucket=None):
        self.require(path, "bucket" if bucket else None)
        return GaudiStyleSession(self, path, max_len, bucket)


# --- transformers-style models with Cache objects --------------------------------------------------------



class TransformersSession(Session):
    """concat = `DynamicCache`, static = `StaticCache`, passed to the model's forward each step.
    The keyword is `cache` in transformers 5.x and `past_key_values` before."""

    def __init__(self, runner: "TransformersRunner", path: str, max_len: int):
        cfg = runner.model.config
        super().__init__(path, max_len, runner.max_seq_len, runner.vocab_size)
        self.runner = runner
        if path == "concat" and getattr(type(runner.model), "_supports_cache_class", None) is False:
            self.cache = None  # transformers <4.4x MPT: legacy tuples, None before the prefill
        elif path == "concat":
            # transformers is imported where a transformers session is made, not with this module: every
            # `import mpt_kv` imports it (the reference's runner), and importing transformers costs seconds
            from transformers import DynamicCache

            self.cache = DynamicCache(config=cfg) if transformers_major() >= 5 else DynamicCache()
        elif transformers_major() >= 5:
            from transformers import StaticCache

            self.cache = StaticCache(config=cfg, max_cache_len=max_len)
        else:
            self.cache = None  # 4.x StaticCache needs the batch, dtype and device: made at the prefill

    def _static_cache_4x(self, input_ids):
        from transformers import StaticCache

        model = self.runner.model
        return StaticCache(config=model.config, max_batch_size=input_ids.shape[0], max_cache_len=self.max_len,
                           device=input_ids.device, dtype=model.dtype)

    def _forward(self, input_ids, mask):
        if self.path == "static" and self.cache is None:
            self.cache = self._static_cache_4x(input_ids)
        kw = {self.runner.cache_kw: self.cache}
        if self.path == "static" and self.runner.pass_cache_position and transformers_major() < 5:
            # as generate passes them: 4.x StaticCache would count its filled slots of row 0 instead
            kw["cache_position"] = torch.arange(self.written, self.written + input_ids.shape[1],
                                                device=input_ids.device)
        if self.path == "static" and self.runner.pad_static_mask and mask.shape[1] < self.max_len:
            # the 2D mask over the whole preallocated cache, 0 past the written positions (as Bloom's
            # create_masks_for_generate pads it in generate): an ALiBi bias built from the mask then
            # has the cache's length
            mask = torch.nn.functional.pad(mask, (0, self.max_len - mask.shape[1]))
        out = self.runner.model(input_ids, attention_mask=mask, use_cache=True, **kw)
        returned = getattr(out, self.runner.cache_kw, None) if hasattr(out, self.runner.cache_kw) else None
        if returned is None:
            returned = out.past_key_values
        self.cache = returned  # 4.55 may hand back a legacy tuple
        self.runner.sync()
        return out.logits

    def _prefill(self, input_ids, attention_mask):
        self.mask = attention_mask  # bool, int64 or int32, as given: MptForCausalLM accepts each
        return self._forward(input_ids, self.mask)

    def _extend(self, tokens):
        # a k-token cached call is assisted decoding's verification, and transformers 5.x's assisted
        # decoding records the past of the cache's sliding-window layers so that its crop can roll
        # them back (generation/utils.py:3983, `cache.activate_past_recording()`; a cache without
        # such layers has nothing to record); a decode (one token, `_decode`) does not record
        if tokens.shape[1] > 1 and hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, tokens.shape[1])], dim=1)
        return self._forward(tokens, self.mask)

    def _crop(self, n):
        """transformers' own `Cache.crop`: 5.x takes the number of tokens to remove as a negative
        int (`DynamicLayer.crop` slices, `StaticLayer.crop` moves `cumulative_length` back),
        4.x the length to keep (`DynamicCache.crop(max_length)`). A 5.x cache that says it cannot
        crop (a StaticSlidingWindowLayer longer than its window: `is_croppable` False) is refused,
        as transformers' assisted decoding refuses it (generation/utils.py:4098, ValueError)."""
        if self.path == "static" and transformers_major() < 5:
            raise Unsupported(f"{self.runner.name}: transformers {transformers_version()}: StaticCache cannot crop "
                              "(Cache.crop calls StaticLayer.crop, which 4.x does not have: AttributeError)")
        if getattr(self.cache, "is_croppable", True) is False:
            raise Unsupported(f"{self.runner.name}: transformers {transformers_version()}: this {type(self.cache).__name__} "
                              "is not croppable (a sliding-window layer of a static cache longer than its window "
                              "cannot restore the evicted states: StaticSlidingWindowLayer.is_croppable); generate's "
                              "assisted decoding refuses it (generation/utils.py:4098)")
        self.mask = self.mask[:, :n].clone()
        if isinstance(self.cache, (tuple, list)):
            # a model that still returns legacy tuples (MPT before 4.5x): what transformers' assisted
            # decoding does with them, its `_crop_past_key_values(model, past_key_values, max_length)`
            from transformers.generation.candidate_generator import _crop_past_key_values

            self.cache = _crop_past_key_values(self.runner.model, self.cache, n)
        else:
            self.cache.crop(n - self.written if transformers_major() >= 5 else n)
        self.runner.sync()

    def _reorder(self, index):
        """As the installed transformers' beam search reorders, read from its own `_beam_search`
        (`mpt_kv.targets.hf_generation`): 4.54 to 5.24 the model's own `_reorder_cache(past,
        beam_idx)` when it defines one, else `Cache.reorder_cache(beam_idx)` (`index_select` per
        layer; 4.55.4 generation/utils.py:4190, 5.24 :3842); 4.36 to 4.53 the GenerationMixin's
        `_temporary_reorder_cache` (a tuple cache: the model's `_reorder_cache`; a Cache: its own
        `reorder_cache`, whatever the model defines); before, the model's `_reorder_cache`. A model
        whose own `_reorder_cache` is wrong is then seen where that release would call it."""
        self.mask = self.mask.index_select(0, index)
        self.cache = reorder_as_beam_search(self.runner.model, self.cache, index)
        self.runner.sync()

    def kv(self):
        c = self.cache
        if isinstance(c, (tuple, list)):
            return [(k, v) for k, v in c]
        if hasattr(c, "layers"):
            return [(layer.keys, layer.values) for layer in c.layers]
        return list(zip(c.key_cache, c.value_cache))


class TransformersRunner(ModelRunner):
    """A transformers-style causal LM (`forward(input_ids, attention_mask=, use_cache=, cache= |
    past_key_values=)` returning `.logits` and the cache) whose `.config` transformers' cache
    classes accept. Cache objects have no cache_idx buckets: that feature is declared unsupported.
    Arguments as `GaudiStyleRunner`, and
    pad_static_mask  on the static path, pass the 2D mask padded with 0 to the cache length (as
                     Bloom's `create_masks_for_generate` does in generate); default: the written part

    On 4.x's static path a forward that names `cache_position` gets the positions each call writes,
    as generate passes them (that StaticCache would otherwise count its filled slots)."""

    name = "transformers"

    def __init__(self, model, device=None, *, name: str | None = None, capabilities: Capabilities | None = None,
                 cfg=None, sync: Callable[[], None] | None = None, pad_static_mask: bool = False):
        super().__init__(model, device, name=name, capabilities=capabilities, cfg=cfg, sync=sync,
                         detected={"bucket": "transformers' Cache objects have no cache_idx buckets"})
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_cache_position = "cache_position" in params
        self.pad_static_mask = pad_static_mask

    @property
    def beam_reorder(self) -> str:
        """How the installed release's beam search reorders the cache, which this runner follows
        (`mpt_kv.targets.hf_generation.reorder_route`): printed per target by `python -m mpt_kv
        run`, per release by the sweep."""
        return reorder_route().describe()

    def session(self, path, max_len, bucket=None):
        self.require(path, "bucket" if bucket else None)
        return TransformersSession(self, path, max_len)
