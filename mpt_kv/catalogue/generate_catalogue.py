"""The generate checks' catalogues: must-pass designs and must-kill variants whose change lives only in the
half of the cache that lives in `generate` (what it passes the model, how it pads, reorders, crops or keeps
the cache between calls, what `prepare_inputs_for_generation` slices), run by the kill matrix (`python -m
mpt_kv killmatrix`, its generate rows) and tests/test_generate.py.

    from mpt_kv.catalogue.generate_catalogue import GENERATE_DESIGNS, GENERATE_VARIANTS, run
    run(GENERATE_VARIANTS["crop_one_position_short"], "prompt-lookup")   # raises PropertyFailure

Each entry is transformers 5.x's `MptForCausalLM` driven by its own `generate`, with one change to the model
class's generation methods (the forward, the attention and the cache classes untouched): the direct drive,
which calls the forward itself, cannot see any of them. An entry is also an MPT target factory (a module
attribute of its name: `--target mpt_kv.catalogue.generate_catalogue:crop_one_position_short`), so every check
runs on it. The columns are the generate modes (`GENERATE_COLUMNS`), on the row's cache path; a mode the entry
does not run (`modes`) reads "n/a" with its reason.

The base (`CopyingCrop`, itself the design `crop_copies`) is transformers' MPT whose dynamic cache crops by
copying: transformers 5.24's own crop slices (a known failure, the cropped candidates pinned until the next
call), which would kill every assisted row whatever its change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mpt_kv.checks import index

GENERATE_COLUMNS = index.GENERATE_MODES  # greedy, beam, prompt-lookup, draft, chunked, contrastive, constrained, multi-turn
# transformers 5.x, which the rows change, runs contrastive and constrained beam search from the Hub only
# (generate_flavours.HUB_ONLY): no row runs them
HUB_ONLY = ("contrastive", "constrained")
ROW_MODES = tuple(m for m in GENERATE_COLUMNS if m not in HUB_ONLY)
STATIC_MODES = ("greedy", "beam", "draft")
NO_STATIC_PROMPT_LOOKUP = ("transformers 5.24's prompt lookup overruns a static cache at the end of a generation (a "
                           "known failure of the base, transformers-mpt-prompt-lookup-static-cache-overrun)")


@dataclass(frozen=True)
class GenerateEntry:
    name: str
    path: str                     # the cache path of the row: concat or static
    why: str                      # one line: what the design does, or what is wrong with the variant
    origin: str                   # where it comes from
    model: Callable[[], type]     # () -> the model class (transformers' MptForCausalLM with the change)
    build: Callable | None = None  # the entry as an MPT target factory (set by `entry`)
    modes: tuple[str, ...] = ROW_MODES  # the columns its row runs
    killed_by: tuple[str, ...] = ()  # variants: the columns expected to kill it
    waits_for: str = ""           # variants: the check feature, not in this build, that will kill it
    cache_pool: bool = False      # it keeps a cache on purpose, declared (Capabilities(cache_pool=True))

    def skipped(self, mode: str) -> str | None:
        """Why the row does not run `mode` (None: it does)."""
        if mode in self.modes:
            return None
        if mode in HUB_ONLY:
            return f"transformers 5.x runs {mode} from the Hub only (custom_generate): no row runs it"
        return NO_STATIC_PROMPT_LOOKUP if self.path == "static" and mode == "prompt-lookup" else \
            f"{self.name} runs {', '.join(self.modes)}"


def unavailable() -> str | None:
    """Why the generate catalogue's rows cannot run here (None: they can)."""
    from mpt_kv.versions import transformers_version

    try:
        import transformers.cache_utils as utils
    except ImportError as e:
        return f"transformers is not installed ({e})"
    if int(transformers_version().split(".")[0]) < 5 or not hasattr(utils, "DynamicLayer"):
        return (f"transformers {transformers_version()}: the generate catalogue changes transformers 5.x's generation "
                "methods and cache layers (4.x's MPT has no static path and stores its first K/V as views)")
    return None


GENERATE_DESIGNS: dict[str, GenerateEntry] = {}
GENERATE_VARIANTS: dict[str, GenerateEntry] = {}


def entry(name, path, why, origin, model, *, design=False, **fields):
    """Register a design (design=True) or a variant and return its MPT target factory (a module attribute of the
    same name)."""

    def build(cfg, state_dict, device, dtype):
        from mpt_kv.targets import Capabilities
        from mpt_kv.targets.wrappers import TransformersRunner

        model_class = model()
        m = model_class(cfg.to_hf())
        m.load_state_dict(state_dict, strict=True)
        m.to(device=device, dtype=dtype).eval()
        caps = Capabilities(cache_pool=fields.get("cache_pool", False))
        return TransformersRunner(m, device, name=f"transformers+{name}", capabilities=caps)

    build.__name__ = build.__qualname__ = name
    build.__module__ = __name__
    registered = GenerateEntry(name, path, why, origin, model, build, **fields)
    (GENERATE_DESIGNS if design else GENERATE_VARIANTS)[name] = registered
    return build


