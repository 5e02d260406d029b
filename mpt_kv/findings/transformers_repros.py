"""The standalone repros of transformers' family findings (`mpt_kv.findings.repros` picks which): a
view finding (the prefill's cached K/V view the fused projection's output: templates/view.py.tmpl)
and the findings a prefill shows otherwise (templates/transformers_call.py.tmpl, its functions and
operation parts by finding: `TRANSFORMERS_CALLS`)."""

from __future__ import annotations

import textwrap

from mpt_kv.findings.raw import target_of
from mpt_kv.versions import split_attention
from mpt_kv.findings.grouping import versions, what
from mpt_kv.findings.scripts import (Repro, class_names, config_literal, fill, part, readme_text, template,
                                     tiny_config)


# Why a view finding costs memory, and how transformers 4.56 stopped it (DynamicLayer.update's
# first store goes through lazy_initialization + torch.cat, which copies)
VIEW_FIX = ("copy the first K/V into the cache in DynamicLayer.update's first store (`.contiguous()`/`.clone()` "
            "of the chunks, or allocate and `copy_`), as transformers 4.56 does (lazy_initialization, then "
            "torch.cat)")


def is_transformers_view(entry: dict) -> bool:
    """A transformers finding whose cached K/V view a larger buffer (a "views" entry)."""
    return bool(entry.get("views")) and split_attention(target_of(entry)[0])[0] == "transformers"


def view_repro(entries: list[dict], slug: str) -> Repro:
    """A transformers view finding: the prefill's cached K/V view the fused projection's output."""

    entry = entries[0]
    _, family, variant = target_of(entry)
    config_class, _ = class_names(family)
    pins = what(entry)
    title = f"transformers {family}/{variant}: after the prefill, {pins.replace('`', '')}"
    summary = textwrap.fill(entry["reason"], 96)
    script = fill(template("view.py.tmpl"), title=title, summary=summary, upstream=entry["upstream"],
                  when=versions(entry), config_class=config_class, family=family, variant=variant,
                  config=config_literal(tiny_config(family, variant)), pins=pins.replace("`", ""))
    call = ("model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=N) - any generate with "
            "use_cache=True (the default) and the default DynamicCache")
    readme = readme_text(entries, title, call, VIEW_FIX)
    return Repro(slug, title, script, readme, tuple(entries))


# transformers findings a prefill shows (transformers_call.py.tmpl): (family, variant, a text of the
# pattern) -> (short name, the part of its functions (None: none), the part of its operation, what the
# script runs, a suggested fix)
TRANSFORMERS_CALLS = {
    ("falcon", "new-arch-gqa", "the cached tensors themselves hold"): (
        "kv-cache-all-heads", "cached_tensors", "kv_cache_all_heads",
        "model.generate(input_ids, attention_mask=attention_mask) - any generate of a new-architecture Falcon with "
        "num_kv_heads < num_attention_heads, the default DynamicCache; here its prefill",
        "cache the num_kv_heads K/V heads and broadcast them to the query heads after the cache update "
        "(modeling_falcon.py:256-261), as llama's repeat_kv does"),
    ("falcon", "rotary-mqa", "index_copy_"): (
        "static-cache-prefill-index-copy", None, "static_cache_prefill_index_copy",
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - multi-query "
        "Falcon; here its prefill",
        "preallocate StaticCache's K/V heads as the model caches them (1 for multi-query Falcon: "
        "config.num_kv_heads, absent from num_key_value_heads), as transformers 4.56 does"),
}

# the Gaudi zoo's findings: windows, hybrids, latents (a text "<pattern text>:static" covers only the
# finding on the static path: gpt_neo's stored windows, where the static cache preallocates them)
WINDOW_FIX = ("keep the window's positions as a tensor of their own (`.clone()` the slice, or a preallocated ring "
              "buffer written in place), so the concatenation's evicted positions are freed")
for _family, _variant in (("gemma2", "hybrid-window4"), ("gemma3", "hybrid-window9"), ("gpt_oss", "hybrid-window7"),
                         ("mistral", "gqa")):
    TRANSFORMERS_CALLS[(_family, _variant, "is a view of a buffer that is no fused")] = (
        "window-slice-pins-evicted", "cached_tensors", "window_slice_pins_evicted",
        "model.generate(input_ids, attention_mask=attention_mask) - transformers 5.x's default DynamicCache; here "
        "the prefill and greedy decode steps", WINDOW_FIX)
    TRANSFORMERS_CALLS[(_family, _variant, "stored_windows")] = (
        "local-layers-cache-whole-history", "cached_tensors", "local_layers_history_hybrid",
        "model.generate(input_ids, attention_mask=attention_mask) - the default cache (4.55: DynamicCache() "
        "without the config); here the prefill and greedy decode steps",
        "make generate's default cache from the model's config (a sliding-window layer per local layer), as "
        "transformers 5.x does")
TRANSFORMERS_CALLS[("gpt_neo", "global-local4", "stored_windows")] = (
    "local-layers-cache-whole-history", "cached_tensors", "local_layers_history_gpt_neo",
    "model.generate(input_ids, attention_mask=attention_mask) - the default cache; here the prefill and greedy "
    "decode steps",
    "give GPTNeoConfig layer_types (sliding_attention for its local layers) so the cache keeps a window there")
TRANSFORMERS_CALLS[("gpt_neo", "global-local4", "stored_windows:static")] = (
    "static-local-layers-full-length", "cached_tensors", "static_local_layers_gpt_neo",
    "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its prefill",
    "preallocate window_size slots for the local layers (StaticSlidingWindowLayer), from layer_types")
