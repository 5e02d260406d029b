"""The family checks catch what they are for on transformers' real implementation: a cache that
stores views of the fused projection's output (the transformers <4.56 bug, put back by patching
DynamicLayer.update) fails family-P3 and family-memory naming the module, the layer and the bytes;
a cache that loses the new token's value fails family-P1; a family entry that misdescribes its
cache is an error, not a verdict; legitimate layouts (K and V stacked in one buffer, a tensor of
its own) pin nothing. The known-failures file is checked field by field; the matrix follows the
run's targets. (tests/test_family_checks.py: each check against a broken wrapper of a runner.)
"""

import dataclasses
import json

import pytest
import torch

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.families import FAMILIES, variants
from mpt_kv import recipes
from mpt_kv.findings import entries as kf
from mpt_kv.checks.family import CHECKS
from mpt_kv.checks.family_storage import pinning_problems
from mpt_kv.catalogue.family_catalogue import store_first_as_given

# the family checks by property: (implementation, family, variant, path) -> notes
check_cached, check_memory, check_no_pinned_storage = CHECKS["family-P1"], CHECKS["family-memory"], CHECKS["family-P3"]

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")
# 4.x: its DynamicLayer is the views bug itself (the 4.55 findings are strict xfails of the
# conformance cases, mpt_kv/findings/family_known_failures.json)
needs_5x = pytest.mark.skipif(not hasattr(getattr(cache_utils, "DynamicLayer", None), "lazy_initialization"),
                              reason="these patches are written against transformers 5.x DynamicLayer")


# DynamicLayer.update as in transformers <4.56: the first K/V stored as they come (views of the
# fused output where the model splits one), later ones concatenated (the catalogue's one copy)
views_update = store_first_as_given


def lossy_update(self, key_states, value_states, *args, **kwargs):
    """Decode steps cache zeros instead of the new token's value."""
    first = not self.is_initialized
    if first:
        self.lazy_initialization(key_states, value_states)
    self.keys = torch.cat([self.keys, key_states], dim=-2)
    self.values = torch.cat([self.values, value_states if first else torch.zeros_like(value_states)], dim=-2)
    return self.keys, self.values


@needs_5x
@pytest.mark.parametrize("family, variant, expected", [
    # q, k, v of MPT are all views of mixed_qkv: K and V cover 2 of its 3 thirds, q's third is pinned
    ("mpt", "alibi", "layer 0 key (2, 4, 6, 8) and layer 0 value (2, 4, 6, 8) are views of "
                     "transformer.blocks.0.attn.Wqkv's output (2, 6, 96): its storage holds 4608 bytes, the cached "
                     "tensors in it 3072: 1536 bytes pinned beyond the cache"),
    # GPT-NeoX's rotary copies K; V stays a view and pins the q and k thirds
    ("gpt_neox", "mha", "layer 0 value (2, 4, 6, 8) is a view of gpt_neox.layers.0.attention.query_key_value's "
                        "output (2, 6, 96): its storage holds 4608 bytes, the cached tensors in it 1536: 3072 bytes "
                        "pinned beyond the cache"),
])
def test_p3_and_memory_catch_views_of_the_fused_output(monkeypatch, family, variant, expected):
    check_no_pinned_storage("transformers", family, variant)  # the real 5.x cache copies: nothing pinned
    check_memory("transformers", family, variant)
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", views_update)
    context = (f"[target=transformers/{family}, implementation=transformers, family={family}, variant={variant}, "
               "path=concat, device=cpu, dtype=float32, batch=2, step=prefill, operation=prefill]")
    for check, start in ((check_no_pinned_storage, "family-P3 cache pins storage after prefill: "),
                         (check_memory, "family-memory after prefill: the cache's distinct storages hold ")):
        with pytest.raises(PropertyFailure) as e:
            check("transformers", family, variant)
        msg = str(e.value)
        assert msg.startswith(start)
        assert expected in msg and expected.replace("layer 0", "layer 1").replace(".0.", ".1.") in msg
        assert msg.endswith(context)


@needs_5x
def test_p3_passes_the_real_cache_and_p1_catches_a_lossy_one(monkeypatch):
    check_no_pinned_storage("transformers", "llama", "gqa")
    check_cached("transformers", "llama", "gqa")
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", lossy_update)
    with pytest.raises(PropertyFailure, match=r"family-P1 decode step 1: cached logits vs transformers' uncached "
                                              r"forward over each row's tokens differ .*target=transformers/llama, "
                                              r"implementation=transformers, family=llama, variant=gqa"):
        check_cached("transformers", "llama", "gqa")


