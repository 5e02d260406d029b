"""The family checks' catalogues: the must-pass designs and must-kill variants of the Gaudi zoo's
cache designs (sliding windows, hybrid static caches, multi-head latent attention, mixtures of
experts), each transformers 5.x's implementation of one family with one change, run by the kill
matrix (`python -m mpt_kv killmatrix`, its family rows) and by tests/test_zoo.py.

    from mpt_kv.catalogue.family_catalogue import FAMILY_DESIGNS, FAMILY_VARIANTS, run
    run(FAMILY_VARIANTS["window_one_short"], "family-P1")   # raises PropertyFailure

An entry is data: its family and variant, the cache path its row runs on, one line of what it does
(a design) or what is wrong (a variant), where it comes from, and for a variant the family checks
expected to kill it (`killed_by`, as an MPT variant's). The change itself is one or both of:

  patch         a context manager factory, entered around each check of the row (`applied`):
                transformers' cache layer classes (made per session, so the class is the only place to
                change them) or a model class whose change the oracle must share. Undone on exit,
                whatever the check raised: nothing leaks into the next row.
  model_change  applied to the implementation's own model, after it is built (the oracle, another
                model of the same weights, stays transformers')

The implementation is a builder of its own (`implementation(entry)`, named "transformers+<entry>"):
transformers' runner of the family, then `model_change`. So a row is judged as any implementation of
the family is (against transformers' uncached forward of the same weights), never as transformers
itself (whose cache must hold what the family entry says: `family_storage.check_entry_bytes`). An
entry's `attention` builds that runner with one of transformers' attention implementations (the sdpa
rows: the change lives in the sdpa path; the oracle keeps eager attention, as for every family target).

Every entry needs transformers 5.x (its sliding-window layers, its latent cache, its experts
interface): `unavailable()` says why where it is not (transformers 4.55.4 keeps a window's whole
history and caches DeepSeek's expanded K/V: known failures, not catalogue rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# the kill matrix's family columns (each one family check, by property; family-P2 runs on the static
# path, where it compares the static path with the concat path, the others on the row's path)
FAMILY_COLUMNS = ("family-P1", "family-P2", "family-P3", "family-memory", "family-ops")


@dataclass(frozen=True)
class FamilyEntry:
    name: str
    family: str                 # the family the kill matrix's row runs (tests run some on other families too)
    variant: str                # the family's variant (its tiny config)
    path: str                   # the cache path of the row: concat or static
    why: str                    # one line: what the design does, or what is wrong with the variant
    origin: str                 # where it comes from
    patch: Callable[[str], contextlib.AbstractContextManager] | None = None  # (family name) -> context manager
    model_change: Callable[[torch.nn.Module], None] | None = None
    killed_by: tuple[str, ...] = ()  # variants: the family columns expected to kill it
    waits_for: str = ""         # variants: the check feature, not in this build, that will kill it (as Variant's)
    attention: str | None = None  # transformers' attention implementation of the row (implementations.ATTENTION)


def unavailable() -> str | None:
    """Why the family catalogue's rows cannot run here (None: they can)."""
    from mpt_kv.versions import transformers_version

    try:
        import transformers.cache_utils as utils
    except ImportError as e:
        return f"transformers is not installed ({e})"
    if int(transformers_version().split(".")[0]) < 5 or not hasattr(utils, "DynamicSlidingWindowLayer"):
        return (f"transformers {transformers_version()}: the family catalogue changes transformers 5.x's "
                "sliding-window and latent caches and its experts interface")
    return None


def implementation(entry: FamilyEntry):
    """The entry's implementation: a family-check builder (`mpt_kv.families.implementations`),
    transformers' runner of the family with the entry's `model_change` on its model."""
    from mpt_kv.families.implementations import transformers_runner

    def build(family, variant, dtype=torch.float32, *, seed=0, **options):
        runner = transformers_runner(family, variant, dtype, seed=seed, **options)  # options: the row's attention
        if entry.model_change is not None:
            entry.model_change(runner.model)
        return runner

    build.implementation_name = f"transformers+{entry.name}"
    return build