for _text, _seen in (("family-P1 prefill", "p1"), ("family-P2 prefill", "p2"), ("family-ops (beam|assisted) prefill", "ops")):
    TRANSFORMERS_CALLS[("gpt_neo", "global-local4", _text)] = (
        f"static-cache-mask-from-key-length-{_seen}", None, "static_mask_from_key_length",
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its "
        "prefill",
        "take the causal/local mask rows from the queries' positions (cache_position), not from the key length "
        "(modeling_gpt_neo.py:116)")
for _family in ("deepseek_v2", "deepseek_v3"):
    TRANSFORMERS_CALLS[(_family, "mla", "is a view of a buffer that is no fused")] = (
        "value-view-of-kv-b-proj", "cached_tensors", "latent_value_view",
        "model.generate(input_ids, attention_mask=attention_mask) - the default DynamicCache; here its prefill",
        "cache the latent (as transformers 5.x does), or at least copy V out of kv_b_proj's output")
    TRANSFORMERS_CALLS[(_family, "mla", "stored_width")] = (
        "caches-expanded-kv-not-latent", "cached_tensors", "latent_expanded_kv",
        "model.generate(input_ids, attention_mask=attention_mask) - the default DynamicCache; here its prefill",
        "cache the compressed latent and the rope key part and expand them with kv_b_proj after the cache "
        "update, as transformers 5.x does")
    TRANSFORMERS_CALLS[(_family, "mla", "index_copy_")] = (
        "static-cache-prefill-index-copy", None, "static_cache_prefill_index_copy",
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its "
        "prefill",
        "preallocate StaticCache's K (qk_nope + qk_rope) and V (v_head_dim) as the model caches them, or the "
        "latent")

# the eager oracle's double ALiBi, as the sdpa cells see it (transformers[sdpa]/falcon/alibi: their values
# differ from eager's; the cause is eager's)
TRANSFORMERS_CALLS[("falcon", "alibi", "vs transformers' uncached forward")] = (
    "eager-attention-alibi-twice", None, "eager_alibi_twice",
    "model.generate(input_ids, attention_mask=attention_mask) - a Falcon with alibi=True (falcon-rw-1b) loaded with "
    "`attn_implementation=\"eager\"` or run with `output_attentions=True`; here one prompt's uncached forward",
    "add ALiBi to the scores once: leave it out of the causal mask on the eager path (or leave the scores' own "
    "`+ alibi` out, as the sdpa path does), as Falcon-RW's modeling_RW.py does")

TRANSFORMERS_TITLES = {"kv-cache-all-heads": "the prefill caches K/V for every query head, not num_kv_heads",
                      "window-slice-pins-evicted": "a sliding-window layer's cached K/V are slices that pin the "
                                                   "positions they evicted",
                      "local-layers-cache-whole-history": "the local (sliding-window) layers cache the whole history",
                      "static-local-layers-full-length": "the StaticCache preallocates the local layers to the cache "
                                                         "length, not the window",
                      "value-view-of-kv-b-proj": "the cached V is a view of kv_b_proj's output, pinning its K part",
                      "caches-expanded-kv-not-latent": "the cache holds the expanded K and V, not the latent",
                      "static-cache-prefill-index-copy": "the prefill into a StaticCache raises in index_copy_",
                      "eager-attention-alibi-twice": "eager attention adds ALiBi twice, so sdpa (which adds it "
                                                     "once) differs from the eager oracle",
                      **{f"static-cache-mask-from-key-length-{seen}": "with a StaticCache the prefill's logits are "
                         f"wrong: the attention mask is taken from the key length (seen by {check})"
                         for seen, check in (("p1", "family-P1"), ("p2", "family-P2"), ("ops", "family-ops"))}}


def transformers_call(entries: list[dict]):
    entry = entries[0]
    implementation, *where = target_of(entry)
    if split_attention(implementation)[0] != "transformers":
        return None
    found = [(text, value) for (family, variant, text), value in TRANSFORMERS_CALLS.items()
             if where == [family, variant] and text.split(":")[0] in entry["pattern"]]
    if entry.get("path") == "static" and any(text.endswith(":static") for text, _ in found):
        found = [(text, value) for text, value in found if text.endswith(":static")]
    else:
        found = [(text, value) for text, value in found if not text.endswith(":static")]
    return found[0][1] if found else None


def transformers_repro(entries: list[dict], slug: str) -> Repro:
    """A transformers finding a prefill shows, other than the view findings (`TRANSFORMERS_CALLS`)."""
    entry = entries[0]
    _, family, variant = target_of(entry)
    short, functions, operation, call, fix = transformers_call(entries)
    config_class, _ = class_names(family)
    # the pattern's own words, where it is plain text (a regular expression is no title)
    shown = TRANSFORMERS_TITLES.get(short, what(entry).replace("`", ""))
    title = f"transformers {family}/{variant}: {shown}"
    script = fill(template("transformers_call.py.tmpl"), title=title, summary=textwrap.fill(entry["reason"], 96),
                  upstream=entry["upstream"], when=versions(entry), config_class=config_class, family=family,
                  variant=variant, config=config_literal(tiny_config(family, variant)),
                  functions=part(functions) if functions else "", operation=part(operation))
    return Repro(slug, title, script, readme_text(entries, title, call, fix), tuple(entries))
