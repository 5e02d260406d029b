"""How a user reaches each finding (mpt_kv.findings.user_path): the findings table's column."""

import pytest

from mpt_kv.findings import user_path
from mpt_kv.findings.raw import raw_entries, target_of

ENTRIES = raw_entries()


def entry(implementation, family, variant, pattern_start, path=None):
    """The file's first entry of that finding (so a renamed or removed one fails here, not silently)."""
    found = [e for e in ENTRIES if target_of(e) == (implementation, family, variant) and e["pattern"].startswith(pattern_start)
             and (path is None or e.get("path") == path)]
    assert found, f"no {implementation} {family}/{variant} entry whose pattern starts {pattern_start!r}"
    return found[0]


@pytest.mark.parametrize("implementation,family,variant,pattern,path,kind,call", [
    # transformers 4.55's views: every generate with a cache; MPT's config turns the cache off by default
    ("transformers", "gpt2", "mha", "layer 0", "concat", "default", "`generate(...)` (use_cache, its default)"),
    ("transformers", "mpt", "alibi", "layer 0", "concat", "option", "use_cache=True"),
    ("transformers", "falcon", "rotary-mqa", "the implementation's prefill", "static", "option",
     'cache_implementation="static"'),
    # optimum-habana: static shapes are its default; beam search and reuse_cache are options
    ("optimum-habana", "mpt", "alibi", "the implementation's reorder", "concat", "option",
     "num_beams=2, static_shapes=False"),
    ("optimum-habana", "phi", "mha", "the implementation's reorder", "static+reuse", "option",
     "num_beams=2, reuse_cache=True"),
    ("optimum-habana", "mpt", "alibi", "the implementation's extend", "concat", "non-standard",
     "past_key_values=<an earlier generate's cache>, static_shapes=False"),
    ("optimum-habana", "starcoder2", "gqa", "raised KeyError", None, "default", "static shapes, its default"),
    # written out where the pattern does not say it (OVERRIDES, VARIANT_OPTIONS)
    ("optimum-habana", "falcon", "alibi", "(family-P0 uncached logits", None, "option", 'attn_implementation="eager"'),
    ("optimum-habana", "llama", "fused-qkv", "prefill raised AttributeError", None, "option", "fused_qkv=True"),
])
def test_route(implementation, family, variant, pattern, path, kind, call):
    got_kind, got_call = user_path.user_path(entry(implementation, family, variant, pattern, path))
    assert (got_kind, call in got_call) == (kind, True), (got_kind, got_call)


def test_every_entry_has_a_route_and_every_override_an_entry():
    for e in ENTRIES:
        assert user_path.user_path(e)[0] in user_path.KINDS, e
    for impl, family, variant, prefix in user_path.OVERRIDES:
        entry(impl, family, variant, prefix)  # a stale override (its entry gone) fails here
    for impl, family, variant in user_path.VARIANT_OPTIONS:
        assert any(target_of(e) == (impl, family, variant) for e in ENTRIES), (impl, family, variant)


def test_a_finding_takes_its_most_reachable_route():
    reorder = entry("optimum-habana", "mpt", "alibi", "the implementation's reorder", "concat")
    extend = entry("optimum-habana", "mpt", "alibi", "the implementation's extend", "concat")
    assert user_path.most_reachable([extend, reorder])[0] == "option"
    assert user_path.cell([extend]).startswith("non-standard: ")


def test_of_equal_kinds_the_default_path_wins():
    """mpt's beam reorder crashes on both paths of optimum-habana: static shapes are its default, so the
    finding is reached by num_beams alone, not num_beams and static_shapes=False."""
    concat = entry("optimum-habana", "mpt", "alibi", "the implementation's reorder", "concat")
    static = dict(concat, path="static")
    assert user_path.most_reachable([concat, static]) == ("option", "`generate(..., num_beams=2)` (static shapes, its default)")
