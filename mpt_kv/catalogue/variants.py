"""Known-bad variants of the reference: the regressions the suite must kill.

Each variant is the reference with ONE small change that real KV-cache code has had or could
easily get (assembled as in assembly.py), says where such a bug comes from, and names the
kill-matrix columns expected to kill it. `python -m mpt_kv killmatrix` runs every check against
every variant and fails if one survives; a survivor means a missing or weak test: strengthen
the test, never delete the variant. Its twin catalogue, designs.py, holds legitimate designs
that must pass every check.

A variant whose killer is a check feature this build lacks says so in `waits_for`; the kill
matrix then reports its survival as waiting (not a failure), and fails the day the expected
killer kills it, until the `waits_for` line goes (as a strict xfail does).

Every variant is also a target factory, so the whole pytest suite can run against it:

    pytest --target mpt_kv.catalogue.variants:kv_views_of_mixed_qkv --only-targets
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mpt_kv.checks import index
from mpt_kv.catalogue.assembly import (StaticAt, StaticDecode, StaticOutputMPT, attention_forward, attention_with,
                                       model_with, runner_factory)
from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.reference import Attention, ReferenceMPT, alibi_bias
from mpt_kv.targets import Capabilities
from mpt_kv.targets.reference import ReferenceSession

# The kill-matrix columns: the index's (mpt_kv.checks.index.COLUMNS): P0-P4, static-shape, memory,
# ops (extend, crop and reorder programs: ops-P1/P2/P3 and the reorder transient).
COLUMNS = index.COLUMNS


@dataclass(frozen=True)
class Variant:
    name: str
    bug: str                      # one line: what is wrong
    origin: str                   # which real code had it, or how it easily gets in
    killed_by: tuple[str, ...]    # kill-matrix columns expected to catch it
    build: Callable               # (cfg, state_dict, device, dtype) -> Runner
    waits_for: str = ""           # the check feature, not in this build, that will kill it
    dtype: torch.dtype | None = None  # the dtype the kill matrix runs the row in (None: the matrix's, fp32)


VARIANTS: dict[str, Variant] = {}


def variant(name, bug, origin, killed_by, waits_for="", dtype=None, capabilities=Capabilities(), **pieces):
    """Register a variant and return its factory (also a module attribute of the same name); `dtype`:
    the kill matrix runs its row in that dtype (a bug that exists only there); `capabilities`: what
    the target declares (a bf16-only target declares fp32 unsupported)."""
    session_class = pieces.pop("session", ReferenceSession)
    model_class = pieces.pop("model", None) or model_with(**pieces)
    build = runner_factory(name, model_class, session_class, capabilities=capabilities, module=__name__)
    VARIANTS[name] = Variant(name, bug, origin, tuple(killed_by), build, waits_for, dtype)
    return build


# --- K/V kept as views: pinned memory (P3, memory) ---------------------------------------------------

class ViewsConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            self.kv[layer] = (k, v)  # no clone: both pin the whole (B, T, 3D) mixed_qkv
            return self.kv[layer]
        return super().update(layer, k, v)


kv_views_of_mixed_qkv = variant(
    "kv_views_of_mixed_qkv",
    "prefill stores k, v as views of mixed_qkv: the whole fused (B, T, 3D) buffer, q third included, stays alive",
    "optimum-habana's MPT before the seed PR ('refine use cache for mpt model'); transformers 4.55 DynamicCache stores the first K/V as is",
    ["P3", "memory"], concat=ViewsConcatCache)


class OnlyVClonedConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            self.kv[layer] = (k, v.clone())  # k still a view of mixed_qkv
            return self.kv[layer]
        return super().update(layer, k, v)


only_v_cloned = variant(
    "only_v_cloned",
    "prefill clones v but stores k as a view of mixed_qkv: half a fix, the fused buffer is still pinned",
    "a partial version of the seed PR's fix (clone added to one of the two tensors)",
    ["P3", "memory"], concat=OnlyVClonedConcatCache)


class ContiguousConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            # .contiguous() returns the tensor itself when it already is contiguous, and the
            # (1, H, 1, hd) k of a one-token, one-row prompt is: it stays a view of mixed_qkv
            self.kv[layer] = (k.contiguous(), v.contiguous())
            return self.kv[layer]
        return super().update(layer, k, v)


contiguous_is_not_always_a_copy = variant(
    "contiguous_is_not_always_a_copy",
    "prefill stores k.contiguous(), v.contiguous(): for a one-token, one-row prompt they already are "
    "contiguous, so they stay views of mixed_qkv",
    "the `.transpose(1, 2).contiguous()` idiom used as a copy; a no-op on a tensor that is already "
    "contiguous (size-1 dimensions make the (1, H, 1, hd) slice so)",
    ["P3"], concat=ContiguousConcatCache)


class KeepsOldConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        self.previous = getattr(self, "previous", [None] * len(self.kv))
        self.previous[layer] = self.kv[layer]  # the pre-cat cache stays referenced: 2x memory
        return super().update(layer, k, v)


old_cache_kept_referenced = variant(
    "old_cache_kept_referenced",
    "the cache before torch.cat stays referenced after the step: every decode step holds the cache twice",
    "transformers issue 'forward pass consumes 2x memory': the old past_key_values kept alive",
    ["memory"], concat=KeepsOldConcatCache)


class WrongDimConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            return super().update(layer, k, v)
        old_k, old_v = self.kv[layer]
        self.kv[layer] = (torch.cat([old_k, k], dim=1), torch.cat([old_v, v], dim=1))  # heads, not sequence
        return self.kv[layer]


cat_on_wrong_dim = variant(
    "cat_on_wrong_dim",
    "decode concatenates along dim 1 (heads) instead of dim 2 (sequence)",
    "a layout mix-up between (B, T, H, hd) and (B, H, T, hd) caches",
    ["P1"], concat=WrongDimConcatCache)


# --- the static (index_copy_) path ------------------------------------------------------------------

class OffByOneStaticCache(StaticDecode):
    def _decode(self, ck, cv, k, v, token_idx):
        return ck.index_copy_(2, token_idx, k), cv.index_copy_(2, token_idx, v)  # token_idx is 1-based


index_copy_at_token_idx = variant(
    "index_copy_at_token_idx",
    "decode writes slot token_idx instead of token_idx - 1 (token_idx is 1-based)",
    "the 1-based token_idx of optimum-habana's static path; an easy off-by-one",
    ["P1", "P2"], static=OffByOneStaticCache)


class StaleStaticCache(StaticDecode):
    def _decode(self, ck, cv, k, v, token_idx):
        return ck, cv  # the new token's k, v are never written


static_cache_not_written = variant(
    "static_cache_not_written",
    "decode attends over the static cache without writing the new token's k, v into it (stale cache)",
    "an update that writes into a temporary (e.g. a copy or an out-of-place result that is dropped)",
    ["P1", "P2"], static=StaleStaticCache)


class SwappedStaticCache(StaticDecode):
    def _decode(self, ck, cv, k, v, token_idx):
        return ck.index_copy_(2, token_idx - 1, v), cv.index_copy_(2, token_idx - 1, k)


kv_swapped_in_static_decode = variant(
    "kv_swapped_in_static_decode",
    "the static decode step writes v into the key cache and k into the value cache (concat path is right)",
    "two near-identical index_copy_ lines; the concat path and prefill hide it",
    ["P1", "P2"], static=SwappedStaticCache)


class ReallocatingStaticCache(StaticDecode):
    def _decode(self, ck, cv, k, v, token_idx):
        # out-of-place index_copy: same values, a fresh buffer every step
        return ck.index_copy(2, token_idx - 1, k), cv.index_copy(2, token_idx - 1, v)


static_cache_reallocated = variant(
    "static_cache_reallocated",
    "the static cache is rebuilt every decode step (out-of-place index_copy): right values, storage moves",
    "functional-style cache updates; breaks HPU/CUDA graphs, which replay against the captured addresses",
    ["static-shape"], static=ReallocatingStaticCache)


class WrittenPrefixStaticCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        decode = self.prefilled[layer]
        ck, cv = super().update(layer, k, v, token_idx, cache_idx)
        if not decode:
            return ck, cv
        n = int(token_idx.reshape(-1)[0])
        return ck[:, :, :n], cv[:, :, :n]  # attend over written slots only: the shape grows each step


static_sliced_to_written_length = variant(
    "static_sliced_to_written_length",
    "static decode attends over the written prefix [0, token_idx) only: right values, a new shape every step",
    "an 'optimisation' that skips the masked tail; every step is a new graph on HPU and a new CUDA graph capture",
    ["static-shape", "graph-capture"], static=WrittenPrefixStaticCache)


class HostPositionSession(ReferenceSession):
    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        host = None if token_idx is None else int(token_idx.reshape(-1)[0])  # .item(): a host sync
        return super()._forward(input_ids, mask, host, cache_idx)


class HostPositionStaticCache(StaticDecode):
    def _decode(self, ck, cv, k, v, token_idx):
        idx = torch.tensor([token_idx - 1], device=ck.device)  # a new constant each step
        return ck.index_copy_(2, idx, k), cv.index_copy_(2, idx, v)


static_position_as_python_int = variant(
    "static_position_as_python_int",
    "the decode position travels as a Python int (token_idx.item()), made a tensor again inside: right values",
    "a seen-tokens counter / past length kept on the host; a captured graph bakes in the first step's position",
    ["static-shape", "graph-capture"], static=HostPositionStaticCache, session=HostPositionSession)


class FiniteGuardStaticCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.prefilled[layer] and not bool(torch.isfinite(k).all()):  # bool() of a device tensor: a host sync
            raise FloatingPointError("a non-finite key reached the static cache")
        return super().update(layer, k, v, token_idx, cache_idx)


host_sync_in_static_decode = variant(
    "host_sync_in_static_decode",
    "the static decode step guards its write with `if not bool(torch.isfinite(k).all())`: right values, same "
    "shapes and scalars, but a host sync in every layer of every step",
    "a debug assert / NaN guard left in the cache update (`assert torch.isfinite(x).all()`, `if x.any():`); "
    "eager runs never show it, HPU/CUDA graph pipelines stall on it every step",
    ["static-shape", "graph-capture"], static=FiniteGuardStaticCache)


class BucketOffByOneStaticCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if not self.prefilled[layer] or cache_idx is None:
            return super().update(layer, k, v, token_idx, cache_idx)
        ck, cv = super().update(layer, k, v, token_idx, None)
        return ck[:, :, :cache_idx - 1], cv[:, :, :cache_idx - 1]


cache_idx_off_by_one = variant(
    "cache_idx_off_by_one",
    "bucketed decode attends over cache_idx - 1 slots: at a bucket boundary the new token's own key is cut off",
    "cache_idx slicing ([:cache_idx] vs [:cache_idx - 1]) in optimum-habana's bucketed path",
    ["P1", "P2"], static=BucketOffByOneStaticCache)


class UninitializedStaticModel(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        return super().new_cache(path, batch, max_len, float("nan") if fill is None else fill)


static_cache_uninitialized = variant(
    "static_cache_uninitialized",
    "static cache allocated with torch.empty (modelled as NaN): a never-written, masked slot spreads NaN via 0 * v",
    "optimum-habana's cache_idx path allocates torch.empty (measured: NaN there reaches the output through 0 * v)",
    ["P1"], model=UninitializedStaticModel)


class StaleMaskSession(ReferenceSession):
    """Static decode with the mask of the prefill: the slot of each new token is never switched on."""

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.cache is not None and self.path == "static":
            self.prompt_len = getattr(self, "prompt_len", self.written)  # the prefill mask is 0 from here on
            mask = mask.clone()
            mask[:, self.prompt_len:] = 0
        return super()._forward(input_ids, mask, token_idx, cache_idx)


static_mask_not_extended = variant(
    "static_mask_not_extended",
    "static generation passes the prefill's mask every step: each new token's slot stays masked",
    "optimum-habana's static generation must extend the mask every step (without it stale slots are attended); forgetting it is silent",
    ["P1", "P2"], session=StaleMaskSession)


# --- attention --------------------------------------------------------------------------------------

class NoClampInDecode(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, clamp=x.shape[1] > 1)


clip_qkv_prefill_only = variant(
    "clip_qkv_prefill_only",
    "clip_qkv clamps mixed_qkv in prefill only; the one-token decode path skips it",
    "a separate fast decode path (fused kernel) written without MPT's clip_qkv",
    ["P1"], attention=NoClampInDecode)


class QueryLengthAlibi(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, bias_len=x.shape[1])


alibi_not_offset_for_cache = variant(
    "alibi_not_offset_for_cache",
    "ALiBi sliced to the query length, not the key length: in decode one column broadcasts, cached keys lose their offsets",
    "transformers' MptAttention slices position_bias[:, :, size - key_length:]; query_length there looks the same in prefill",
    ["P1"], attention=QueryLengthAlibi)


class NoMaskInDecode(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, drop_mask=x.shape[1] == 1)


decode_ignores_attention_mask = variant(
    "decode_ignores_attention_mask",
    "one-token decode skips the mask ('a single query is causal anyway'): left padding is attended",
    "the q_len == 1 shortcut of fast attention paths (is_causal / mask dropped), wrong under left padding",
    ["P1"], attention=NoMaskInDecode)


class Bf16Softmax(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, softmax_dtype=torch.bfloat16)


softmax_in_bf16 = variant(
    "softmax_in_bf16",
    "attention softmax computed in bf16 inside an fp32 model (MPT upcasts to fp32)",
    "optimum-habana's --attn_softmax_bf16 (the seed PR's benchmark command) leaking into a full-precision run",
    ["P0"], attention=Bf16Softmax)


class MinusTenThousandMask(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, additive_mask=True)


additive_mask_minus_1e4 = variant(
    "additive_mask_minus_1e4",
    "mask added as -1e4 instead of filled with finfo.min: a large stale value in a masked slot still wins",
    "the (1 - mask) * -10000.0 idiom of older transformers models",
    ["P2"], attention=MinusTenThousandMask)


# --- lengths, head sizes and positions far from the tiny drawn cases (issue 11) --------------------

sliding_window_16 = variant(
    "sliding_window_16",
    "decode attends only the last 16 positions (a sliding window below max_seq_len): exact until "
    "the sequence passes 16 tokens",
    "a rolling-buffer cache or `sliding_window` setting (Mistral's; transformers' SlidingWindowCache) "
    "reached by a model that has no window, through a shared cache class or config default",
    ["P1"], attention=attention_with(window=16))


class FusedPathForLargeHeads(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        fast = x.shape[1] == 1 and self.cfg.head_dim >= 32  # the kernel's supported head sizes
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, sdpa_without_alibi=fast)


fused_decode_drops_alibi_for_large_heads = variant(
    "fused_decode_drops_alibi_for_large_heads",
    "for head_dim >= 32, decode takes a fused attention kernel (scaled_dot_product_attention with "
    "the bool mask) that has no bias input: ALiBi is dropped",
    "kernels dispatch on head size (a fused kernel is taken only for the head sizes it supports; MPT-7B has "
    "head_dim 128) and many take no arbitrary bias; the tiny drawn cases (head_dim 4-16) never take that path",
    ["P1"], attention=FusedPathForLargeHeads)


class Bf16PositionStaticCache(StaticAt):
    def _slot(self, token_idx):
        # bf16 has 8 significant bits: from 256 on, odd positions round to even ones
        return (token_idx - 1).to(torch.bfloat16).long()


position_in_bf16 = variant(
    "position_in_bf16",
    "the static decode slot (token_idx - 1) passes through a bf16 tensor: from position 257 on, odd "
    "positions round to even, and the new k, v overwrite a neighbour's slot",
    "positions kept in a float tensor of the model's dtype (`torch.arange(..., dtype=hidden.dtype)`, a "
    "cumsum of a bf16 mask); integers above 256 are not exact in bf16",
    ["P1", "P2"], static=Bf16PositionStaticCache)


class PreviousBucketStaticCache(StaticCache):
    BUCKET = 128  # optimum-habana's usual --bucket_size

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if not self.prefilled[layer] or cache_idx is None:
            return super().update(layer, k, v, token_idx, cache_idx)
        ck, cv = super().update(layer, k, v, token_idx, None)
        # the bucket of the previous position: right inside a bucket, one short at its first slot
        previous = int(token_idx.reshape(-1)[0]) - 1
        n = min(-(-previous // self.BUCKET) * self.BUCKET, int(cache_idx))
        return ck[:, :, :n], cv[:, :, :n]


bucket_of_previous_position = variant(
    "bucket_of_previous_position",
    "bucketed decode (buckets of 128) attends over the bucket of the previous position: at token_idx "
    "129, 257, ... the new token's own key is cut off",
    "optimum-habana recomputes cache_idx only when the bucket index changes (`prev_idx`, generation/utils.py); "
    "computing it before token_idx advances is right everywhere except the first slot of each bucket",
    ["P1", "P2"], static=PreviousBucketStaticCache)


class LastSlotClampedCache(StaticAt):
    def _slot(self, token_idx):
        return (token_idx - 1).clamp(max=self.last_slot)


class LastSlotClampedModel(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        cache = super().new_cache(path, batch, max_len, fill)
        if path == "static":
            cache.__class__, cache.last_slot = LastSlotClampedCache, self.cfg.max_seq_len - 2  # meant: - 1
        return cache


last_slot_clamped = variant(
    "last_slot_clamped",
    "the static decode slot is clamped to max_seq_len - 2 (a guard meant to keep it inside ALiBi's "
    "range, off by one): the token at the last slot overwrites the one before",
    "overflow guards at the end of the cache (min(pos, max_len - 1) written with the wrong bound); only "
    "a generation that reaches max_seq_len takes it",
    ["P1", "P2"], model=LastSlotClampedModel)


# --- state across calls and generations, mask dtypes (issue 12) --------------------------------------

shared_output_buffer = variant(
    "shared_output_buffer",
    "every call returns its logits in one preallocated buffer per shape, which the next call of that "
    "shape overwrites, without declaring it (Capabilities(graph_outputs=True))",
    "CUDA graphs and HPU graphs (optimum-habana's --use_hpu_graphs): a replay returns the graph's static "
    "output; a check holding the last result compares a buffer with itself",
    ["P4"], model=StaticOutputMPT)


class MaskBufferMPT(ReferenceMPT):
    """Static path: the attention mask lives in one preallocated buffer, updated in place each step
    (fixed shape and address, as graphs want); it is filled only when (re)allocated."""

    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if isinstance(cache, StaticCache) and attention_mask is not None:
            buf = getattr(self, "mask_buffer", None)
            if not cache.prefilled[0]:
                if buf is None or buf.shape != (input_ids.shape[0], cache.max_len):
                    buf = self.mask_buffer = torch.zeros(input_ids.shape[0], cache.max_len, dtype=torch.long,
                                                         device=input_ids.device)
                    buf[:, :attention_mask.shape[1]] = attention_mask  # bug: a reused buffer is not refilled
            else:
                buf.index_fill_(1, token_idx.reshape(-1) - 1, 1)  # the new token's slot
            attention_mask = buf[:, :attention_mask.shape[1]]
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


mask_buffer_not_refilled = variant(
    "mask_buffer_not_refilled",
    "the static path keeps the attention mask in a buffer on the model, refilled only when its shape "
    "changes: the next generation of the same shape runs with the previous one's padding",
    "graph-friendly generation keeps masks in preallocated buffers updated in place (index_fill_ at "
    "token_idx); reallocation is the only refill",
    ["P1", "P2"],
    model=MaskBufferMPT)


class PositionCounterMPT(ReferenceMPT):
    """The position of the next token is counted on the model, from 0 when it is built."""

    def _positions(self, T, cache, token_idx, cache_idx):
        start, K = super()._positions(T, cache, token_idx, cache_idx)
        if cache is None or (isinstance(cache, StaticCache) and cache.prefilled[0]):
            return start, K  # uncached forwards and token_idx steps take their position as given
        start = self.seen_tokens = getattr(self, "seen_tokens", 0)  # never reset for a new generation
        self.seen_tokens += T
        return start, K


position_counter_across_generations = variant(
    "position_counter_across_generations",
    "the query position of cached calls comes from a counter on the model that is never reset: the "
    "second generation's prompt sits past its own keys and sees the future",
    "a seen-tokens / cache_position counter kept on the model (or a module) instead of the cache or "
    "the generation; one generation per model instance never shows it",
    ["P1"], model=PositionCounterMPT)


class BoolMaskAsKeyPaddingMPT(ReferenceMPT):
    """A bool mask is read as a key_padding_mask (True = ignore); integer masks stay 1 = attend."""

    def __init__(self, cfg):
        super().__init__(cfg)
        # the reference rejects a mask row with nothing to attend to; a misread, full row is one
        # (a target without that check attends nothing there): leave the misread to the checks
        self.validate = False

    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = ~attention_mask
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


bool_mask_inverted = variant(
    "bool_mask_inverted",
    "a bool attention_mask is read the other way round (True = padding, nn.MultiheadAttention's "
    "key_padding_mask convention); integer masks are right",
    "bool masks have both conventions in torch (SDPA attn_mask: True = attend; key_padding_mask and "
    "transformers' internal MPT mask: True = masked); a suite that only feeds long masks never sees it",
    ["P0"], model=BoolMaskAsKeyPaddingMPT)


PlainAttention = attention_with()


def no_change(cfg, state_dict, device, dtype):
    """Not a variant: the reference assembled the way variants are (`attention_forward` with no
    knob turned, the class swaps of `model_with`). tests/test_variants.py registers it to prove
    the kill matrix says 'survived' for a model that is right, and that the assembly alone
    changes nothing, so each variant's kill is its one change."""
    return runner_factory("no_change", model_with(attention=PlainAttention))(cfg, state_dict, device, dtype)