def run(e: GenerateEntry, mode: str) -> list[str]:
    """The generate check of `mode` on the entry's path, on its factory (cpu, float32)."""
    from mpt_kv.checks.registry import CHECKS

    return CHECKS[f"generate/{e.path}/{mode}"](e.build, "cpu", torch.float32)


# --- the base: transformers' MPT whose dynamic cache crops by copying ------------------------------------------

def copying_crop_layer():
    from transformers.cache_utils import DynamicLayer

    class CopyingCropLayer(DynamicLayer):
        """DynamicLayer.crop (5.24 cache_utils.py:164-181) with the kept positions copied: what the slice should be."""

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            if self.is_initialized and tokens_to_remove:
                self.keys, self.values = self.keys.clone(), self.values.clone()

    return CopyingCropLayer


def copying_crop():
    from transformers import MptForCausalLM
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layer = copying_crop_layer()

    class CopyingCrop(MptForCausalLM):
        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
            cache = model_kwargs.get("cache")
            if isinstance(cache, DynamicCache):
                for each in cache.layers:
                    if type(each) is DynamicLayer:
                        each.__class__ = layer

    return CopyingCrop


crop_copies = entry(
    "crop_copies", "concat",
    "generate's dynamic cache crops the rejected candidates by copying the kept positions: the cropped tail freed "
    "at once (every generate column holds)",
    "transformers 5.24 cache_utils.py:180-181 (DynamicLayer.crop) with .clone() on the kept slice: what the slice "
    "should be (5.24's own slice is a known failure)",
    copying_crop, design=True)


# --- a generate-side cache pool (must pass) --------------------------------------------------------------------

def pooled_static():
    from transformers.cache_utils import StaticCache

    base = copying_crop()

    class PooledStatic(base):
        """One static cache kept on the model between generate calls, reset and handed to the next call of the same
        batch and length (a new one, kept in its place, otherwise): transformers 4.x's `_get_cache` pool."""

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                          max_cache_length, *args, **kwargs):
            if generation_config.cache_implementation != "static":
                return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
                                                             batch_size, max_cache_length, *args, **kwargs)
            rows = max(generation_config.num_beams, generation_config.num_return_sequences) * batch_size
            pool = getattr(self, "_generate_pool", None)
            if pool is None or pool[0] != (rows, max_cache_length):
                pool = ((rows, max_cache_length), StaticCache(config=self.config, max_cache_len=max_cache_length))
                self._generate_pool = pool
            else:
                pool[1].reset()
            model_kwargs["cache"] = pool[1]

    return PooledStatic


generate_cache_pool = entry(
    "generate_cache_pool", "static",
    "a generate-side cache pool: the model keeps one static cache between generate calls and resets it for the next "
    "call of the same batch and length (declared: Capabilities(cache_pool=True)); its bytes stay allocated between "
    "calls, by design",
    "transformers 4.x generate's _get_cache (self._cache reset and reused, 4.55.4 generation/utils.py:1890-1954), "
    "and vLLM's engine-level block pool",
    pooled_static, design=True, modes=STATIC_MODES, cache_pool=True)


# --- must-kill variants: bugs of the generate half only --------------------------------------------------------

def cropped_one_short():
    base = copying_crop()

    class CropOneShort(base):
        """prepare_inputs_for_generation that, after generate cropped the cache (it holds fewer positions than
        the last call returned), crops it one position more before slicing the new tokens: the cache is one
        position short of the sequence it is fed after."""

        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            cache = kwargs.get("cache")
            held = cache.get_seq_length() if cache is not None else 0
            if cache is not None and 0 < held < getattr(self, "_returned", 0):
                cache.crop(-1)
                held -= 1
                kwargs["next_sequence_length"] = input_ids.shape[1] - held - 1
            inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
            self._returned = held + inputs["input_ids"].shape[1]
            return inputs

    return CropOneShort


crop_one_position_short = entry(
    "crop_one_position_short", "concat",
    "after generate's assisted crop, prepare_inputs_for_generation slices the cache one position further before the "
    "next call (a length computed before the crop, an off-by-one in the tokens kept): the call attends one position "
    "too few",
    "the slicing prepare_inputs_for_generation does from the cache's length (5.24 generation/utils.py:701-702, "
    "next_sequence_length) meeting the crop of _assisted_decoding (:4164): an off-by-one there is invisible without "
    "a crop",
    cropped_one_short, killed_by=("prompt-lookup", "draft"))


def beam_mask_of_another_row():
    base = copying_crop()

    class MaskRepeated(base):
        """generate's expansion of the prompt to num_beams rows per prompt: input_ids interleaved (each prompt's
        beams together, as transformers does) but the attention mask tiled (the whole batch repeated): a beam
        gets another prompt's padding."""

        def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None,
                                          **model_kwargs):
            mask = model_kwargs.get("attention_mask")
            input_ids, model_kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids,
                                                                           **model_kwargs)
            if mask is not None and expand_size > 1:
                model_kwargs["attention_mask"] = mask.repeat(expand_size, 1)
            return input_ids, model_kwargs

    return MaskRepeated