def test_a_family_entry_that_misdescribes_its_cache_is_an_error(monkeypatch):
    wrong = dataclasses.replace(FAMILIES["llama"], kv_heads=lambda c: c.num_attention_heads)
    monkeypatch.setitem(FAMILIES, "llama", wrong)
    with pytest.raises(RuntimeError, match=r"family llama: the cache holds 3072 bytes of K/V, the family entry "
                                           r"says 6144 \(2 x 6 tokens\)"):
        check_no_pinned_storage("transformers", "llama", "gqa")


def test_pinning_problems_legitimate_layouts_and_a_view():
    stacked = torch.zeros(2, 2, 4, 6, 8)  # K and V of one layer in one buffer: nothing pinned
    own = torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 8)
    assert pinning_problems([(0, "key", stacked[0]), (0, "value", stacked[1]), (1, "key", own[0]),
                             (1, "value", own[1])], {}) == []
    fused = torch.zeros(2, 6, 3 * 32)
    key = fused[..., 32:64].view(2, 6, 4, 8).transpose(1, 2)
    [problem] = pinning_problems([(0, "key", key)], {"attn.qkv": fused})
    assert problem == ("layer 0 key (2, 4, 6, 8) is a view of attn.qkv's output (2, 6, 96): its storage holds 4608 "
                       "bytes, the cached tensors in it 1536: 3072 bytes pinned beyond the cache")
    [problem] = pinning_problems([(0, "key", key)], {})
    assert "is a view of a buffer that is no fused projection's output of this step" in problem


def test_analytic_kv_bytes_are_mqa_and_gqa_aware():
    f = FAMILIES["falcon"]
    assert f.kv_bytes_per_token(f.config("rotary-mqa"), torch.float32) == 2 * 2 * 1 * 8 * 4
    assert f.kv_bytes_per_token(f.config("alibi"), torch.bfloat16) == 2 * 2 * 4 * 8 * 2
    assert f.kv_bytes_per_token(f.config("new-arch-gqa"), torch.float32) == 2 * 2 * 2 * 8 * 4
    assert f.stored_kv_bytes_per_token(f.config("new-arch-gqa"), torch.float32) == 2 * 2 * 4 * 8 * 4
    g = FAMILIES["gpt_bigcode"]
    assert g.kv_bytes_per_token(g.config("mqa"), torch.float32) == 2 * 2 * 1 * 8 * 4
    assert FAMILIES["dbrx"].kv_bytes_per_token(FAMILIES["dbrx"].config("gqa"), torch.float32) == 2 * 2 * 2 * 8 * 4


def test_registry_has_the_families_and_fused_names():
    assert len({f for f, _ in variants()}) >= 17
    fused = {n: f.fused for n, f in FAMILIES.items()}
    assert fused["mpt"] == fused["dbrx"] == "Wqkv" and fused["gpt2"] == fused["gpt_bigcode"] == "c_attn"
    assert fused["llama"] is fused["gptj"] is fused["phi"] is None
    with pytest.raises(ValueError, match=r"family llama has no variant 'x': variants \['fused-qkv', 'gqa', 'mha', 'mqa'\]"):
        FAMILIES["llama"].config("x")