# --- cache layouts: slack beyond what the layout declares, blocks in two places (issue 16) --------------

from mpt_kv.catalogue.designs import (POOL, BlockGrowthConcatCache, BlockGrowthSession, PagedCache,  # noqa: E402
                                      PagedMPT, PagedSession)


def paged_variant(name, bug, origin, killed_by, model):
    """A variant of the paged_cache design: its pool is the model's, declared as the design's is
    (Capabilities(cache_pool=True)), so that its one change is what kills it."""
    build = runner_factory(name, model, PagedSession, capabilities=POOL, module=__name__)
    VARIANTS[name] = Variant(name, bug, origin, tuple(killed_by), build)
    return build


class TwoBlocksAheadPagedCache(PagedCache):
    lookahead = 2  # meant as a scheduler's look-ahead slots, counted in blocks


class TwoBlocksAheadPagedMPT(PagedMPT):
    cache_class = TwoBlocksAheadPagedCache


paged_two_blocks_of_slack = paged_variant(
    "paged_two_blocks_of_slack",
    "the paged cache hands every row two blocks beyond the ones its positions need: up to three blocks of slack "
    "per row where one is declared (PagedLayout)",
    "a look-ahead reservation (vLLM's num_lookahead_slots for speculative decoding) counted in blocks instead of "
    "slots, or added on top of the block the next token needs",
    ["memory"], TwoBlocksAheadPagedMPT)