beam_padding_of_another_row = entry(
    "beam_padding_of_another_row", "static",
    "generate expands the prompts to num_beams rows each with input_ids interleaved but the padding mask tiled: a "
    "beam's padded slots and real ones come from another prompt's mask",
    "the two expansions of _expand_inputs_for_generation (repeat_interleave, 5.24 generation/utils.py:1198-1240) "
    "written once with repeat: invisible while every prompt has the same padding",
    beam_mask_of_another_row, modes=STATIC_MODES, killed_by=("beam",))


def mask_dropped_after_prefill():
    base = copying_crop()

    class MaskDropped(base):
        """prepare_inputs_for_generation that hands the forward no attention mask after the prefill (a one-token
        step looks causal on its own): a left-padded row's padding is attended from the first decode step on."""

        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
            cache = inputs.get("cache")
            if cache is not None and cache.get_seq_length() > 0 and inputs["input_ids"].shape[1] == 1:
                inputs.pop("attention_mask", None)
            return inputs

    return MaskDropped


decode_mask_dropped = entry(
    "decode_mask_dropped", "concat",
    "prepare_inputs_for_generation drops the attention mask on one-token steps (a single query looks causal on its "
    "own): a left-padded row attends its padding from the first decode step",
    "the q_len == 1 shortcut of fast attention paths, taken in the generate half (the model's own "
    "prepare_inputs_for_generation) instead of the attention",
    mask_dropped_after_prefill, killed_by=("greedy", "beam"))


def keys_only_reorder():
    base = copying_crop()

    class KeysOnly(base):
        """A model `_reorder_cache` (which generate prefers to the cache's own from transformers 4.54 on,
        5.24 generation/utils.py:3838-3845) that reorders the keys and leaves the values in the old order."""

        def _reorder_cache(self, cache, beam_idx):
            for layer in cache.layers:
                if layer.is_initialized:
                    layer.keys = layer.keys.index_select(0, beam_idx.to(layer.keys.device))
            return cache

    return KeysOnly


beam_reorder_keys_only = entry(
    "beam_reorder_keys_only", "concat",
    "the model's own _reorder_cache, which beam search calls in place of the cache's, reorders the keys only: after a "
    "reorder that moves rows each beam attends another beam's values",
    "transformers' beam search route since 4.54 (the model's _reorder_cache first, generation/utils.py:3838-3845 in "
    "5.24): a model that defines one for its own cache class",
    keys_only_reorder, killed_by=("beam",))


def last_cache_kept():
    base = copying_crop()

    class KeepsLastCache(base):
        """generate that keeps the cache it makes on the model (to continue a chat from it), undeclared."""

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
            self._last_cache = model_kwargs.get("cache")

    return KeepsLastCache


cache_kept_after_generate = entry(
    "cache_kept_after_generate", "concat",
    "generate keeps the last cache on the model after it returns (self._last_cache, to continue from it), without "
    "declaring a pool: a whole cache stays allocated between calls",
    "chat-continuation helpers that stash past_key_values on the model; transformers 4.x's static cache pool without "
    "its reset and reuse",
    last_cache_kept, killed_by=("greedy", "beam", "prompt-lookup", "draft"))


def one_token_with_a_cache():
    base = copying_crop()

    class OneTokenWithACache(base):
        """prepare_inputs_for_generation that feeds one token whenever the cache holds positions: greedy, beam
        and a chunked prefill feed one token per call after the first anyway; what starts a several-token call on
        a filled cache loses the tokens before its last (a chat's next turn; assisted decoding's verification)."""

        def prepare_inputs_for_generation(self, input_ids, *args, next_sequence_length=None, cache=None, **kwargs):
            if next_sequence_length is not None and cache is not None and cache.get_seq_length() > 0:
                next_sequence_length = 1
            return super().prepare_inputs_for_generation(input_ids, *args, next_sequence_length=next_sequence_length,
                                                         cache=cache, **kwargs)

    return OneTokenWithACache


continue_feeds_last_token_only = entry(
    "continue_feeds_last_token_only", "concat",
    "prepare_inputs_for_generation feeds the last token alone whenever a cache is passed: a chat's next turn, which "
    "continues the cache of the previous one, drops the user's reply",
    "llm-foundry 0.22.0's MPT (llmfoundry/models/mpt/modeling_mpt.py:1386-1388: input_ids[:, -1] if past_key_values "
    "is not None), the one-new-token-per-call assumption of pre-Cache modeling files",
    one_token_with_a_cache, killed_by=("multi-turn",))  # and assisted decoding's columns, whose verification it cuts


__all__ = ["GENERATE_COLUMNS", "GENERATE_DESIGNS", "GENERATE_VARIANTS", "GenerateEntry", "run", "unavailable",
           *GENERATE_DESIGNS, *GENERATE_VARIANTS]
