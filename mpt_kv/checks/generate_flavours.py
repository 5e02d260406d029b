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
FORCED = 7             # constrained beam search's forced token (run_generation.py --force_words)
# the modes transformers 5.x moved out of the package to the Hub (custom_generate repositories)
HUB_ONLY = {"contrastive": ("search", "transformers-community/contrastive-search"),
            "constrained": ("beam search", "transformers-community/constrained-beam-search")}
TOP_K = 3              # contrastive search's candidates per row (run_generation.py's --top_k; 4 there)
PENALTY_ALPHA = 0.6    # its degeneration penalty (run_generation.py's --penalty_alpha default)
SCORED = ("beam", "prompt-lookup", "draft", "constrained")  # the modes that ask generate for its scores and logits too
REPLY = (3, 5)         # multi-turn: the user's next turn, appended to what the first turn returned (2 tokens: with
#                        the first turn's last token, never fed, the second turn's first call feeds 3)


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
    # contrastive search, transformers 4.x and optimum-habana alike (4.55.4 generation/utils.py:3216-3223,
    # optimum-habana 1.21.2 :2262-2271): after the prefill it repeats and selects the cache's rows, and refuses a
    # layout it cannot (Bloom's fused (batch x heads, ...) keys, GPT-BigCode's fused K/V tensor)
    "does not have a standard cache format and therefore **can't** be used for contrastive search":
    "contrastive search refuses a cache layout whose rows it cannot repeat and select (generation/utils.py's "
    "_contrastive_search, after the prefill)",
    # "chunkink" in 4.51-4.55, "chunking" in 5.x
    "Cannot use prefill chunk": "transformers' chunked prefill needs a Cache object, and a model whose generate keeps "
    "a legacy tuple cache has none (4.51 generation/utils.py:4882, llm-foundry's MPT)",
}


def refusing(model, mode: str, path: str, call):
    """`call()`, where a ValueError carrying one of `REFUSALS`' messages (what a generate refuses by design, in its
    own words) is Unsupported with its reason: the one rule of both flavours."""
    try:
        return call()
    except ValueError as e:
        why = next((reason for words, reason in REFUSALS.items() if words in str(e)), None)
        if why is None:
            raise
        raise Unsupported(f"{type(model).__name__} {mode} on {path}: {why}: {e}") from e


def transformers_generate(model, ids, mask, mode: str, path: str, new_tokens: int, draft=None):
    """transformers' GenerationMixin.generate (5.x and 4.x alike), greedy, with an end-of-sequence token no step
    reaches (`unreachable_eos`: every row generates `new_tokens`); what it refuses by design (`REFUSALS`) is
    Unsupported."""
    return refusing(model, mode, path, lambda: call_generate(model, ids, mask, mode, path, new_tokens, draft))


def call_generate(model, ids, mask, mode: str, path: str, new_tokens: int, draft=None):
    if mode == "multi-turn":
        return multi_turn(model, ids, mask, path, new_tokens)
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
    elif mode == "constrained":
        kwargs.update(num_beams=NUM_BEAMS, num_return_sequences=1, early_stopping=False, length_penalty=0.0,
                      force_words_ids=[[FORCED % int(model.config.vocab_size)]])
    elif mode == "contrastive":
        kwargs.update(penalty_alpha=PENALTY_ALPHA, top_k=TOP_K)
    if mode in HUB_ONLY:
        import transformers

        if int(transformers.__version__.split(".")[0]) >= 5:
            raise Unsupported(f"transformers {transformers.__version__} runs {mode} {HUB_ONLY[mode][0]} from the Hub "
                              f"only (custom_generate '{HUB_ONLY[mode][1]}', generation/utils.py "
                              "GENERATION_MODES_MAPPING, :143-154 in 5.24): not in the package, and nothing of it runs "
                              "offline")
    if mode in SCORED:
        # what users of beam search and assisted decoding read besides the tokens (sequences_scores, each step's
        # scores and logits): generate then returns its cache with them (5.24 generation/utils.py:3889-3892,
        # :4254-4257), which the caller drops with the output; the drive keeps the sequences alone, and the
        # kept-after-generate rule holds that cache to it
        kwargs.update(return_dict_in_generate=True, output_scores=True, output_logits=True)
        return model.generate(ids, **kwargs).sequences
    return model.generate(ids, **kwargs)


def multi_turn(model, ids, mask, path: str, new_tokens: int):
    """Two greedy turns of a chat on one cache, as transformers' docs reuse a cache across turns ("Cache reuse",
    docs/source/en/cache_explanation.md): the user makes the cache (a DynamicCache, or a StaticCache long enough
    for both turns), generate fills it on the first turn; the second turn is the first's output with the user's
    reply (`REPLY`) appended, and generate continues the same cache (its `_prefill` slices what the cache holds off
    the input: transformers 5.24 generation/utils.py:4300-4311). A model that takes no Cache object (a legacy tuple
    cache: llm-foundry's MPT, which transformers 4.51 refuses a Cache for, generation/utils.py:1488-1492) continues
    from the cache the first turn returned (`return_dict_in_generate`). Returns the second turn's sequences: the
    prompt, the first turn's tokens, the reply, the second turn's tokens."""
    import transformers

    batch, total = ids.shape[0], ids.shape[1] + 2 * new_tokens + len(REPLY)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, use_cache=True, num_beams=1, pad_token_id=0,
                  eos_token_id=unreachable_eos(model))
    # transformers 5.x names generate's cache argument `cache` (`past_key_values` deprecated), 4.x `past_key_values`
    name = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
    if getattr(model, "_supports_cache_class", True):
        cache = user_cache(model, path, batch, total)
        first = model.generate(ids, attention_mask=mask, **kwargs, **{name: cache})
    else:
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **kwargs)
        first, cache = out.sequences, out.past_key_values
    reply = torch.tensor([list(REPLY)], dtype=first.dtype).remainder(model.config.vocab_size).expand(batch, -1)
    ids2 = torch.cat([first, reply], dim=1)
    mask2 = torch.cat([mask, torch.ones(batch, ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    return model.generate(ids2, attention_mask=mask2, **kwargs, **{name: cache})


def user_cache(model, path: str, batch: int, max_len: int):
    """The cache a user makes for a multi-turn chat: transformers' DynamicCache on the concat path, a static cache
    of `max_len` slots (both turns) on the static path, as each release's documented constructor takes them (5.x: a
    StaticCache from the model's config, which gives each layer its type: a window layer's cache; 4.x: the class the
    model's generation config names, as generate would pick it (`cache_implementation`: gemma2/3's "hybrid"), with
    the batch, the device and the dtype, and a DynamicCache without a config)."""
    import transformers
    from transformers import DynamicCache, StaticCache

    v5 = int(transformers.__version__.split(".")[0]) >= 5
    if path != "static":
        return DynamicCache(config=model.config) if v5 else DynamicCache()
    if v5:
        return StaticCache(config=model.config, max_cache_len=max_len)
    from transformers.generation.configuration_utils import NEED_SETUP_CACHE_CLASSES_MAPPING

    cls = NEED_SETUP_CACHE_CLASSES_MAPPING.get(getattr(model.generation_config, "cache_implementation", None) or
                                               "static", StaticCache)
    weight = next(model.parameters())
    return cls(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=weight.device,
               dtype=weight.dtype)


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
