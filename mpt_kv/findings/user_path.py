"""How a user reaches a finding: by a default `generate` call, by an option (which), or only by a
non-standard call. Read off a known-failures entry's implementation, path and the operation its
pattern names, by the implementations' own defaults:

- transformers: `generate` caches in a DynamicCache (the concat path) whenever the config's
  `use_cache` is on (the default of every family here but MPT, whose MptConfig defaults it off, as
  mosaicml/mpt-7b's config.json does); the static path is `cache_implementation="static"`.
- optimum-habana 1.21.2: `generate` runs static shapes by default for every family here (each is in
  generation/utils.py's MODELS_OPTIMIZED_WITH_STATIC_SHAPES): the concat path is the option
  `static_shapes=False`, the reuse-cache path the option `reuse_cache=True`.
- a beam reorder is the option `num_beams` > 1; a crop is assisted decoding (`assistant_model=`); a
  k-token extend into an existing cache is `generate(past_key_values=<an earlier generate's cache>)`,
  a call no default or documented option makes (non-standard); a prefill, a decode step or an
  uncached forward is what every `generate` runs.

An entry whose route the rule cannot read says it itself (its `reason` names it), and OVERRIDES
holds it, keyed by (implementation, family, variant, the start of its pattern).
"""

from __future__ import annotations

import re

from mpt_kv import recipes
from mpt_kv.findings.raw import target_of

DEFAULT, OPTION, NON_STANDARD = "default", "option", "non-standard"
KINDS = (DEFAULT, OPTION, NON_STANDARD)  # from the most reachable
# families whose transformers config defaults use_cache to False (MptConfig; mpt-7b's config.json too)
NO_CACHE_BY_DEFAULT = {"mpt"}
OPERATIONS = ("reorder", "crop", "extend", "prefill", "decode", "logits")

# (implementation, family, variant, pattern prefix) -> (kind, call): findings whose pattern does not
# name the operation a user meets first
OVERRIDES = {
    # the reference's eager attention adds ALiBi twice: only eager attention (or output_attentions,
    # which selects it) meets it; the default (sdpa) does not (docs/families.md)
    ("optimum-habana", "falcon", "alibi", "(family-P0 uncached logits"):
        (OPTION, 'transformers\' `from_pretrained(..., attn_implementation="eager")` or `output_attentions=True`'),
    ("optimum-habana", "falcon", "alibi", "family-P1 prefill: cached logits"):
        (OPTION, 'transformers\' `from_pretrained(..., attn_implementation="eager")` or `output_attentions=True`'),
    # the same double ALiBi, seen by transformers' sdpa cells against the eager oracle: who meets it runs eager
    ("transformers[sdpa]", "falcon", "alibi", "(family-P0 uncached logits"):
        (OPTION, '`from_pretrained(..., attn_implementation="eager")` or `output_attentions=True`'),
}


# variants that exist only behind a config option of the implementation (the others are public
# checkpoints' configs, reached by loading them)
VARIANT_OPTIONS = {("optimum-habana", "llama", "fused-qkv"): "the config's `fused_qkv=True`"}


def operation(pattern: str) -> str | None:
    """The first operation the pattern names, in OPERATIONS' order (a reorder or extend message also
    names the prefill it started from)."""
    named = set(re.findall(r"\b(" + "|".join(OPERATIONS) + r")\b", pattern))
    return next((op for op in OPERATIONS if op in named), None)


def recipe_call(recipe, static: bool = True) -> str:
    """A recipe's flags as generate's options (mpt_kv/recipes.py), with its command line."""
    static_only = ("reuse_cache",) if static else ("reuse_cache", "bucket_internal")  # they need static shapes
    options = [f"{k}=True" for k in ("reuse_cache", "trim_logits", "attn_softmax_bf16", "use_flash_attention",
                                     "flash_attention_recompute", "flash_attention_causal_mask")
               if getattr(recipe, k) and (static or k not in static_only)]
    if recipe.bucket_internal and static:
        options += [f"bucket_size={recipe.bucket_size}", "bucket_internal=True"]
    if not static:
        options.append("static_shapes=False")
    return f"`generate(..., {', '.join(options)})` (the recipe {recipe.name}: `{recipe.describe()}`)"


def path_call(implementation: str, family: str, path: str | None) -> tuple[str, str]:
    """The generate call that takes a cache path (a recipe's path: its flags, mpt_kv/recipes.py)."""
    recipe = recipes.recipe_of(path) if path else None
    if recipe is not None:
        return OPTION, recipe_call(recipe)
    if implementation == "optimum-habana":
        if path == "concat":
            return OPTION, "`generate(..., static_shapes=False)`"
        if path == "static+reuse":
            return OPTION, "`generate(..., reuse_cache=True)`"
        return DEFAULT, "`generate(...)` (static shapes, its default)"
    if path == "static":
        return OPTION, '`generate(..., cache_implementation="static")`'
    if family in NO_CACHE_BY_DEFAULT:
        return OPTION, "`generate(..., use_cache=True)` (its config defaults use_cache off)"
    return DEFAULT, "`generate(...)` (use_cache, its default)"


def user_path(entry: dict) -> tuple[str, str]:
    """(kind, the call) for one entry: kind is one of KINDS."""
    where = target_of(entry)  # (implementation, family, variant)
    for (impl, family, variant, prefix), fixed in OVERRIDES.items():
        if (impl, family, variant) == where and entry["pattern"].startswith(prefix):
            return fixed
    kind, call = operation_route(entry, where[0])
    option = VARIANT_OPTIONS.get(where)
    if option is None:
        return kind, call
    return (OPTION if kind == DEFAULT else kind), f"{option}, then {call}"


def operation_route(entry: dict, implementation: str) -> tuple[str, str]:
    """The path's call, with what the operation the pattern names adds to it."""
    op = operation(entry["pattern"])
    kind, call = path_call(implementation, target_of(entry)[1], entry.get("path"))
    recipe = recipes.recipe_of(entry["path"]) if entry.get("path") else None
    if recipe is not None and entry["property"] == "family-P2" and op == "prefill":
        call = recipe_call(recipe, static=False)  # family-P2 drives the concat path first: its prefill raised
    if op == "reorder":
        return OPTION, call.replace("...", "..., num_beams=2", 1)
    if op == "crop":
        return OPTION, call.replace("...", "..., assistant_model=<a draft model>", 1)
    if op == "extend":
        return NON_STANDARD, call.replace("...", "..., past_key_values=<an earlier generate's cache>", 1)
    return kind, call


def most_reachable(entries: list[dict]) -> tuple[str, str]:
    """A finding seen by several checks: the route of its most reachable entry (of equal kinds, the one
    on the implementation's default path: one option fewer)."""
    return min((user_path(e) for e in entries),
               key=lambda kind_call: (KINDS.index(kind_call[0]), "its default)" not in kind_call[1]))


def cell(entries: list[dict]) -> str:
    kind, call = most_reachable(entries)
    return f"{kind}: {call}"
