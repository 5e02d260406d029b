"""Whose `generate` the generate drive runs, and how it calls it: transformers' GenerationMixin (MPT, every
family, llm-foundry under its pinned transformers, a user's model that inherits it) or optimum-habana's
GaudiGenerationMixin for its ports (`mpt_kv.targets.gaudi_generate`), each a `Flavour`; greedy with an
end-of-sequence token no step reaches, beam, prompt lookup and a draft model; what transformers refuses by
design is Unsupported with its reason (`REFUSALS`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from mpt_kv.errors import Unsupported

NUM_BEAMS = 3          # 3 beams of the drive's prompt move rows at a reorder (2 often keep their order)
CANDIDATES = 3         # prompt_lookup_num_tokens; the draft's num_assistant_tokens
CHUNK = 4              # prefill_chunk_size: the drive's 6-token prompt as a 4-token and a 2-token call (row 0's
#                        first chunk straddles its 2 padding slots and its first tokens)


@dataclass
class Flavour:
    """How one implementation's `generate` is called and read.

    name        "transformers", "optimum-habana", "llm-foundry"
    generate    (model, ids, mask, mode, path, new_tokens, draft) -> sequences (B, S + new_tokens)
    context     () -> a context manager entered around every generate call (optimum-habana: its
                generation functions in place of transformers' for the call, as adapt_transformers_to_gaudi
                puts them)
    sequence    (args, kwargs, its output) of `prepare_inputs_for_generation` -> (ids, mask) of the sequence generate
                holds (optimum-habana's static shapes: the prefix before `token_idx`)
    pool        model -> ([tensors], where): the cache generate itself keeps on the model between calls by
                design (transformers 4.x's static cache, `self._cache`), accepted as a cache pool and noted
    """

    name: str
    generate: Callable
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    sequence: Callable | None = None
    pool: Callable | None = None  # model -> (the cached tensors generate keeps on the model by design, where)


def unreachable_eos(model) -> int:
    """An end-of-sequence token no step can choose (the vocabulary's size: past every logit), so every row
    generates `new_tokens` and no candidate is cut at one; None is no option (transformers 4.55's prompt lookup
    passes it to isin unguarded, candidate_generator.py:1076)."""
    return int(model.config.vocab_size)


# what transformers' generate refuses by design, with its own message (never a crash): Unsupported, its reason
REFUSALS = {
    "Assisted decoding requires a cache that can be cropped": "transformers' assisted decoding refuses a cache it "
    "cannot crop (a static cache longer than a layer's sliding window: StaticSlidingWindowLayer.is_croppable; 5.24 "
    "generation/utils.py:4098-4101)",
    "assisted generate is not supported with Static cache classes": "transformers 4.x's assisted decoding refuses a "
    "static cache (4.55.4 generation/utils.py:2529-2530)",
    # "chunkink" in 4.51-4.55, "chunking" in 5.x
    "Cannot use prefill chunk": "transformers' chunked prefill needs a Cache object, and a model whose generate keeps "
    "a legacy tuple cache has none (4.51 generation/utils.py:4882, llm-foundry's MPT)",
}


def transformers_generate(model, ids, mask, mode: str, path: str, new_tokens: int, draft=None):
    """transformers' GenerationMixin.generate (5.x and 4.x alike), greedy, with an end-of-sequence token no step
    reaches (`unreachable_eos`: every row generates `new_tokens`); what it refuses by design (`REFUSALS`) is
    Unsupported."""
    try:
        return call_generate(model, ids, mask, mode, path, new_tokens, draft)
    except ValueError as e:
        why = next((reason for start, reason in REFUSALS.items() if str(e).startswith(start)), None)
        if why is None:
            raise
        raise Unsupported(f"{type(model).__name__} {mode} on {path}: {why}: {e}") from e


def call_generate(model, ids, mask, mode: str, path: str, new_tokens: int, draft=None):
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, use_cache=True, num_beams=1,
                  pad_token_id=0, eos_token_id=unreachable_eos(model))
    if path == "static":
        kwargs["cache_implementation"] = "static"
    if mode == "beam":
        kwargs.update(num_beams=NUM_BEAMS, num_return_sequences=1, early_stopping=False, length_penalty=0.0)
    elif mode == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = CANDIDATES
    elif mode == "draft":
        draft.generation_config.num_assistant_tokens = CANDIDATES
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = draft
    elif mode == "chunked":
        kwargs["prefill_chunk_size"] = CHUNK
    return model.generate(ids, **kwargs)


def transformers_pool(model):
    """transformers 4.x's generate keeps its static cache on the model and resets it for the next call of the
    same shapes (`_get_cache`: `self._cache`, 4.55.4 generation/utils.py:1890-1954): a cache pool of generate's
    own; 5.x makes a new cache per call (none kept)."""
    from mpt_kv.families.models import cached_kv

    cache = getattr(model, "_cache", None)
    if cache is None:
        return [], ""
    return [t for _, _, t in cached_kv(cache)], ("transformers 4.x generate's static cache kept on the model "
                                                 "(self._cache, reset and reused by the next call: generation/"
                                                 "utils.py _get_cache)")


TRANSFORMERS = Flavour("transformers", transformers_generate, pool=transformers_pool)


def flavour_of(model) -> Flavour:
    """The generate a model is driven by: optimum-habana's for its ports (`mpt_kv.targets.gaudi_generate`),
    transformers' GenerationMixin otherwise (transformers' models, llm-foundry's under its pinned
    transformers, a user's model that inherits it)."""
    if type(model).__module__.startswith("optimum.habana"):
        from mpt_kv.targets import gaudi_generate

        drive = functools.partial(gaudi_generate.gaudi_generate, candidates=CANDIDATES, num_beams=NUM_BEAMS,
                                  eos=unreachable_eos)
        return Flavour("optimum-habana", drive, context=gaudi_generate.gaudi_generation,
                       sequence=gaudi_generate.gaudi_sequence)
    return TRANSFORMERS


def has_generate(model) -> str | None:
    """Why `model` cannot be driven by generate (None: it can)."""
    if not callable(getattr(model, "generate", None)) or not callable(getattr(model, "prepare_inputs_for_generation",
                                                                              None)):
        return (f"{type(model).__name__} has no generate (and prepare_inputs_for_generation): the generate drive runs "
                "an implementation's own generate")
    return None


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids transformers' generate gives each row: counted from its first real token (the
    attention mask's cumsum - 1; transformers 5.24 generation/utils.py:919-921, 4.55.4 in
    prepare_inputs_for_generation), a padding slot's 0 (masked: it reaches no real token)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