class SharedBlockPagedCache(PagedCache):
    def hand_out(self, row, j, block):
        last = self.table.shape[0] - 1
        if self.prefilled and row == last and row > 0:
            return int(self.table[0, j])  # the block row 0 was just handed: two rows write one block
        return block


class SharedBlockPagedMPT(PagedMPT):
    cache_class = SharedBlockPagedCache


paged_block_shared_between_rows = paged_variant(
    "paged_block_shared_between_rows",
    "when decoding crosses a block boundary the last row's block table entry gets row 0's new block: both rows' "
    "new tokens go to one block, each overwriting the other's",
    "a block allocator that hands one free block to two sequences (a free list read before it is popped, "
    "a block id reused across a batch), or a slot mapping indexed by the wrong row",
    ["P1", "P2", "P3"], SharedBlockPagedMPT)


from mpt_kv.catalogue.designs import CopyOnWritePagedMPT, CopyOnWritePagedSession  # noqa: E402


class WriteIntoSharedBlockSession(CopyOnWritePagedSession):
    copy_before_write = False  # the blocks a reorder shared are written in place


paged_write_into_shared_block = runner_factory("paged_write_into_shared_block", CopyOnWritePagedMPT,
                                               WriteIntoSharedBlockSession, capabilities=POOL, module=__name__)
