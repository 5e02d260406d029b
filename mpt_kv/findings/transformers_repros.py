"""The standalone repros of transformers' family findings (`mpt_kv.findings.repros` picks which): a
view finding (the prefill's cached K/V view the fused projection's output: templates/view.py.tmpl)
and the findings a prefill shows otherwise (templates/transformers_call.py.tmpl, its functions and
operation parts by finding: `TRANSFORMERS_CALLS`)."""

from __future__ import annotations

import textwrap

from mpt_kv.findings.raw import target_of
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
    return bool(entry.get("views")) and target_of(entry)[0] == "transformers"


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

TRANSFORMERS_TITLES = {"kv-cache-all-heads": "the prefill caches K/V for every query head, not num_kv_heads"}


def transformers_call(entries: list[dict]):
    entry = entries[0]
    implementation, *where = target_of(entry)
    if implementation != "transformers":
        return None
    return next((value for (family, variant, text), value in TRANSFORMERS_CALLS.items()
                 if where == [family, variant] and text in entry["pattern"]), None)


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