@pytest.mark.parametrize("change, message", [
    ({"family": "nope"}, r"no family variant nope/alibi"),
    ({"property": "P3"}, r"unknown property 'P3'"),
    ({"pattern": ".*"}, r"matches the empty string"),
    ({"when": {"transformers": "four"}}, r"not a version specifier"),
    ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
    ({"viewz": ["key"]}, r"unknown field\(s\) \['viewz'\]"),  # a typo of an optional field
    ({"implementation": "vllm"}, r"unknown implementation 'vllm'"),
    ({"path": "paged"}, r"unknown path 'paged'"),
    ({"views": ["query"]}, r"'views' \['query'\]: a non-empty list of distinct names"),
    ({"views": []}, r"'views' \[\]: a non-empty list"),
    ({"views": "key"}, r"'views' must be a list"),
    ({"cost_config": "no-such-model"}, r"'cost_config' 'no-such-model' is no real config of"),
    ({"reason": " "}, r"'reason' is empty"),
])
def test_known_failures_file_is_checked(tmp_path, change, message):
    entry = {"family": "mpt", "variant": "alibi", "property": "family-P3", "pattern": "Wqkv's output",
             "reason": "r", "upstream": "u", "when": {}}
    path = tmp_path / "k.json"
    path.write_text(json.dumps([{**entry, **change}]))
    with pytest.raises(ValueError, match=r"family known failures .*k\.json: entry 0: .*" + message):
        kf.load_families(path)
    path.write_text(json.dumps([entry, {**entry, "implementation": "optimum-habana", "path": "static",
                                        "views": ["key", "value"]}]))
    known, port = kf.load_families(path)
    assert (known.implementation, known.path, known.views) == ("transformers", None, ())
    assert kf.match("transformers/mpt/alibi", "family-P3", "static", [known]) is known  # every path
    assert kf.match("transformers/mpt/alibi", "family-P1", "concat", [known]) is None
    assert kf.match("optimum-habana/mpt/alibi", "family-P3", "static", [known, port]) is port
    assert kf.match("optimum-habana/mpt/alibi", "family-P3", "concat", [known, port]) is None
    assert port.views == ("key", "value")
    path.write_text(json.dumps([{**entry, "cost_config": "mpt-7b"}]))  # the seed's config, mpt_kv/data/mpt-7b.json
    assert kf.load_families(path)[0].cost_config == "mpt-7b"


def test_the_packaged_known_failures_load_and_the_views_are_on_the_concat_path():
    entries = kf.load_families()
    views = [e for e in entries if e.implementation == "transformers" and "view" in e.pattern.pattern]
    assert {e.property for e in views} == {"family-P3", "family-memory", "generate"}  # generate: its drive sees them too
    assert all(e.path == "concat" for e in views)  # transformers' StaticCache copies: no views there


@needs_5x
def test_a_known_failure_absorbs_only_its_own_message(monkeypatch):
    """Fail closed: the one known-failure rule (mpt_kv.findings.entries, which the plugin applies
    to the family cases as to the MPT ones) takes only the PropertyFailure its entry's pattern finds."""
    import re

    from mpt_kv import CHECKS as ALL_CHECKS
    from mpt_kv.findings.entries import Entry

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", views_update)
    with pytest.raises(PropertyFailure, match="Wqkv's output") as failure:
        ALL_CHECKS["family-P3/concat"]("transformers/mpt/alibi")
    known = Entry(0, "transformers/mpt/alibi", "family-P3", "r", re.compile(r"layer 0 key .* are views of \S+Wqkv's output"))
    assert known.covers("transformers/mpt/alibi", "family-P3", "concat", None, "family-P3/concat")
    assert known.explains(failure.value)  # the known failure: the xfail takes it
    other = dataclasses.replace(known, pattern=re.compile(r"query_key_value's output"))
    assert not other.explains(failure.value)  # another one's pattern: the case fails


def test_the_matrix_cells_follow_the_implementations():
    from mpt_kv.conformance.test_families import cases

    # (check, target): parametrize_with_checks' marker; the plugin gives device and dtype (tests/test_plugin_parametrize.py)
    transformers_cells = [p.values for p in cases(["transformers"]).args[1]]
    port_cells = [p.values for p in cases(["optimum-habana"]).args[1]]
    assert cases([]) is None  # no implementation: no cell (the module's placeholder says why)
    assert {t.implementation for _, t in transformers_cells} == {"transformers"}
    assert {t.implementation for _, t in port_cells} == {"optimum-habana"}
    # P0 is not drawn for transformers itself with eager attention (its oracle): only for another attention
    # implementation of it, against eager; P2 only on static paths; static+reuse only for the ports
    assert not [c for c, _ in transformers_cells if c.path == "static+reuse"]
    assert {t.attention for c, t in transformers_cells if c.property == "family-P0"} == {"sdpa"}
    assert {c.path for c, _ in port_cells if c.property == "family-P0"} == {"concat"}
    assert {recipes.split(c.path)[0] for c, _ in port_cells if c.property == "family-P2"} == {"static", "static+reuse"}
    # concat: P0 and 5 more; each static path, a recipe's included (mpt_kv/recipes.py: on the variant it
    # names): P2 and 5 more; a remote-code family's port is its own oracle (baichuan): no P0 cell
    remote = [(f, v) for f, v in variants() if FAMILIES[f].remote_code]
    recipe_paths = [r for f, v in variants() for r in recipes.recipes_of(f, v)]
    assert recipe_paths and not [c for c, _ in port_cells if c.path.startswith("concat@")]
    assert remote and len(port_cells) == (len(variants()) * 3 + len(recipe_paths)) * 6 - len(remote)
    assert not [t for c, t in port_cells if c.property == "family-P0" and t.family_name == "baichuan"]
    # transformers: each variant with sdpa (P0 and 5 more on concat, 6 on static) and with eager (no P0); a
    # remote-code family has no transformers model, nor an attention axis: one target (its cells unsupported)
    assert len(transformers_cells) == (len(variants()) - len(remote)) * (12 + 11) + len(remote) * 11
    names = {(t.name, c.id) for c, t in transformers_cells}
    assert ("transformers[eager]/falcon/new-arch-gqa", "family-memory/static") in names
    assert ("transformers[sdpa]/falcon/new-arch-gqa", "family-P0/concat") in names
    assert ("transformers/baichuan/alibi", "family-P1/concat") in names