VARIANTS["paged_write_into_shared_block"] = Variant(
    "paged_write_into_shared_block",
    "the copy-on-write paged cache (paged_copy_on_write) shares blocks between beams after a reorder, but a decode "
    "step writes into a shared block without copying it: the other beams that hold it see the new K/V at that "
    "position",
    "vLLM's block manager copies a shared block before a sequence appends to it (its reference count > 1); an "
    "append that skips the count, or checks it after the write, corrupts every forked beam",
    ("ops",), paged_write_into_shared_block)


class ViewsFirstBlockCache(BlockGrowthConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None:
            self.kv[layer] = (k, v)  # the prompt's k, v kept as views of mixed_qkv until the first block is made
            return self.kv[layer]
        return super().update(layer, k, v, token_idx, cache_idx)


block_cache_prefill_views_of_mixed_qkv = variant(
    "block_cache_prefill_views_of_mixed_qkv",
    "a cache declared as growing in blocks (BlockGrowth) keeps the prompt's k, v as views of mixed_qkv until its "
    "first decode step copies them into a block: the whole fused buffer is pinned after prefill",
    "the seed PR's bug inside a block cache: the first block allocated lazily, at the first decode step, and the "
    "prompt's K/V left as the projection's output until then",
    ["P3", "memory"], concat=ViewsFirstBlockCache, session=BlockGrowthSession)


class ThreeBlocksCapacityCache(BlockGrowthConcatCache):
    blocks_ahead = 3  # capacity: the blocks the positions need and two more, where one block of slack is declared


block_growth_beyond_one_block = variant(
    "block_growth_beyond_one_block",
    "a cache growing by blocks of 4 (declared BlockGrowth(4)) rounds its capacity up to two blocks more than its "
    "positions need: up to three blocks of slack per layer where one is declared",
    "growth by a factor or a margin on top of the block (capacity = needed + 2 blocks), as growable arrays do",
    ["memory"], concat=ThreeBlocksCapacityCache, session=BlockGrowthSession)

# --- cache operations: extend, crop, reorder (the ops column, programs.py) -------------------------------

class KeysOnlyReorderConcat(ConcatCache):
    def reorder(self, index):
        for layer, (k, v) in enumerate(self.kv):
            self.kv[layer] = (k.index_select(0, index), v)  # the values stay with the old rows


class KeysOnlyReorderStatic(StaticCache):
    def reorder(self, index):
        for ck, _ in self.kv:
            ck.copy_(ck.index_select(0, index))


reorder_keys_only = variant(
    "reorder_keys_only",
    "a beam reorder takes the keys' rows from the index but leaves the values where they were",
    "two caches per layer and one index_select line; a reorder test with the identity index passes",
    ["ops"], concat=KeysOnlyReorderConcat, static=KeysOnlyReorderStatic)


class RowByRowReorderStatic(StaticCache):
    def reorder(self, index):
        for ck, cv in self.kv:
            for b, j in enumerate(index.tolist()):  # row b may read row j < b, already overwritten
                ck[b] = ck[j]
                cv[b] = cv[j]


class RowByRowReorderConcat(ConcatCache):
    def reorder(self, index):
        for k, v in (pair for pair in self.kv if pair is not None):
            for b, j in enumerate(index.tolist()):
                k[b] = k[j]
                v[b] = v[j]


in_place_reorder_reads_overwritten_rows = variant(
    "in_place_reorder_reads_overwritten_rows",
    "the in-place reorder copies row index[b] into row b one row at a time: a row it reads may already "
    "hold another beam",
    "an in-place reorder written to spare the second buffer (llama's reorder_kv_cache does it right, "
    "with index_copy_ of a gathered copy)",
    ["ops"], concat=RowByRowReorderConcat, static=RowByRowReorderStatic)


class StaleSlotsCropSession(ReferenceSession):
    """Crop moves the position back but leaves the cropped slots' mask on (static path)."""

    def _crop(self, n):
        if self.path == "concat":
            return super()._crop(n)
        self._crop_cache(n)  # no `self.mask[:, n:] = 0`: the rejected candidates stay attended


crop_leaves_mask_ahead = variant(
    "crop_leaves_mask_ahead",
    "a static crop moves token_idx back but leaves the cropped slots switched on in the mask: the rejected "
    "candidates' K/V stay attended",
    "assisted decoding on a static cache: `cumulative_length` (transformers' StaticLayer.crop) or token_idx is "
    "moved back, the mask is not",
    ["ops"], session=StaleSlotsCropSession)


class NoLengthStaticCache(StaticCache):
    """A static cache that keeps no count of its positions, and a crop that does nothing to it."""

    written = property(lambda self: None, lambda self, value: None)

    def crop(self, n):
        pass


class AheadPositionSession(ReferenceSession):
    """The next write position is a counter of its own that crop does not move back."""

    def _extend(self, tokens):
        self.position = getattr(self, "position", self.written) + tokens.shape[1]
        written, self.written = self.written, self.position - tokens.shape[1]
        try:
            return super()._extend(tokens)
        finally:
            self.written = written


crop_leaves_token_idx_ahead = variant(
    "crop_leaves_token_idx_ahead",
    "after a crop the static path keeps writing at the old position (token_idx ahead): the cropped slots stay "
    "masked and the new tokens land past them, at the wrong ALiBi distance",
    "a generation loop that advances token_idx on its own and forgets to move it back after the assistant's "
    "candidates are rejected",
    ["ops"], session=AheadPositionSession, static=NoLengthStaticCache)


class NoCausalChunkAttention(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        filled = cache is not None and (cache.prefilled[layer] if isinstance(cache, StaticCache)
                                        else cache.kv[layer] is not None)
        if filled and x.shape[1] > 1:
            mask = mask[:, :, -1:].expand_as(mask)  # every query sees the chunk's last row: its later tokens too
        return super().forward(x, mask, bias, cache, layer, token_idx, cache_idx)


extend_without_causal_chunk_mask = variant(
    "extend_without_causal_chunk_mask",
    "a k-token cached call masks padding and never-written slots but not causality inside the chunk: each "
    "candidate sees the ones after it",
    "a decode-step mask (one query row) broadcast over k queries; measured 5.47 from the uncached logits "
    "(issue 16), and no one-token check can see it",
    ["ops"], attention=NoCausalChunkAttention)


class WholeCopyReorderConcat(ConcatCache):
    def reorder(self, index):
        new = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]  # all before any goes
        self.kv = new


class WholeCopyReorderStatic(StaticCache):
    def reorder(self, index):
        copies = [(ck.index_select(0, index), cv.index_select(0, index)) for ck, cv in self.kv]
        for (ck, cv), (k, v) in zip(self.kv, copies):
            ck.copy_(k)
            cv.copy_(v)


reorder_through_whole_cache_copy = variant(
    "reorder_through_whole_cache_copy",
    "a reorder gathers every layer's new K and V before the old ones go: a second whole cache per beam step",
    "the legacy `_reorder_cache` of transformers' and optimum-habana's models: tuple(tuple(past.index_select(0, "
    "beam_idx) ...) for layer_past in past) builds the whole new tuple while the old one is alive",
    ["ops"], concat=WholeCopyReorderConcat, static=WholeCopyReorderStatic)

class ReallocatingReorderStatic(StaticCache):
    def reorder(self, index):
        for layer, (k, v) in enumerate(self.kv):  # one layer at a time (no whole-cache transient), into new buffers
            self.kv[layer] = (k.index_select(0, index), v.index_select(0, index))


static_reorder_reallocates = variant(
    "static_reorder_reallocates",
    "a static cache's reorder gathers each layer into a new buffer: right values, but the buffers a captured "
    "graph replays into are gone",
    "transformers 5.24's StaticLayer.reorder_cache (self.keys = self.keys.index_select(0, beam_idx)); any "
    "out-of-place index_select on a preallocated cache",
    ["ops"], static=ReallocatingReorderStatic)

class UndoConcatCache(ConcatCache):
    """Keeps the cache as it was before its last reorder or crop, to undo it."""

    def crop(self, n):
        self.undo = list(self.kv)
        super().crop(n)

    def reorder(self, index):
        self.undo = list(self.kv)
        super().reorder(index)


old_cache_kept_for_undo = variant(
    "old_cache_kept_for_undo",
    "the concat cache keeps its layers as they were before the last reorder or crop (to undo it): after every beam "
    "step or rejected draft the cache is held twice, though each operation's transient is one layer",
    "a rollback kept for speculative decoding or beam backtracking; the caller's old past_key_values still "
    "referenced after the reordered cache is built (model_kwargs['past_key_values'] = self._reorder_cache(...))",
    ["ops"], concat=UndoConcatCache)

class ContiguousCropConcat(ConcatCache):
    def crop(self, n):
        for layer, pair in enumerate(self.kv):
            if pair is not None:  # meant as a copy; for one row and one head the slice already is contiguous
                self.kv[layer] = (pair[0][:, :, :n].contiguous(), pair[1][:, :, :n].contiguous())


crop_by_contiguous_slice = variant(
    "crop_by_contiguous_slice",
    "the concat cache crops by `.contiguous()` of the kept slice: a copy for every shape but batch 1 with one head, "
    "where the (1, 1, n, hd) slice already is contiguous and stays a view of the uncropped storage (the cropped "
    "tail kept)",
    "the `.contiguous()`-as-copy idiom (contiguous_is_not_always_a_copy's, in a crop); greedy single-sequence "
    "assisted decoding on a one-head (or per-head) cache is that shape",
    ["ops"], concat=ContiguousCropConcat)

# --- bugs past the drawn ranges: batch, layers, heads, prompt length, config fields, model state (issue 17) ---

class RowZeroMaskForLargeBatch(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        if x.shape[0] >= 4 and x.shape[1] == 1:  # the batched decode kernel: one mask row for all
            mask = mask[:1].expand_as(mask)
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx)


batched_decode_row_zero_mask = variant(
    "batched_decode_row_zero_mask",
    "decode with batch >= 4 takes a batched path that applies row 0's padding mask to every row: "
    "rows padded differently from row 0 attend their padding (or lose real tokens)",
    "kernels dispatch on batch size (a batched decode path for B >= 4); a mask broadcast from one row "
    "is right whenever the rows are padded alike, as a batch of 1-3 equal prompts often is",
    ["P1"], attention=RowZeroMaskForLargeBatch)


class LayerRingConcatCache(ConcatCache):
    """Each layer's past is read from and written to buffer `layer % RING` (an offloaded cache
    that keeps RING layers on the device): right for up to RING layers."""

    RING = 3

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if layer == 0:  # the ring is loaded for this step: layer i's past from buffer i % RING
            self.ring = [self.kv[i % self.RING] for i in range(len(self.kv))]
        past = self.ring[layer] if self.kv[layer] is not None else None  # prefill: no past
        new = (k.clone(), v.clone()) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
        self.kv[layer] = new
        return new


layer_ring_of_3 = variant(
    "layer_ring_of_3",
    "the concat cache keeps its K/V in a ring of 3 per-layer buffers (layer i in buffer i % 3): from "
    "4 layers on, a layer's decode attends over another layer's past",
    "offloaded caches (transformers' OffloadedCache prefetches the next layer into a small ring of device "
    "buffers); an indexing slip is invisible while the model has no more layers than the ring",
    ["P1"], concat=LayerRingConcatCache)


def alibi_of_8_head_groups(cfg, device=None):
    bias = alibi_bias(cfg, device)
    return bias[torch.arange(cfg.n_heads) % 8] if cfg.n_heads > 8 else bias  # heads 8.. repeat 0-7's slopes


def alibi_of_config_max_8(cfg, device=None):
    import dataclasses

    return alibi_bias(dataclasses.replace(cfg, alibi_bias_max=8), device)


def model_with_alibi(build_alibi):
    """The reference with its ALiBi table built by `build_alibi(cfg, device)`."""

    class Model(ReferenceMPT):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.alibi = build_alibi(cfg)

        def _apply(self, fn, recurse=True):
            super()._apply(fn, recurse)
            self.alibi = build_alibi(self.cfg, self.alibi.device)
            return self

    return Model


alibi_slopes_per_8_heads = variant(
    "alibi_slopes_per_8_heads",
    "ALiBi slopes for more than 8 heads repeat the first 8 heads' slopes (head h gets slope h % 8): "
    "right for 1-8 heads, wrong for MPT-7B's 32",
    "slopes computed for a fixed group of 8 heads (a kernel's head group, a table sized for small models) "
    "and tiled; every cached and uncached path shares the table, so only the oracle sees it",
    ["P0"], model=model_with_alibi(alibi_of_8_head_groups))


alibi_bias_max_always_8 = variant(
    "alibi_bias_max_always_8",
    "ALiBi built with alibi_bias_max 8 whatever the config says",
    "transformers' MptModel.forward calls build_mpt_alibi_tensor without the config's alibi_bias_max "
    "(modeling_mpt.py, 5.24 line 320; 4.55.4 line 377), and optimum-habana's Gaudi MPT inherits it",
    ["P0"], model=model_with_alibi(alibi_of_config_max_8))


class ViewsForLongPromptsConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.kv[layer] is None and k.shape[2] > 64:
            self.kv[layer] = (k, v)  # the long-prompt path skips the clone: views of mixed_qkv
            return self.kv[layer]
        return super().update(layer, k, v)


kv_views_for_prompts_past_64 = variant(
    "kv_views_for_prompts_past_64",
    "prefills of more than 64 tokens store k, v as views of mixed_qkv (the seed bug on a path chosen "
    "by prompt length): the whole fused buffer stays alive",
    "the seed bug (optimum-habana's MPT before the seed PR) on a chunked or flash prefill path taken "
    "only for long prompts; short prompts take the fixed path",
    ["P3"], concat=ViewsForLongPromptsConcatCache)


class KeepsAttentionProbabilities(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        out = attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx)
        # the probabilities, kept for inspection (output_attentions-style), one per layer
        self.last_probabilities = torch.zeros(x.shape[0], self.cfg.n_heads, x.shape[1], mask.shape[-1], device=x.device)
        return out


attention_probabilities_kept = variant(
    "attention_probabilities_kept",
    "each attention module keeps its last attention probabilities (B, H, T, K) as an attribute: the "
    "model holds per-generation state after the generation and its session are gone",
    "output_attentions / attention-map hooks that store on the module (self.attn_weights = ...) and are "
    "never cleared; each generation replaces them, so repeated generations of one shape do not grow",
    ["memory"], attention=KeepsAttentionProbabilities)


# --- a quantized cache whose decode tokens get the wrong scale (P1 under the int8 bound) ---------------

from mpt_kv.catalogue.designs import (QuantizedConcatCache, QuantizedMPT, QuantizedSession,  # noqa: E402
                                      QuantizedStaticCache, quantize)


class PreviousScale:
    """A cached call's tokens are quantized with the scale stored at the position before the call
    (the prompt's last, for the first decode step) instead of their own: larger values clip."""

    def _quantize(self, x, layer, i, at):
        if not self._cached(layer):
            return quantize(x, self.storage)
        first = (at if torch.is_tensor(at) else torch.tensor([at], device=x.device)).reshape(-1)[:1]
        borrowed = self.q[layer][1][i].index_select(2, first - 1)  # (B, H, 1, 1): one scale per row and head
        return quantize(x, self.storage, borrowed.expand(*x.shape[:3], 1).contiguous())  # one per position stored


class RowZeroScale:
    """A cached call's scales are computed for batch row 0 and used for every row."""

    def _quantize(self, x, layer, i, at):
        codes, scale = quantize(x, self.storage)
        if not self._cached(layer):
            return codes, scale
        return quantize(x, self.storage, scale[:1].expand_as(scale).contiguous())


def quantized_variant(name, bug, origin, killed_by, mixin):
    concat = type(f"{mixin.__name__}Concat", (mixin, QuantizedConcatCache), {})
    static = type(f"{mixin.__name__}Static", (mixin, QuantizedStaticCache), {})
    model = type(f"{mixin.__name__}MPT", (QuantizedMPT,), {"concat_class": concat, "static_class": static})
    return variant(name, bug, origin, killed_by, model=model, session=QuantizedSession)


quantized_kv_wrong_scale = quantized_variant(
    "quantized_kv_wrong_scale",
    "the int8 quantized cache (quantized_kv_int8) quantizes each cached call's tokens with the scale stored at the "
    "position before them (the prompt's last for the first decode step), not their own: values beyond it clip",
    "a scale computed over the prompt and reused for decode tokens; an off-by-one into the per-token scale buffer "
    "(slot token_idx - 2)",
    ["P1", "ops"], PreviousScale)

quantized_kv_wrong_row = quantized_variant(
    "quantized_kv_wrong_row",
    "the int8 quantized cache computes a cached call's per-token scales for batch row 0 and uses them for every "
    "row: another row's values clip or lose their precision",
    "a scale reduction over the wrong dimension, or a scale buffer indexed without the batch row",
    ["P1", "ops"], RowZeroScale)


# --- a quantized cache that holds more than its codes and one layer's dequantize (memory) ---------------

from mpt_kv.catalogue.designs import dequantize  # noqa: E402


class WholeCacheDequantized:
    """At the first layer of each cached call every layer's cache is dequantized (held until the last
    layer's attention has run); each layer still attends over its own fresh dequantize."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        cached = self._cached(layer)
        if cached and layer == 0:
            self.whole = [None if q is None else tuple(dequantize(c, s, self.out_dtype) for c, s in zip(*q))
                          for q in self.q]
        out = super().update(layer, k, v, token_idx, cache_idx)
        if cached and layer == len(self.q) - 1:
            self.whole = None
        return out


quantized_kv_whole_cache_dequantized = quantized_variant(
    "quantized_kv_whole_cache_dequantized",
    "the int8 quantized cache dequantizes every layer's K and V at the first layer of each cached call and holds "
    "them until the last layer: the whole cache in full precision during every step",
    "an attention fed from cache.dequantized() / a kv() accessor that dequantizes every layer, or a 'dequantize "
    "once per step' optimisation, where one layer at a time was meant",
    ["memory"], WholeCacheDequantized)


class FullPrecisionCopy:
    """Keeps a full-precision copy of every cached K and V beside the codes (the concat path)."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        shadow = getattr(self, "shadow", None) or [None] * len(self.q)
        self.shadow = shadow
        shadow[layer] = (k.clone(), v.clone()) if shadow[layer] is None else \
            (torch.cat([shadow[layer][0], k], 2), torch.cat([shadow[layer][1], v], 2))
        return super().update(layer, k, v, token_idx, cache_idx)


quantized_kv_full_precision_copy = quantized_variant(
    "quantized_kv_full_precision_copy",
    "the int8 quantized cache also keeps every cached K and V in full precision beside the codes: the cache is "
    "larger than the one it replaces",
    "a full-precision cache kept 'for the prefill' or for a fallback path, never dropped once quantized",
    ["memory"], FullPrecisionCopy)


class OldCodesKept:
    """The concat path's codes and scales before each torch.cat stay referenced after the step."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        old = getattr(self, "old", None) or [None] * len(self.q)
        self.old = old
        old[layer] = self.q[layer]
        return super().update(layer, k, v, token_idx, cache_idx)


quantized_kv_old_codes_kept = quantized_variant(
    "quantized_kv_old_codes_kept",
    "the int8 quantized concat cache keeps the codes and scales from before each torch.cat referenced after the "
    "step: every decode step holds the quantized cache twice",
    "old_cache_kept_referenced in a quantized cache: the previous step's tuple kept for an undo or a rollback",
    ["memory"], OldCodesKept)


# --- a bf16 model that upcasts every layer's cache to fp32 (memory) -------------------------------------

from mpt_kv.catalogue.designs import UpcastSdpaAttention  # noqa: E402


class UpcastEveryLayer(UpcastSdpaAttention):
    """At the first layer of a cached call, every layer's cached K and V upcast to fp32 (held on the cache
    until the last layer); each layer then attends as the design does."""

    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        kv = getattr(cache, "kv", None)
        if layer == 0 and kv is not None and all(pair is not None for pair in kv):  # a cached call
            cache.upcast = [(k.float(), v.float()) for k, v in kv]  # every layer's cache, as fp32 copies
        out = super().forward(x, mask, bias, cache, layer, token_idx, cache_idx)
        if layer == self.cfg.n_layers - 1 and cache is not None:
            cache.upcast = None
        return out


attention_upcasts_every_layer = variant(
    "attention_upcasts_every_layer",
    "a bfloat16 model (attention_upcast_to_fp32) that upcasts every layer's cached K and V to float32 at the first "
    "layer of each decode step and holds them until the last: the whole cache in fp32 during every step "
    "(a bfloat16 row)",
    "an fp32 attention path fed by a whole-cache conversion once per step (past_key_values converted with "
    ".float() / .to(torch.float32) before the forward) where one layer at a time was meant",
    ["memory"], dtype=torch.bfloat16, attention=UpcastEveryLayer)


# --- an adapter that drops a config field the drawn cases vary (P0: the reference reads every field) ----------

import dataclasses  # noqa: E402


def model_dropping(**fixed):
    """The reference built with these config fields fixed, whatever the factory's config says: what an
    adapter that forgets to pass them on builds (its model's own defaults)."""

    class Model(ReferenceMPT):
        def __init__(self, cfg):
            super().__init__(dataclasses.replace(cfg, **fixed))

    return Model


layer_norm_epsilon_dropped = variant(
    "layer_norm_epsilon_dropped",
    "the model is built with layer_norm_epsilon 1e-5 (MPT's default) whatever the config says",
    "an adapter that builds its model from d_model, n_heads, n_layers, vocab and max_seq_len and leaves the "
    "norm's eps at the class default (nn.LayerNorm's 1e-5; a fused kernel's hard-coded one)",
    ["P0"], model=model_dropping(layer_norm_epsilon=1e-5))

vocab_size_dropped = variant(
    "vocab_size_dropped",
    "the model is built with MPT-7B's vocab_size 50432 whatever the config says",
    "an adapter that keeps the checkpoint's (padded) vocabulary size from a default config instead of the one "
    "it is given",
    ["P0"], model=model_dropping(vocab_size=50432))

clip_qkv_dropped = variant(
    "clip_qkv_dropped",
    "the model never clamps mixed_qkv: clip_qkv dropped from the config (both paths, cached or not)",
    "an adapter or a port that does not pass attn_config's clip_qkv on (transformers releases before clip_qkv "
    "was read: MptAttention.forward never read it), or a fused QKV kernel without the clamp",
    ["P0"], model=model_dropping(clip_qkv=None))


# --- a "cache" that keeps only the token ids and recomputes (memory; the green-run rule) --------------------

class RecomputingSession(ReferenceSession):
    """On the concat path the session keeps the token ids and runs the whole history uncached at each
    call (right logits, nothing cached); kv() makes K/V-shaped tensors at each read."""

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.path != "concat":
            return super()._forward(input_ids, mask, token_idx, cache_idx)
        self.ids = input_ids if getattr(self, "ids", None) is None else torch.cat([self.ids, input_ids], 1)
        return self.model(self.ids, mask)[:, -input_ids.shape[1]:]

    def _crop_cache(self, n):
        if self.path == "concat":
            self.ids = self.ids[:, :n]
        else:
            super()._crop_cache(n)

    def _reorder_cache(self, index):
        if self.path == "concat":
            self.ids = self.ids.index_select(0, index)
        else:
            super()._reorder_cache(index)

    def kv(self):
        if self.path != "concat":
            return super().kv()
        cfg, (B, T) = self.model.cfg, self.ids.shape
        w = self.model.transformer.wte.weight
        return [tuple(torch.zeros(B, cfg.n_heads, T, cfg.head_dim, dtype=w.dtype, device=w.device) for _ in "kv")
                for _ in range(cfg.n_layers)]


cache_recomputed_from_tokens = variant(
    "cache_recomputed_from_tokens",
    "the concat path keeps only the token ids and runs the whole history uncached at every call: right logits, "
    "no cache (kv() makes K/V-shaped tensors at each read)",
    "a 'cache' stubbed out while porting (use_cache accepted and ignored, past_key_values holding the input ids), "
    "or a generation loop that re-runs the prefix; value checks alone pass it (docs/gate.md row 48)",
    ["memory"], session=RecomputingSession)


# --- what a captured graph cannot hold (issue 37): graph-capture must kill these --------------------------

class HostCounterSession(ReferenceSession):
    """The static path's decode position comes from the generation's own counter on the host: no
    device read, so no host sync."""

    def _forward(self, input_ids, mask, token_idx=None, cache_idx=None):
        if self.path == "static" and self.cache is not None and token_idx is not None:
            token_idx = self.written + 1  # a Python int: 1-based position of the token this call writes
        return super()._forward(input_ids, mask, token_idx, cache_idx)


class HostCounterMPT(ReferenceMPT):
    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if isinstance(token_idx, int):  # made a tensor at the model's top, outside attention: a new constant each step
            token_idx = torch.tensor([token_idx], device=input_ids.device)
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


position_from_a_host_counter = variant(
    "position_from_a_host_counter",
    "the static decode position is the generation loop's Python int counter, made a tensor at the top of the model "
    "(outside attention, no device read): right values, but each step a new constant a graph bakes in",
    "transformers-style `cache_position = torch.arange(past_seen_tokens, ...)` from a host-side seen-tokens count; "
    "a captured graph replays the first step's position, torch.compile recompiles every step",
    ["graph-capture"], model=HostCounterMPT, session=HostCounterSession)


class UnpaddedFastPathMPT(ReferenceMPT):
    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if attention_mask is not None and bool(attention_mask.all()):  # a branch on device data: a host sync
            attention_mask = None  # every position attended: the model builds an all-ones mask
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


branch_on_an_unpadded_batch = variant(
    "branch_on_an_unpadded_batch",
    "the model drops the padding mask when `bool(attention_mask.all())`: right values, but a branch on device data "
    "in every call (a host read each step; no graph can hold both sides)",
    "SDPA fast paths that skip the mask when nothing is padded (transformers' "
    "AttentionMaskConverter._ignore_causal_mask_sdpa checks `torch.all(attention_mask == 1)`, and skips the check "
    "only while tracing)",
    ["static-shape", "graph-capture"], model=UnpaddedFastPathMPT)


# --- an extend that crosses a bucket (issue 49): only a value check after an extend on the bucketed path kills it ---

class ChunkWithinOneBucketCache(StaticCache):
    """The bucketed static path writes a k-token call's keys and values only up to the end of the bucket
    its first token falls in; the rest of the chunk is never written."""

    BUCKET = index.BUCKET  # the value checks' cache_idx bucket (optimum-habana's --bucket_size: 128)

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.prefilled[layer] and cache_idx is not None and k.shape[2] > 1:
            start = int(token_idx.reshape(-1)[0]) - 1
            room = -(-(start + 1) // self.BUCKET) * self.BUCKET - start  # slots left in the first token's bucket
            ck, cv = super().update(layer, k[:, :, :room], v[:, :, :room], token_idx, None)
            return ck[:, :, :cache_idx], cv[:, :, :cache_idx]
        return super().update(layer, k, v, token_idx, cache_idx)


extend_written_within_one_bucket = variant(
    "extend_written_within_one_bucket",
    "a k-token extend on the bucketed static path writes only the slots left in its first token's bucket: an "
    "extend that crosses into the next bucket leaves its later tokens' keys and values unwritten (decodes, and "
    "extends inside one bucket, are right)",
    "a chunk copy sized to the bucket, written for a chunked prefill whose chunks are bucket-aligned; an assisted "
    "decoding's k candidates start anywhere and cross the boundary",
    ["ops"], static=ChunkWithinOneBucketCache)


# --- a bf16-only target that holds a second cache during every static step (memory: issue 49) ----------------

class WholeCacheCopyStaticCache(StaticCache):
    """At the first layer of each static cached call every layer's K and V are copied, and the copies
    held until the last layer has run; each layer still attends over its own buffer."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if layer == 0 and self.prefilled[0]:  # a cached call (the prefill writes the buffers first)
            self.snapshot = [(ck.clone(), cv.clone()) for ck, cv in self.kv]
        out = super().update(layer, k, v, token_idx, cache_idx)
        if layer == len(self.kv) - 1:
            self.snapshot = None
        return out


static_step_copies_whole_cache = variant(
    "static_step_copies_whole_cache",
    "a bfloat16-only model (fp32 declared unsupported) whose static cached call copies every layer's K and V at "
    "its first layer and holds the copies until its last: a second whole cache during every step (a bfloat16 row)",
    "a snapshot of the cache kept for a rollback, or the whole cache handed to a kernel that wants its own "
    "contiguous copy, once per step; a Gaudi port may run bf16 only, where one layer's fp32 upcast allowance was "
    "as large as a whole 2-layer cache",
    ["memory"], dtype=torch.bfloat16,
    capabilities=Capabilities({"fp32": "this port runs bfloat16 only (as a Gaudi port may)"}),
    static=WholeCacheCopyStaticCache)


# --- kv() handed over in another axis order (an adapter error, issue 49) -------------------------------------

from mpt_kv.catalogue.designs import TokenMajorConcatCache  # noqa: E402


class StoredOrderSession(ReferenceSession):
    """The concat path's kv() hands over the token-major tensors as they are stored, (B, T, H, hd)."""

    def kv(self):
        pairs = super().kv()
        if self.path != "concat":
            return pairs
        return [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in pairs]


kv_in_token_major_order = variant(
    "kv_in_token_major_order",
    "the concat cache is kept token-major (designs.contiguous_copies) and kv() returns it as stored, (batch, seq, "
    "heads, head_dim), not (batch, heads, seq, head_dim): every storage is the cache's own, the values are right, "
    "only the axes are crossed",
    "an adapter written for a token-major cache (flash-attention layouts; llm-foundry's flash path stores (b, s, h, "
    "d)) that hands the stored tensors to kv() without the transpose: P3 and memory read the same storages either "
    "way, P2 would compare crossed axes",
    ["P3"], concat=TokenMajorConcatCache, session=StoredOrderSession)