@contextlib.contextmanager
def applied(entry: FamilyEntry, family: str | None = None) -> Iterator[None]:
    """The entry's class patch (if any) for the duration, on `family` (default: the entry's)."""
    with entry.patch(family or entry.family) if entry.patch else contextlib.nullcontext():
        yield


def run(entry: FamilyEntry, check: str, path: str | None = None, family: str | None = None,
        variant: str | None = None, dtype: torch.dtype = torch.float32) -> list[str]:
    """One family check (`mpt_kv.checks.family.CHECKS`) on the entry's implementation, its patch
    applied around it; path: the row's (family-P2: static); family, variant: another family the
    change applies to (the tests run the window entries on gemma3 and gpt_oss too); dtype: the kill
    matrix's fp32, or bf16 (tests/test_family_catalogue.py runs every row in both)."""
    from mpt_kv.checks.family import CHECKS
    from mpt_kv.families import FAMILIES

    family = family or entry.family
    variant = variant or (entry.variant if family == entry.family else next(iter(FAMILIES[family].variants)))
    path = path or ("static" if check == "family-P2" else entry.path)
    with applied(entry, family):
        return CHECKS[check](implementation(entry), family, variant, path, dtype, attention=entry.attention)


@contextlib.contextmanager
def replaced(owner, attribute: str, value) -> Iterator[None]:
    """`owner.attribute = value` for the duration (a class's method: every instance's)."""
    missing = object()
    original = owner.__dict__.get(attribute, missing)  # an inherited one: deleted again after
    setattr(owner, attribute, value)
    try:
        yield
    finally:
        if original is missing:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, original)


def cache_utils():
    import transformers.cache_utils

    return transformers.cache_utils


# --- sliding windows: the window's bytes, P1 across the window edge ---------------------------------------------
# transformers 5.x's DynamicSlidingWindowLayer.update (cache_utils.py, 5.24.0 lines 222-259) concatenates
# the new K/V to the kept ones, returns the whole and keeps the last sliding_window - 1 positions, or
# everything while it records its past for a crop (assisted decoding)

def window_update(keep: int, copy: bool, lost_as_zeros: bool = False):
    """A DynamicSlidingWindowLayer.update that keeps its last `sliding_window + keep` positions
    (keep -1: what it needs), as copies or as views (slices) of the concatenated K/V, and returns
    what get_mask_sizes told the mask it would (lost_as_zeros: positions it no longer has, as zeros)."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        before = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        full_keys = torch.cat([self.keys, key_states], dim=-2)
        full_values = torch.cat([self.values, value_states], dim=-2)
        if self.record_past:  # kept whole until the crop rolls it back (transformers' own rule)
            self.keys, self.values = full_keys, full_values
        else:
            kept = self.sliding_window + keep
            self.keys, self.values = full_keys[:, :, -kept:, :], full_values[:, :, -kept:, :]
            if copy:
                self.keys, self.values = self.keys.clone(), self.values.clone()
        visible = min(before, self.sliding_window - 1) + key_states.shape[-2]  # as get_mask_sizes says
        lost = visible - full_keys.shape[-2]
        if lost_as_zeros and lost > 0:
            pad = (0, 0, lost, 0)
            full_keys, full_values = (torch.nn.functional.pad(t, pad) for t in (full_keys, full_values))
        return full_keys[:, :, -visible:, :], full_values[:, :, -visible:, :]

    return update


def window_layer(update):
    def patch(family: str):
        return replaced(cache_utils().DynamicSlidingWindowLayer, "update", update)

    return patch


def crop_keeps_history(self, tokens_to_remove: int) -> None:
    """DynamicSlidingWindowLayer.crop written as a full layer's (DynamicLayer.crop, copied out): the cropped
    positions go, the past recorded for the crop stays, never restricted back to sliding_window - 1
    (transformers 5.24.0 cache_utils.py:281-310 restricts it)."""
    if tokens_to_remove == 0 or not self.is_initialized:
        return
    n = abs(tokens_to_remove)
    self.keys, self.values = self.keys[..., :-n, :].clone(), self.values[..., :-n, :].clone()
    self.cumulative_length -= n


@contextlib.contextmanager
def window_crop_keeps_history(family: str) -> Iterator[None]:
    layer = cache_utils().DynamicSlidingWindowLayer
    with replaced(layer, "update", window_update(keep=-1, copy=True)), replaced(layer, "crop", crop_keeps_history):
        yield


def full_length_static_windows(family: str):
    """StaticSlidingWindowLayer built with the cache length as its window: a local layer's buffer
    as long as a global layer's (what a static cache without per-layer layouts allocates)."""
    layer = cache_utils().StaticSlidingWindowLayer
    original = layer.__dict__["__init__"]

    def full_length(self, max_cache_len, sliding_window, **kwargs):
        original(self, max_cache_len=max_cache_len, sliding_window=max_cache_len, **kwargs)

    return replaced(layer, "__init__", full_length)