@pytest.mark.parametrize("options, expected", [
    (["--only-targets", "--target", "transformers"], {"transformers"}),
])
def test_the_run_selects_the_implementations(options, expected):
    """As for MPT: the built-in targets (both: test_the_matrix_cells_follow_the_implementations),
    or with --only-targets only those named."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-n", "0",
                          "mpt_kv/conformance/test_families.py", *options], capture_output=True, text=True,
                         cwd=__import__("pathlib").Path(__file__).parents[1], env={**__import__("os").environ,
                                                                                  "CI": "true"})
    ids = [line for line in out.stdout.splitlines() if "::test_family[" in line]
    assert ids, out.stdout[-2000:] + out.stderr[-2000:]
    # an id: <device>-<dtype>-<check id>-<implementation>/<family>/<variant>, the implementation as its cases name
    # it: transformers[sdpa], transformers[eager], optimum-habana
    assert {impl for i in ids for impl in ("transformers", "optimum-habana")
            if f"-{impl}/" in i or f"-{impl}[" in i} == expected


@pytest.mark.parametrize("implementation, prop, path", [
    ("transformers", "family-P0", None), ("transformers", "family-P1", "static+reuse"),
    ("optimum-habana", "family-P2", "concat"), ("optimum-habana", "family-P0", "static")])
def test_an_entry_about_a_cell_the_matrix_lacks_is_an_error(implementation, prop, path):
    import re

    from mpt_kv.findings.entries import Entry
    from mpt_kv.findings.entries import check_entries_cover_cells

    entry = Entry(0, f"{implementation}/mpt/alibi", prop, "r", re.compile("x"), path)
    with pytest.raises(ValueError, match=rf"family known failure {implementation} mpt/alibi {prop} path "
                                         rf"{re.escape(path or 'any')}: the matrix has no such cell"):
        check_entries_cover_cells([entry])
    check_entries_cover_cells([dataclasses.replace(entry, property="family-P3", path=None)])


def test_every_build_of_a_family_gives_the_config_the_first_build_gave():
    """A port is built from the config transformers' build returns. The first build of a process returned it with
    eager attention set, a later one (the model cached) a fresh config, from which a port picked transformers'
    default (sdpa in 4.55): which attention the ports ran depended on xdist's order of the cases (seen as reach
    that moved between two runs of the ohabana env, `python -m mpt_kv coverage`)."""
    from mpt_kv.families.models import build

    model, first = build(FAMILIES["llama"], "mha")
    again_model, again = build(FAMILIES["llama"], "mha")
    assert first._attn_implementation == again._attn_implementation == "eager"
    assert again is not first and again_model is not model


def test_the_tiny_configs_build_without_transformers_warnings():
    """A family's tiny config keeps the Hub config's special token ids outside its small vocabulary (GPT-2's
    50256): transformers 5.x warns about it, once per process, at collection, at the top of every run. No
    check reads them; the config is built with that warning silenced, and the logger's level restored."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("transformers.configuration_utils")
    warning_once = getattr(logging.Logger, "warning_once", None)
    if hasattr(warning_once, "cache_clear"):
        warning_once.cache_clear()  # transformers' once-per-message cache: an earlier build would hide a warning
    log.addHandler(handler)
    level = log.level
    try:
        for name, family in FAMILIES.items():
            if family.remote_config is None:
                for variant in family.variants:
                    family.config(variant)
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    assert log.level == level
