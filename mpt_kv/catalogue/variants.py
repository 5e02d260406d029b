"""Known-bad variants of the reference: the regressions the suite must kill.

Each variant is the reference with ONE small change that real KV-cache code has had or could
easily get, written as a few-line override of one piece (`Attention`, `ConcatCache`,
`StaticCache`, the session; `static_position_as_python_int` touches two: the int leaves the
session, the cache makes it a tensor again). Each names the kill-matrix columns expected to kill
it. `python -m mpt_kv killmatrix` (killmatrix.py) runs every check against every variant and
fails if one survives; a survivor means a missing or weak test: strengthen the test, never
delete the variant.

Every variant is also a target factory, so the whole pytest suite can run against it:

    pytest --target mpt_kv.catalogue.variants:kv_views_of_mixed_qkv --only-targets
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.reference import Attention, ReferenceMPT
from mpt_kv.targets.reference import ReferenceRunner, ReferenceSession

# The kill-matrix columns (killmatrix.CHECKS): P0-P3 from properties.py, static-shape from
# static_shape.py, memory from ceilings.py.
COLUMNS = ("P0", "P1", "P2", "P3", "static-shape", "memory")


@dataclass(frozen=True)
class Variant:
    name: str
    bug: str                      # one line: what is wrong
    origin: str                   # which real code had it, or how it easily gets in
    killed_by: tuple[str, ...]    # kill-matrix columns expected to catch it
    build: Callable               # (cfg, state_dict, device, dtype) -> Runner


# --- how a variant is assembled: the reference with one piece swapped -----------------------------

def model_with(attention=Attention, concat=ConcatCache, static=StaticCache):
    """A ReferenceMPT whose attention modules and caches are the given subclasses (same
    constructor and parameters, so the weights load unchanged)."""

    class Model(ReferenceMPT):
        def __init__(self, cfg):
            super().__init__(cfg)
            for block in self.transformer.blocks:
                block.attn.__class__ = attention

        def new_cache(self, path, batch, max_len=None, fill=None):
            cache = super().new_cache(path, batch, max_len, fill)
            cache.__class__ = concat if path == "concat" else static
            return cache

    return Model


def runner_factory(name, model_class=ReferenceMPT, session_class=ReferenceSession):
    class VariantRunner(ReferenceRunner):
        def session(self, path, max_len, bucket=None):
            return session_class(self.model, path, max_len, bucket, self.sync)

    VariantRunner.name, VariantRunner.model_class = name, model_class

    def build(cfg, state_dict, device, dtype):
        from mpt_kv.devices import sync

        return VariantRunner(cfg, state_dict, device, dtype, sync=lambda: sync(device.type))

    build.__name__ = name
    return build


VARIANTS: dict[str, Variant] = {}


def variant(name, bug, origin, killed_by, **pieces):
    """Register a variant and return its factory (also a module attribute of the same name)."""
    session_class = pieces.pop("session", ReferenceSession)
    model_class = pieces.pop("model", None) or model_with(**pieces)
    build = runner_factory(name, model_class, session_class)
    VARIANTS[name] = Variant(name, bug, origin, tuple(killed_by), build)
    return build


def attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx, *,
                      clamp=True, bias_len=None, drop_mask=False, additive_mask=False, softmax_dtype=None):
    """`Attention.forward` of the reference with the knobs the attention variants turn. With no
    knob turned it computes exactly what the reference does (`no_change` below shows it)."""
    B, T, D = x.shape
    H, hd = self.cfg.n_heads, self.cfg.head_dim
    mixed_qkv = self.Wqkv(x)
    if self.cfg.clip_qkv and clamp:
        mixed_qkv = mixed_qkv.clamp(min=-self.cfg.clip_qkv, max=self.cfg.clip_qkv)
    q, k, v = (t.reshape(B, T, H, hd).transpose(1, 2) for t in mixed_qkv.chunk(3, dim=2))
    if cache is not None:
        k, v = cache.update(layer, k, v, token_idx, cache_idx)
    K = k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores + bias[:, :, -(bias_len or K):]
    mask = mask[:, :, :, :K]
    if drop_mask:
        mask = torch.zeros_like(mask)
    softmax_dtype = softmax_dtype or torch.float32
    if additive_mask:
        scores = scores + mask.to(scores.dtype) * -1e4
    else:  # the fill must survive the cast to softmax_dtype (fp32's min is -inf in bf16)
        scores = scores.masked_fill(mask, max(torch.finfo(q.dtype).min, torch.finfo(softmax_dtype).min))
    weights = F.softmax(scores.to(softmax_dtype), dim=-1).to(v.dtype)
    return self.out_proj((weights @ v).transpose(1, 2).reshape(B, T, D))


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
    "optimum-habana's MPT before the seed PR (shared/seeds/); transformers 4.55 DynamicCache stores the first K/V as is",
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


class KeepsOldConcatCache(ConcatCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        self.previous = getattr(self, "previous", [None] * len(self.kv))
        self.previous[layer] = self.kv[layer]  # the pre-cat cache stays referenced: 2x memory
        return super().update(layer, k, v)


old_cache_kept_referenced = variant(
    "old_cache_kept_referenced",
    "the cache before torch.cat stays referenced after the step: every decode step holds the cache twice",
    "transformers issue 'forward pass consumes 2x memory' (shared/seeds/): the old past_key_values kept alive",
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

class StaticDecode(StaticCache):
    """StaticCache whose decode step is `_decode(ck, cv, k, v, token_idx) -> (ck, cv)`."""

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if not self.prefilled[layer]:
            return super().update(layer, k, v, token_idx, cache_idx)
        ck, cv = self.kv[layer] = self._decode(*self.kv[layer], k, v, token_idx)
        if cache_idx is not None:
            return ck[:, :, :cache_idx], cv[:, :, :cache_idx]
        return ck, cv


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
    ["static-shape"], static=WrittenPrefixStaticCache)


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
    ["static-shape"], static=HostPositionStaticCache, session=HostPositionSession)


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
    "optimum-habana's cache_idx path allocates torch.empty (FACTS.md: NaN there reaches the output)",
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
    "optimum-habana's static generation must extend the mask every step (FACTS.md); forgetting it is silent",
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


class PlainAttention(Attention):
    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        return attention_forward(self, x, mask, bias, cache, layer, token_idx, cache_idx)


def no_change(cfg, state_dict, device, dtype):
    """Not a variant: the reference assembled the way variants are (`attention_forward` with no
    knob turned, the class swaps of `model_with`). tests/test_variants.py registers it to prove
    the kill matrix says 'survived' for a model that is right, and that the assembly alone
    changes nothing, so each variant's kill is its one change."""
    return runner_factory("no_change", model_with(attention=PlainAttention))(cfg, state_dict, device, dtype)