# --- multi-head latent attention: P3's fused-projection rule on kv_a_proj_with_mqa ----------------------------

def store_first_as_given(self, key_states, value_states, *args, **kwargs):
    """DynamicLayer.update as transformers < 4.56 wrote it: the first K/V stored as they come (a
    view stays a view), then torch.cat."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return self.keys, self.values
    self.keys = torch.cat([self.keys, key_states], dim=-2)
    self.values = torch.cat([self.values, value_states], dim=-2)
    return self.keys, self.values


def cache_stores_first_as_given(family: str):
    return replaced(cache_utils().DynamicLayer, "update", store_first_as_given)


def latent_normed_on_read(model: torch.nn.Module) -> None:
    """Each MLA attention of `model` caches its latent as split from kv_a_proj_with_mqa's output and
    applies kv_a_layernorm when it reads the cache (expand_kv), not before writing it: the same
    values (the norm is per position), but the cached latent is a view of the fused output."""
    changed = 0
    for module in model.modules():
        if not (hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "expand_kv")):
            continue
        norm, expand = module.kv_a_layernorm, module.expand_kv
        module.kv_a_layernorm = torch.nn.Identity()
        module.expand_kv = lambda kv_nope, k_rot, norm=norm, expand=expand: expand(norm(kv_nope), k_rot)
        changed += 1
    if not changed:  # a change that changes nothing would pass as the entry: fail closed
        raise RuntimeError(f"latent_normed_on_read: {type(model).__name__} has no MLA attention (kv_a_proj_with_mqa "
                           "and expand_kv)")


# --- mixtures of experts: routing in a cached step sees only the new tokens -----------------------------------

def batched_mm_experts(model: torch.nn.Module) -> None:
    """transformers 5.x's `batched_mm` experts (integrations/moe.py, batched_mm_experts_forward) on
    `model` alone: every (token, chosen expert) pair one gathered matmul, static shapes, no loop over
    the experts hit; the oracle keeps the model's default (transformers 5.24.0: grouped_mm, tokens
    sorted by expert)."""
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and getattr(m, "config", None) is not None]
    if not experts:  # fail closed: no experts module dispatches on the config here
        raise RuntimeError(f"batched_mm_experts: {type(model).__name__} has no experts module of transformers' "
                           "experts interface")
    for module in [model, *experts]:
        module.config._experts_implementation = "batched_mm"


EXPERT_CAPACITY = 2  # per expert, row and call: the tiny prompt (up to 6 tokens x 2 of 4 experts) overflows it


@contextlib.contextmanager
def capacity_routing(family: str) -> Iterator[None]:
    """The sparse MoE block of `family` (mixtral) with Switch Transformers' expert capacity on top
    of its top-2 routing: in each row, a real token's choice of an expert is dropped (its weight 0)
    once EXPERT_CAPACITY earlier real tokens of the call chose that expert (padding ignored, as
    Switch's router_ignore_padding_tokens: the call's columns of the causal LM's 2D attention_mask).
    The oracle routes the same way: its uncached forward is causal, the cached steps are not."""
    module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["_"])
    block = next((getattr(module, n) for n in dir(module) if n.endswith("SparseMoeBlock")), None)
    causal_lm = next((getattr(module, n) for n in dir(module) if n.endswith("ForCausalLM")), None)
    if block is None or causal_lm is None:
        raise ValueError(f"capacity_routing: {module.__name__} has no *SparseMoeBlock and *ForCausalLM to change")
    call = {}
    lm_forward = causal_lm.__dict__["forward"]

    def keep_mask(self, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        mask = kwargs.get("attention_mask")
        past = cache.get_seq_length() if cache is not None else 0
        length = (args[0] if args else kwargs["input_ids"]).shape[1]
        # the call's columns of the 2D mask (the static path pads it to the cache length)
        call["real"] = None if mask is None or mask.dim() != 2 else mask[:, past:past + length].bool()
        return lm_forward(self, *args, **kwargs)

    def forward(self, hidden_states):
        batch, length, width = hidden_states.shape
        flat = hidden_states.reshape(-1, width)
        _, weights, index = self.gate(flat)
        experts, top = self.experts.num_experts, index.shape[-1]
        real = call.get("real")
        if real is None or real.shape != (batch, length):
            real = torch.ones(batch, length, dtype=torch.bool)
        # Switch's token_priority: a cumsum of each expert's choices over the call's positions, per row
        chosen = torch.nn.functional.one_hot(index, experts).reshape(batch, length, top, experts)
        chosen = chosen * real[:, :, None, None]
        priority = (chosen.reshape(batch, length * top, experts).cumsum(1)
                    * chosen.reshape(batch, length * top, experts)).sum(-1).reshape(batch * length, top)
        over = priority > EXPERT_CAPACITY
        # a dropped choice weighs 0 (its expert's output times 0). Not the "no expert" index (num_experts):
        # transformers 5.24's grouped_mm experts leave such rows uninitialized unless expert-parallel
        # (integrations/moe.py:452-470), and 0 x NaN garbage is NaN: the prefill failed at random
        weights = weights.masked_fill(over, 0.0)
        return self.experts(flat, index, weights).reshape(batch, length, width)

    with replaced(causal_lm, "forward", keep_mask), replaced(block, "forward", forward):
        yield


# --- multi-head latent attention: the latent and the rope key in one cached tensor (issue 49) --------------------

def one_tensor(update):
    """A cache layer's update that stores the latent and the rope key part side by side in its key tensor,
    (B, 1, T, kv_lora_rank + qk_rope_head_dim), and a value tensor of zero width (B, 1, T, 0), and hands
    attention the two parts as views of it: vLLM's MLA cache layout (one kv_c_and_k_pe tensor per layer)."""

    def combined(self, key_states, value_states, *args, **kwargs):
        width = key_states.shape[-1]
        both = torch.cat([key_states, value_states], dim=-1)
        keys, _ = update(self, both, both.new_empty(*both.shape[:-1], 0), *args, **kwargs)
        return keys[..., :width], keys[..., width:]

    return combined


@contextlib.contextmanager
def latent_and_rope_in_one(family: str) -> Iterator[None]:
    utils = cache_utils()
    with replaced(utils.DynamicLayer, "update", one_tensor(utils.DynamicLayer.update)), \
            replaced(utils.StaticLayer, "update", one_tensor(utils.StaticLayer.update)):
        yield


# --- the sdpa path: when transformers skips the mask (is_causal instead), and how the kernel groups heads -----------
# transformers 5.24.0 masking_utils.py `_ignore_causal_mask_sdpa` (lines 252-301): where no row is padded and the
# call has one query or as many queries as keys, sdpa_mask returns None and sdpa_attention_forward calls the kernel
# with is_causal (upper-left aligned: right only where queries and keys start together) or with no mask at all

def mask_skip(rule):
    """masking_utils._ignore_causal_mask_sdpa replaced by `rule(padding_mask, q_length, kv_length, q_offset)`
    (True: no mask, is_causal where q_length > 1), for the row's duration: the sdpa path alone reads it
    (the eager path's mask never skips: allow_is_causal_skip=False)."""
    def patch(family: str):
        import transformers.masking_utils as masking

        def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
            if padding_mask is not None and padding_mask.shape[-1] > kv_length:  # as the original slices it
                padding_mask = padding_mask[:, torch.arange(kv_length, device=padding_mask.device) + kv_offset]
            if local_attention_size is not None and kv_length >= local_attention_size:
                return False  # a window needs its mask (the original's rule, kept)
            return rule(padding_mask, q_length, kv_length, q_offset)

        return replaced(masking, "_ignore_causal_mask_sdpa", ignore)

    return patch


def unpadded(padding_mask) -> bool:
    return padding_mask is None or bool(padding_mask.all())


def gqa_in_the_kernel(family: str):
    """sdpa_attention_forward asks the kernel to group the query heads (`enable_gqa=True`) instead of
    repeating K and V to every query head (repeat_kv) or packing a decode step's heads (pack_gqa): what it
    does on XPU and MPS, or with TRANSFORMERS_SDPA_FORCE_GQA=1 (integrations/sdpa_attention.py:42-54)."""
    import transformers.integrations.sdpa_attention as sdpa

    return replaced(sdpa, "use_gqa_in_sdpa", lambda attention_mask, key, value: True)


# --- the catalogues ---------------------------------------------------------------------------------------------

TRANSFORMERS_WINDOW = "transformers 5.24.0 cache_utils.py:246 (DynamicSlidingWindowLayer.update)"

FAMILY_DESIGNS: dict[str, FamilyEntry] = {e.name: e for e in (
    FamilyEntry(
        "window_copied", "gemma2", "hybrid-window4", "concat",
        "the local layers' DynamicSlidingWindowLayer keeps its last sliding_window - 1 positions as copies of "
        "their own: the window's bytes, nothing pinned (family-P3 and family-memory count the window, not the "
        "history)",
        f"{TRANSFORMERS_WINDOW} with .clone() on the kept slice: what the slice should be",
        patch=window_layer(window_update(keep=-1, copy=True))),
    FamilyEntry(
        "window_slots_static", "gemma2", "hybrid-window4", "static",
        "transformers' hybrid StaticCache: sliding_window slots for the local layer, the cache length for the "
        "global one, written in place (family-memory's analytic bytes per layer; family-P2 judges the window "
        "layer by its logits)",
        "transformers 5.24.0 cache_utils.py:524 (StaticSlidingWindowLayer), unchanged"),
    FamilyEntry(
        "latent_cached", "deepseek_v2", "mla", "concat",
        "multi-head latent attention caches the normed latent (kv_lora_rank) and the rotated rope key part, "
        "tensors of their own: family-memory's latent bytes, family-P3's fused-projection rule on "
        "kv_a_proj_with_mqa holds",
        "transformers 5.24.0 models/deepseek_v2/modeling_deepseek_v2.py:386-396, unchanged"),
    FamilyEntry(
        "experts_batched_mm", "mixtral", "moe-2of4", "concat",
        "transformers' batched_mm experts: each (token, chosen expert) pair one gathered matmul, static shapes "
        "(no grouping by expert), routing per token: another summation order than the oracle's grouped_mm, the "
        "same values within family-P1's tolerance; the cache is the attention's alone",
        "transformers 5.24.0 integrations/moe.py:112 (batched_mm_experts_forward), config._experts_implementation",
        model_change=batched_mm_experts),
    FamilyEntry(
        "latent_and_rope_in_one_tensor", "deepseek_v2", "mla", "concat",
        "multi-head latent attention caches the latent and the rope key part side by side in one tensor per layer, "
        "(B, 1, T, kv_lora_rank + qk_rope_head_dim), and a value of zero width (B, 1, T, 0) beside it: the latent's "
        "bytes in one storage, an empty tensor compared and counted as one (family-P2: static and concat alike)",
        "vLLM's MLA attention backends (one kv_c_and_k_pe_cache tensor per layer); transformers 5.24.0 "
        "cache_utils.py:119 (DynamicLayer.update) and :462 (StaticLayer.update) given the two parts as one",
        patch=latent_and_rope_in_one),
    FamilyEntry(
        "sdpa_mask_always_built", "llama", "gqa", "concat",
        "the sdpa path never skips the mask: every call gets the materialized causal and padding mask, no "
        "is_causal (what transformers does while tracing or exporting): the same values as the skip's kernel "
        "calls",
        "transformers 5.24.0 masking_utils.py:280-281 (`_ignore_causal_mask_sdpa` returns False under export)",
        patch=mask_skip(lambda padding_mask, q_length, kv_length, q_offset: False), attention="sdpa"),
    FamilyEntry(
        "sdpa_gqa_in_the_kernel", "llama", "gqa", "concat",
        "the sdpa path hands the kernel the K/V heads as cached and `enable_gqa=True`, instead of repeat_kv's "
        "expanded copies or a decode step's packed query heads: the same attention, grouped inside the kernel",
        "transformers 5.24.0 integrations/sdpa_attention.py:42-54 and :118-127 (use_gqa_in_sdpa: XPU, MPS, "
        "TRANSFORMERS_SDPA_FORCE_GQA=1)",
        patch=gqa_in_the_kernel, attention="sdpa"),
)}

FAMILY_VARIANTS: dict[str, FamilyEntry] = {e.name: e for e in (
    FamilyEntry(
        "window_slice_pins_evicted", "gemma2", "hybrid-window4", "concat",
        "the local layer keeps its window as a slice of the concatenated K/V: a view whose storage holds every "
        "evicted position of the call",
        f"{TRANSFORMERS_WINDOW} itself (a known failure of transformers 5.24.0, "
        "mpt_kv/findings/family_known_failures.json)",
        patch=window_layer(window_update(keep=-1, copy=False)), killed_by=("family-P3", "family-memory")),
    FamilyEntry(
        "window_one_too_many", "gemma2", "hybrid-window4", "concat",
        "the window keeps sliding_window positions, one more than its queries need (sliding_window - 1): right "
        "values, a position of K/V per row and layer too many",
        "an off-by-one in the window's slice ([-w:] for [-w + 1:]): the window's analytic bytes see it",
        patch=window_layer(window_update(keep=0, copy=True)), killed_by=("family-memory",)),
    FamilyEntry(
        "window_one_short", "gemma2", "hybrid-window4", "concat",
        "the window keeps sliding_window - 2 positions, one too few, and stands zeros in for the one it lost: "
        "exact until a query needs all sliding_window - 1 positions before it, wrong from the first call past "
        "the window's edge",
        "the opposite off-by-one ([-w + 2:]): family-P1 across the window edge sees it",
        patch=window_layer(window_update(keep=-2, copy=True, lost_as_zeros=True)), killed_by=("family-P1",)),
    FamilyEntry(
        "window_static_full_length", "gemma2", "hybrid-window4", "static",
        "the static cache gives the local layer a buffer of the cache length, as the global layer's: right "
        "values, the window layer's bytes those of the whole history",
        "a static cache without per-layer layouts (transformers 4.55.4's StaticCache preallocates every layer "
        "to the cache length)",
        patch=full_length_static_windows, killed_by=("family-memory",)),
    FamilyEntry(
        "latent_view_of_fused_projection", "deepseek_v2", "mla", "concat",
        "the latent is cached as split from kv_a_proj_with_mqa's output (its norm applied when read: the same "
        "values) in a cache that stores the first K/V as given: the cached latent pins the rope part of the "
        "fused output",
        "the seed bug class on the latent projection: transformers < 4.56's DynamicLayer stored the first K/V "
        "as given; caching the latent before kv_a_layernorm makes it a view",
        patch=cache_stores_first_as_given, model_change=latent_normed_on_read,
        killed_by=("family-P3", "family-memory")),
    FamilyEntry(
        "routing_capacity_not_cached", "mixtral", "moe-2of4", "concat",
        f"Switch Transformers' expert capacity ({EXPERT_CAPACITY} tokens per expert per row, in position order) "
        "on top of the top-2 routing, with no per-expert counts in the cache: a cached step routes as if the "
        "history were empty, the uncached forward drops the choices past capacity",
        "transformers 5.24.0 models/switch_transformers/modeling_switch_transformers.py:105-109 "
        "(SwitchTransformersTop1Router: token_priority, a cumsum over the call's positions)",
        patch=capacity_routing, killed_by=("family-P1",)),
    FamilyEntry(
        "window_keeps_history_after_crop", "gemma2", "hybrid-window4", "concat",
        "the window (window_copied) is cropped as a full layer is: the cropped positions go, but the past it kept for "
        "the crop (from the k-token call on) stays, never restricted back to sliding_window - 1: right values, the "
        "window layer's bytes those of its history after every crop",
        "DynamicSlidingWindowLayer.crop written as DynamicLayer.crop (transformers 5.24.0 cache_utils.py:164 for "
        ":281-310), or a window cache that records its past for assisted decoding and forgets to drop it",
        patch=window_crop_keeps_history, killed_by=("family-memory",)),
    FamilyEntry(
        "sdpa_is_causal_with_a_cache", "llama", "gqa", "concat",
        "the sdpa path skips the mask whenever no row is padded, a cached call of several tokens too: the kernel "
        "gets is_causal, upper-left aligned, so the k new queries see the cache's first positions (sliced to k "
        "keys), not their own history",
        "the skip rule without its `q_length == 1 or kv_length == q_length` condition (transformers 5.24.0 "
        "masking_utils.py:292): an extend (assisted decoding's k-token call, a chunked prefill) of an unpadded batch",
        patch=mask_skip(lambda padding_mask, q_length, kv_length, q_offset: unpadded(padding_mask)),
        killed_by=("family-P1",), attention="sdpa"),
    FamilyEntry(
        "sdpa_decode_mask_dropped", "llama", "gqa", "concat",
        "the sdpa path drops the mask of every one-token call, padded rows too: a left-padded row's decode step "
        "attends its padding positions (and on a StaticCache every unwritten slot), only on the sdpa path (the "
        "eager one builds its mask)",
        "the skip rule without its padding condition (transformers 5.24.0 masking_utils.py:292: `padding_mask is "
        "None or fast_all(padding_mask)`): batched generation of prompts of different lengths",
        patch=mask_skip(lambda padding_mask, q_length, kv_length, q_offset: q_length == 1 or (
            kv_length == q_length and unpadded(padding_mask))),
        killed_by=("family-P2", "family-ops"), attention="sdpa"),
)}


def entry(name: str) -> FamilyEntry:
    """A design or variant of the family catalogue; an unknown name is a KeyError naming them."""
    found = FAMILY_DESIGNS.get(name) or FAMILY_VARIANTS.get(name)
    if found is None:
        raise KeyError(f"unknown family catalogue entry {name!r}: designs {list(FAMILY_DESIGNS)}, "
                       f"variants {list(FAMILY_VARIANTS)}")
    return found


__all__ = ["FAMILY_COLUMNS", "FAMILY_DESIGNS", "FAMILY_VARIANTS", "FamilyEntry", "applied", "entry",
           "implementation", "run", "unavailable"]
