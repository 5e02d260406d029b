"""The Gaudi zoo's cache designs under the family checks: sliding windows, hybrid local/global
caches, multi-head latent attention, mixtures of experts. Each generalization of a check has a
must-pass design (a legitimate cache of that design passes) and a must-kill variant (a broken one
fails, naming what broke): the family catalogue's (mpt_kv/catalogue/family_catalogue.py,
transformers' real implementation with one scoped change), run here on each family of the design;
the tiny configs have each design's edges (a window shorter than the prompt, crossed during
decode, crossed by the k-token call; a latent smaller than the head dim; 2 of 4 experts), which
the checks' programs reach (measured: tests/test_reach.py).
"""

import sys
from types import SimpleNamespace

import pytest
import torch

from mpt_kv.catalogue.family_catalogue import FAMILY_DESIGNS, FAMILY_VARIANTS, run
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.families import FAMILIES
from mpt_kv.checks import family_driver as checks
from mpt_kv.checks.family import CHECKS

check_cached, check_memory = CHECKS["family-P1"], CHECKS["family-memory"]
check_no_pinned_storage, check_static_concat = CHECKS["family-P3"], CHECKS["family-P2"]

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")
# the window and latent caches these patch are transformers 5.x's (4.55.4 keeps the whole history
# and caches DeepSeek's expanded K/V: known failures, mpt_kv/findings/family_known_failures.json)
needs_5x = pytest.mark.skipif(not hasattr(cache_utils, "DynamicSlidingWindowLayer")
                              or int(transformers.__version__.split(".")[0]) < 5,
                              reason="transformers 5.x's sliding-window and latent caches")
ZOO = ("gemma", "gemma2", "gemma3", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
       "cohere", "gpt_neo", "gpt_oss", "opt", "xglm", "baichuan", "decilm", "chatglm", "minicpm")


@pytest.fixture(autouse=True)
def fresh_runners():
    """Each test patches a cache class: no runner or oracle built under another test's patch."""
    checks.clear_caches()
    yield
    checks.clear_caches()


def config(name):
    family = FAMILIES[name]
    return family, family.config(next(iter(family.variants)))


# --- the analytic bytes of window, hybrid and latent caches --------------------------------------------------

def test_analytic_bytes_of_a_hybrid_cache_count_each_layer_its_own_tokens():
    family, c = config("gemma2")  # layer 0 sliding (window 4), layer 1 global; 2 K/V heads x head dim 8
    assert family.layer_windows(c) == [4, None]
    per_position = 2 * 2 * 8 * 4  # K and V, fp32
    # concat: the window keeps its last w - 1 positions, the global layer all of them
    assert family.layer_tokens(c, written=6) == [3, 6]
    assert family.cache_bytes(c, torch.float32, batch=2, written=6) == 2 * per_position * (3 + 6)
    assert family.layer_tokens(c, written=2) == [2, 2]  # before the edge, a window holds everything
    # static: a window's buffer has w slots, the global layer's the cache length
    assert family.cache_bytes(c, torch.float32, batch=2, written=6, static_len=16) == 2 * per_position * (4 + 16)


def test_analytic_bytes_of_a_latent_cache_are_the_latent_not_k_and_v():
    family, c = config("deepseek_v2")
    assert c.kv_lora_rank < c.qk_nope_head_dim + c.qk_rope_head_dim  # the latent is smaller than a head
    assert family.layer_widths(c) == [c.kv_lora_rank + c.qk_rope_head_dim] * 2 == [8, 8]
    assert family.cache_bytes(c, torch.float32, batch=2, written=6) == 2 * 8 * 2 * 6 * 4
    assert family.kv_bytes_per_token(c, torch.bfloat16) == 2 * 8 * 2
    assert "a latent of 8 per token" in family.describe_cache(c)


# Every family's analytic bytes before the per-layer widths (main 934b009's code, both envs): fp32 bytes per
# token, a concat cache of 2 x 6 tokens, a static one of 2 x 16 slots (windows counted: mistral's 7)
BYTES_BEFORE_PER_LAYER_WIDTHS = {
    "mpt/alibi": (512, 6144, 16384), "falcon/alibi": (512, 6144, 16384), "falcon/rotary-mqa": (128, 1536, 4096),
    "falcon/new-arch-gqa": (256, 3072, 8192), "gpt_bigcode/mqa": (128, 1536, 4096),
    "gpt_bigcode/mha": (512, 6144, 16384), "bloom/alibi": (512, 6144, 16384), "gpt2/mha": (512, 6144, 16384),
    "gpt_neox/mha": (512, 6144, 16384), "codegen/mha": (512, 6144, 16384), "persimmon/mha": (512, 6144, 16384),
    "phi/gqa": (256, 3072, 8192), "phi/mha": (512, 6144, 16384), "phi3/gqa": (256, 3072, 8192),
    "llama/mha": (512, 6144, 16384), "llama/gqa": (256, 3072, 8192), "llama/mqa": (128, 1536, 4096),
    "llama/fused-qkv": (256, 3072, 8192), "qwen2/gqa": (256, 3072, 8192), "mistral/gqa": (256, 3072, 3584),
    "starcoder2/gqa": (256, 3072, 8192), "gptj/mha": (512, 6144, 16384), "stablelm/gqa": (256, 3072, 8192),
    "dbrx/gqa": (256, 3072, 8192), "gemma/gqa": (256, 3072, 8192), "gemma2/hybrid-window4": (256, 2304, 5120),
    "gemma3/hybrid-window9": (256, 3072, 6400), "qwen3/gqa": (256, 3072, 8192),
    "qwen3_moe/moe-2of4": (256, 3072, 8192), "qwen2_moe/moe-2of4": (256, 3072, 8192),
    "mixtral/moe-2of4": (256, 3072, 8192), "deepseek_v2/mla": (64, 768, 2048), "deepseek_v3/mla": (64, 768, 2048),
    "cohere/gqa-qk-norm": (256, 3072, 8192), "gpt_neo/global-local4": (512, 4608, 10240),
    "gpt_oss/hybrid-window7": (256, 3072, 5888), "opt/mha": (512, 6144, 16384), "xglm/mha": (512, 6144, 16384),
    "baichuan/alibi": (512, 6144, 16384)}


@pytest.mark.parametrize("case", [pytest.param(k, marks=[pytest.mark.optimum_habana] if k.startswith("baichuan") else [])
                                  for k in BYTES_BEFORE_PER_LAYER_WIDTHS])
def test_per_layer_widths_leave_every_earlier_familys_bytes_unchanged(case):
    name, variant = case.split("/")
    family = FAMILIES[name]
    c = family.config(variant)
    got = (family.kv_bytes_per_token(c, torch.float32), family.cache_bytes(c, torch.float32, 2, 6),
           family.cache_bytes(c, torch.float32, 2, 6, static_len=16))
    assert got == BYTES_BEFORE_PER_LAYER_WIDTHS[case]


def test_stored_kv_heads_stay_the_stored_bytes():
    family = FAMILIES["falcon"]  # the new architecture caches K/V broadcast to its 4 query heads
    c = family.config("new-arch-gqa")
    assert family.layer_widths(c) == [32, 32] and family.layer_widths(c, stored=True) == [64, 64]
    assert family.stored_kv_bytes_per_token(c, torch.bfloat16) == 256
    assert family.cache_bytes(c, torch.float32, 3, 11, stored=True) == 16896


@pytest.mark.optimum_habana
def test_per_layer_kv_heads_make_per_layer_widths():
    family, c = config("decilm")  # layers of 4, 2 and 1 K/V heads (MHA, GQA, MQA), head dim 8
    assert family.layer_kv_heads(c) == [4, 2, 1] and family.layer_widths(c) == [64, 32, 16]
    assert family.kv_bytes_per_token(c, torch.float32) == (64 + 32 + 16) * 4
    assert family.cache_bytes(c, torch.float32, batch=2, written=6) == 2 * 6 * (64 + 32 + 16) * 4
    assert family.cache_bytes(c, torch.float32, batch=2, written=6, static_len=16) == 2 * 16 * (64 + 32 + 16) * 4
    assert family.describe_cache(c) == "3 layers x [4, 2, 1] K/V heads x head dim 8"


def test_a_per_layer_heads_entry_that_does_not_fit_the_layers_is_an_error():
    import dataclasses

    family, c = config("llama")
    with pytest.raises(ValueError, match=r"family entry llama: kv_heads\(config\) gives 3 layers, layers\(config\) 2"):
        dataclasses.replace(family, kv_heads=lambda c: [4, 2, 1]).cache_bytes(c, torch.float32, 2, 6)


def test_declared_excess_windows_are_the_stored_bytes_not_the_analytic_ones():
    family, c = config("gpt_neo")  # transformers caches the local layer's whole history
    assert family.layer_windows(c) == [None, 4] and family.layer_windows(c, stored=True) == [None, None]
    assert family.cache_bytes(c, torch.float32, 2, 6, stored=True) > family.cache_bytes(c, torch.float32, 2, 6)


def test_a_window_entry_that_does_not_fit_the_layers_is_an_error():
    import dataclasses

    family, c = config("gemma2")
    wrong = dataclasses.replace(family, windows=lambda c: [4])
    with pytest.raises(ValueError, match=r"family entry gemma2: windows\(config\) gives 1 layers, layers\(config\) 2"):
        wrong.cache_bytes(c, torch.float32, 2, 6)


# --- the tiny configs reach each design's edges ----------------------------------------------------------------

# Which edges the checks' programs reach is measured from a run of them, not computed from the program's
# constants: tests/test_reach.py (test_the_family_programs_reach_every_edge_the_zoo_claims), docs/families.md's
# generated block.

WINDOWED = [n for n, f in FAMILIES.items() if f.windows is not None and not f.remote_code]


@pytest.mark.parametrize("name", WINDOWED)
def test_the_measuring_checks_drive_every_tiny_window_past_its_edge(name):
    """family-P3, P4 and memory take no k-token call: their closing decodes carry every tiny window past
    its edge (gemma3's 9 needs 4 decodes after its prompt of 6), so the checks that measure the cache see
    it slide, not P1 alone."""
    family, c = config(name)
    written = checks.PROMPT + checks.STEPS + checks.closing_decodes(SimpleNamespace(family=family, config=c))
    widest = max(w for w in family.layer_windows(c) if w is not None)
    assert written > widest, f"{name}: P3/P4/memory write {written} positions, its window is {widest}"
    assert written <= checks.MAX_LEN


def test_a_window_past_the_sessions_cache_is_not_driven_to():
    family, c = config("gemma3")
    c.sliding_window = checks.MAX_LEN  # a real window (mistral-7b's 4096) does not fit the tiny program
    assert checks.closing_decodes(SimpleNamespace(family=family, config=c)) == 1


def test_the_mixtures_of_experts_route_2_of_4():
    for name, experts, top in (("mixtral", "num_local_experts", "num_experts_per_tok"),
                               ("qwen2_moe", "num_experts", "num_experts_per_tok"),
                               ("qwen3_moe", "num_experts", "num_experts_per_tok"),
                               ("deepseek_v2", "n_routed_experts", "num_experts_per_tok"),
                               ("gpt_oss", "num_local_experts", "num_experts_per_tok")):
        _, c = config(name)
        assert (getattr(c, experts), getattr(c, top)) == (4, 2), name


def test_the_zoo_is_registered():
    assert set(ZOO) <= set(FAMILIES)
    assert {FAMILIES[n].design for n in ("gemma2", "gemma3", "gpt_oss", "deepseek_v2")} == {
        "hybrid+softcap", "hybrid+qk-norm", "hybrid+sinks+moe", "latent+moe"}
    # the remote-code families: the port's own copy of the Hub files is the model
    assert [n for n in ZOO if FAMILIES[n].remote_code] == ["baichuan", "decilm", "chatglm", "minicpm"]


# --- must-pass designs and must-kill variants (mpt_kv/catalogue/family_catalogue.py) -------------------------
# One copy of each pair, the catalogue's: the kill matrix runs them on one family each
# (`python -m mpt_kv killmatrix`, its family rows); these run them on every family of the design and
# say what each failure must name.

@needs_5x
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "mistral"])
def test_window_memory_passes_a_copying_window_and_kills_the_slice_and_the_history(name):
    run(FAMILY_DESIGNS["window_copied"], "family-P3", family=name)  # must-pass: the window's own bytes, nothing pinned
    run(FAMILY_DESIGNS["window_copied"], "family-memory", family=name)
    # must-kill 1: the slice (transformers 5.24's own) pins the evicted positions
    with pytest.raises(PropertyFailure, match=r"family-P3 cache pins storage after .*layer 0 key \(2, 2, \d, 8\) is "
                                              r"a view of a buffer that is no fused projection's output"):
        run(FAMILY_VARIANTS["window_slice_pins_evicted"], "family-P3", family=name)
    # must-kill 2: a window that keeps a position too many: right values, nothing pinned, the excess
    # named against the window's bytes
    roomy = FAMILY_VARIANTS["window_one_too_many"]
    run(roomy, "family-P1", family=name)
    run(roomy, "family-P3", family=name)
    with pytest.raises(PropertyFailure, match=r"family-memory after .*: \+\d+ bytes; the cached tensors themselves hold "
                                              r"\d+ bytes, \+\d+ vs the analytic K/V \d+ \(2 layers x 2 K/V heads x "
                                              r"head dim 8, windows per layer \[\d, (None|\d)\] x 2 x \d+ tokens\)"):
        run(roomy, "family-memory", family=name)


@needs_5x
@pytest.mark.parametrize("name, first_wrong", [
    # the first call whose queries need the w - 1 positions before them from the cache
    ("gemma2", "decode step 1"),      # window 4 < prompt 6: the first cached call
    ("gpt_oss", "decode step 1"),     # window 7: the prompt's 6 positions are w - 1
    ("mistral", "decode step 1"),     # window 7 on every layer, as gpt_oss's local layer
    ("gemma3", r"extend 3 \(step 3\)")])  # window 9: the 3-token call, after 8 positions
def test_p1_across_the_window_edge_kills_a_window_one_short(name, first_wrong):
    check_cached("transformers", name, next(iter(FAMILIES[name].variants)))  # must-pass: transformers' window
    with pytest.raises(PropertyFailure, match=rf"family-P1 {first_wrong}: cached logits vs transformers' uncached "
                                              rf"forward over each row's tokens differ"):
        run(FAMILY_VARIANTS["window_one_short"], "family-P1", family=name)


@needs_5x
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_hybrid_static_memory_passes_window_slots_and_kills_full_length_local_layers(name):
    slots = FAMILY_DESIGNS["window_slots_static"]
    run(slots, "family-memory", family=name)  # must-pass: w slots for the local layer
    run(slots, "family-P2", family=name)  # P2: the window layer by its logits
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: .* \+\d+ vs the analytic K/V \d+ \(2 layers "
                                              r"x 2 K/V heads x head dim 8, windows per layer \[\d, None\] x 2 x 16 "
                                              r"tokens\)"):
        run(FAMILY_VARIANTS["window_static_full_length"], "family-memory", family=name)


@needs_5x
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_latent_p3_passes_the_latent_and_kills_a_view_of_the_fused_latent_projection(name):
    """P3's fused-projection rule on the latent projection: `kv_a_proj_with_mqa` makes the latent
    and the rope key part in one output; a cache that keeps the latent as a view of it (cached
    before its norm, normed when read: the same values) pins the rope part."""
    run(FAMILY_DESIGNS["latent_cached"], "family-P3", family=name)  # must-pass: the normed latent, its own tensor
    run(FAMILY_DESIGNS["latent_cached"], "family-memory", family=name)
    view = FAMILY_VARIANTS["latent_view_of_fused_projection"]
    run(view, "family-P1", family=name)  # the norm on read: the same values
    with pytest.raises(PropertyFailure, match=r"family-P3 cache pins storage after prefill: layer 0 key \(2, 1, 6, 4\) "
                                              r"is a view of model\.layers\.0\.self_attn\.kv_a_proj_with_mqa's output "
                                              r"\(2, 6, 8\): its storage holds 384 bytes, the cached tensors in it 192"):
        run(view, "family-P3", family=name)


@needs_5x
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_p1_passes_batched_experts_and_kills_routing_that_needs_the_history(name):
    """Routing in a cached step sees only the new tokens: experts computed another way pass; a
    capacity router whose counts the cache does not keep routes a cached step as if the history
    were empty, and P1 names the first cached call (the prefill, routed as the uncached forward, holds)."""
    batched = FAMILY_DESIGNS["experts_batched_mm"]
    run(batched, "family-P1", family=name)
    run(batched, "family-memory", family=name)  # the cache is the attention's alone
    capacity = FAMILY_VARIANTS["routing_capacity_not_cached"]
    with pytest.raises(PropertyFailure, match=r"family-P1 decode step 1: cached logits vs transformers' uncached "
                                              r"forward over each row's tokens differ"):
        run(capacity, "family-P1", family=name)
    run(capacity, "family-memory", family=name)  # its cache holds the attention's K/V, right: P1's to kill


@needs_5x
def test_a_catalogue_patch_is_undone_whatever_the_check_raised():
    from mpt_kv.catalogue.family_catalogue import applied

    update = cache_utils.DynamicSlidingWindowLayer.__dict__["update"]
    with pytest.raises(PropertyFailure):
        run(FAMILY_VARIANTS["window_one_short"], "family-P1")
    with pytest.raises(ZeroDivisionError), applied(FAMILY_VARIANTS["window_slice_pins_evicted"]):
        assert cache_utils.DynamicSlidingWindowLayer.__dict__["update"] is not update
        1 / 0
    assert cache_utils.DynamicSlidingWindowLayer.__dict__["update"] is update
    # a model change is the implementation's alone: the oracle (transformers' model) is not changed
    run(FAMILY_VARIANTS["latent_view_of_fused_projection"], "family-P1")
    oracle = checks.oracle_model(FAMILIES["deepseek_v2"], "mla", torch.float32)
    assert all(not isinstance(m.kv_a_layernorm, torch.nn.Identity) for m in oracle.modules()
               if hasattr(m, "kv_a_layernorm"))


# --- a remote-code family: the port's own model is the model and its oracle -------------------------------------

def test_a_remote_code_family_has_no_transformers_implementation():
    from mpt_kv.errors import TargetUnavailable
    from mpt_kv.families.implementations import family_targets, transformers_runner

    with pytest.raises(TargetUnavailable, match=r"transformers ships no baichuan model: the architecture is Hub "
                                                r"remote code .*optimum-habana's port is its model and oracle"):
        transformers_runner(FAMILIES["baichuan"], "alibi")
    # the port is its own oracle: no family-P0 cell for it
    assert all(t.oracle for t in family_targets(["optimum-habana"]) if t.family_name == "baichuan")
    assert not any(t.oracle for t in family_targets(["optimum-habana"]) if t.family_name == "qwen3")


@pytest.mark.optimum_habana
def test_a_remote_code_family_is_checked_against_its_ports_uncached_forward():
    """baichuan: the tiny model is the port's own (seeded, its norms set to 1, finite), the oracle its
    runner's uncached forward; P3 on the concat path sees the K/V views of W_pack's output."""
    from mpt_kv.families.models import build

    model, config = build(FAMILIES["baichuan"], "alibi")
    assert type(model).__module__ == "optimum.habana.transformers.models.baichuan.modeling_baichuan"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    check_no_pinned_storage("optimum-habana", "baichuan", "alibi", "static")  # the static buffers: nothing pinned
    with pytest.raises(PropertyFailure, match=r"family-P3 cache pins storage after prefill: layer 0 key \(2, 4, 6, 8\) "
                                              r"and layer 0 value \(2, 4, 6, 8\) are views of model\.layers\.0\.self_attn"
                                              r"\.W_pack's output \(2, 6, 96\)"):
        check_no_pinned_storage("optimum-habana", "baichuan", "alibi", "concat")
    # P1 judges the prefill and both decode steps against the oracle before the k-token call's crash
    with pytest.raises(PropertyFailure, match=r"extend raised RuntimeError: .*\(judged before it and held: prefill, "
                                              r"decode step 1, decode step 2\)"):
        check_cached("optimum-habana", "baichuan", "alibi", "concat")


def widest_heads_forward(original):
    """DeciLMAttention.forward whose cache stores every layer at the model's query heads (each
    layer's own K/V heads, then zero heads up to num_heads): the values right (the zeros are cut off
    before the next step), every narrower layer's bytes too many."""
    def forward(self, *args, past_key_value=None, **kwargs):
        if past_key_value is not None:
            past_key_value = tuple(t[:, :self.num_key_value_heads] for t in past_key_value)
        out, weights, present = original(self, *args, past_key_value=past_key_value, **kwargs)
        pad = (0, 0, 0, 0, 0, self.num_heads - self.num_key_value_heads)
        return out, weights, None if present is None else tuple(torch.nn.functional.pad(t, pad) for t in present)
    return forward


@pytest.mark.optimum_habana
def test_per_layer_heads_memory_passes_the_port_and_kills_every_layer_at_the_widest_heads(monkeypatch):
    """decilm (layers of 4, 2, 1 K/V heads): family-memory holds the port's own cache to each layer's
    width; a cache with every layer at 4 heads fails, and so does an entry that says 4 everywhere."""
    import dataclasses
    import sys

    from mpt_kv.families.ports import load_port_module

    for path in ("concat", "static"):  # must-pass: the port caches each layer's own heads
        check_memory("optimum-habana", "decilm", "kv-heads-4-2-1", path)
    check_no_pinned_storage("optimum-habana", "decilm", "kv-heads-4-2-1", "concat")
    load_port_module(FAMILIES["decilm"])
    attention = sys.modules["optimum.habana.transformers.models.decilm.modeling_decilm"].DeciLMAttention
    monkeypatch.setattr(attention, "forward", widest_heads_forward(attention.forward))
    checks.clear_caches()
    # must-kill: 2 x 6 tokens x (64 + 64 + 64 - 64 - 32 - 16) fp32 elements too many
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: .*: \+3840 bytes; the cached tensors "
                                              r"themselves hold 9216 bytes, \+3840 vs the analytic K/V 5376 \(3 layers x "
                                              r"\[4, 2, 1\] K/V heads x head dim 8 x 2 x 6 tokens\)"):
        check_memory("optimum-habana", "decilm", "kv-heads-4-2-1", "concat")
    monkeypatch.undo()
    checks.clear_caches()
    uniform = dataclasses.replace(FAMILIES["decilm"], kv_heads=lambda c: c.num_attention_heads)
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: .*: -3840 bytes"):
        check_memory("optimum-habana", uniform, "kv-heads-4-2-1", "concat")


@pytest.mark.optimum_habana
def test_chatglm_port_caches_its_groups_batch_first_and_its_reuse_cache_in_bf16():
    """chatglm (4 query heads in 2 multi-query groups, head dim kv_channels 8): the port caches K and V
    as (batch, groups, seq, head dim), copies out of query_key_value's (seq, batch, ...) output
    (modeling_chatglm.py:603-605), not the Hub's (seq, batch, groups, head dim): the layout the checks
    read. family-memory holds it to the groups' bytes; family-P2 compares its K/V at the written
    positions (the reuse_cache buffer's bf16 rounding is seen there, a known failure)."""
    import dataclasses

    from mpt_kv.families.implementations import IMPLEMENTATIONS

    family = FAMILIES["chatglm"]
    session = IMPLEMENTATIONS["optimum-habana"](family, "mq-groups2").session("concat", 16)
    ids, mask = checks.prompt(family.config("mq-groups2"))
    with torch.inference_mode():
        session.prefill(ids, mask)
    assert [tuple(t.shape) for layer in session.kv() for t in layer] == [(2, 2, 6, 8)] * 4
    for path in ("concat", "static"):  # must-pass: each layer K and V of its 2 groups, nothing pinned
        check_memory("optimum-habana", "chatglm", "mq-groups2", path)
        check_no_pinned_storage("optimum-habana", "chatglm", "mq-groups2", path)
    every_head = dataclasses.replace(family, kv_heads=lambda c: c.num_attention_heads)  # an entry blind to the groups
    with pytest.raises(PropertyFailure, match=r"family-memory after prefill: .*-3072 bytes; .*\(2 layers x 4 K/V heads "
                                              r"x head dim 8 x 2 x 6 tokens\)"):
        check_memory("optimum-habana", every_head, "mq-groups2", "concat")
    with pytest.raises(PropertyFailure, match=r"family-P2 prefill: static-path cached key of layer 0 at the written "
                                              r"token positions vs the concat path's differ .* shape \(2, 2, 6, 8\)"):
        check_static_concat("optimum-habana", "chatglm", "mq-groups2", "static+reuse")


@pytest.mark.optimum_habana
def test_minicpm_is_a_latent_whose_port_caches_expanded_kv_through_the_kernel_standin():
    """minicpm (MiniCPM3): the analytic bytes are the latent's (kv_lora_rank 4 + rope 4 < head dim 12);
    the port's remote code caches the expanded K (4 heads x 12) and V (4 heads x 8): `stored_width`, a
    known excess. Its module imports FusedSDPA at module level and its attention calls it with no CPU
    fallback: off an HPU it runs through the kernel stand-in (its cases labelled cpu+standin), the
    stand-in's FusedSDPA in every forward."""
    from mpt_kv.families import habana_standin, hpu_kernels
    from mpt_kv.families.implementations import IMPLEMENTATIONS
    from mpt_kv.targets import FamilyTarget

    family, c = config("minicpm")
    assert c.kv_lora_rank < c.qk_nope_head_dim + c.qk_rope_head_dim
    assert family.layer_widths(c) == [8, 8] and family.layer_widths(c, stored=True) == [4 * 12 + 4 * 8] * 2
    assert family.cache_bytes(c, torch.float32, batch=2, written=6) == 2 * 8 * 2 * 6 * 4
    assert family.describe_cache(c) == "2 layers x a latent of 8 per token"
    runner = IMPLEMENTATIONS["optimum-habana"](family, "mla")
    assert sys.modules[type(runner.model).__module__].FusedSDPA is hpu_kernels.FusedSDPA
    assert habana_standin.device_label(FamilyTarget("optimum-habana", "minicpm", "mla"), "cpu") == "cpu+standin"
    before = hpu_kernels.CALLS["FusedSDPA"]
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    session = runner.session("concat", 16)
    hpu_before = torch.ops.__dict__.get("hpu")  # (another test may have made torch.ops' lazy hpu namespace)
    with torch.inference_mode():
        session.prefill(ids, torch.ones_like(ids))
    assert hpu_kernels.CALLS["FusedSDPA"] - before == c.num_hidden_layers  # one per layer, in its forward
    assert [tuple(t.shape) for layer in session.kv() for t in layer] == [(2, 4, 6, 12), (2, 4, 6, 8)] * 2
    assert torch.ops.__dict__.get("hpu") is hpu_before  # the scope ended with the forward, put back what was there


def cache_fused_views(model, monkeypatch):
    """The seed bug put into chatglm's port: on the concat prefill, each layer caches K and V as strided
    views of query_key_value's (seq, batch, q + 2 x groups x head dim) output, the rotated values
    written back into it first (the values stay right; the query part is pinned beside them)."""
    module = sys.modules[type(model).__module__]
    for block in model.transformer.encoder.layers:
        attn = block.self_attention
        q_width = attn.num_attention_heads_per_partition * attn.hidden_size_per_attention_head
        kv_width = attn.num_multi_query_groups_per_partition * attn.hidden_size_per_attention_head
        attn.query_key_value.register_forward_hook(lambda m, args, out, attn=attn: setattr(attn, "fused_out", out))
        attn.k_cache.in_fused, attn.v_cache.in_fused = (attn, q_width), (attn, q_width + kv_width)
    original = module.KVCache.update

    def update(self, prev, cur, dim, idx, inp_seq_len):
        out = original(self, prev, cur, dim, idx, inp_seq_len)
        if out is not cur or idx is not None or not hasattr(self, "in_fused"):
            return out
        attn, offset = self.in_fused
        fused = attn.fused_out  # (seq, batch, width)
        width, head_dim = fused.shape[-1], cur.shape[-1]
        view = fused.as_strided(cur.shape, (width, head_dim, fused.shape[1] * width, 1), fused.storage_offset() + offset)
        view.copy_(cur)
        return view

    monkeypatch.setattr(module.KVCache, "update", update)


@pytest.mark.optimum_habana
def test_chatglm_p3_kills_k_and_v_cached_as_views_of_query_key_value(monkeypatch):
    """The seed bug class on chatglm's fused query_key_value: the real port copies K and V out of it
    (P3 passes, above); K and V cached as views of it pin the query part, named with the module."""
    checks.clear_caches()
    runner = checks.runner_for("optimum-habana", FAMILIES["chatglm"], "mq-groups2", torch.float32, {})
    cache_fused_views(runner.model, monkeypatch)
    # the values are right: P1 holds through the prefill and both decodes (then the known extend crash)
    with pytest.raises(PropertyFailure, match=r"extend raised RuntimeError: .*\(judged before it and held: prefill, "
                                              r"decode step 1, decode step 2\)"):
        check_cached("optimum-habana", "chatglm", "mq-groups2", "concat")
    # 6 x 2 x 64 fp32 elements of output, 2 x (2 x 2 x 6 x 8) of them the cached K and V
    with pytest.raises(PropertyFailure, match=r"family-P3 cache pins storage after prefill: layer 0 key \(2, 2, 6, 8\) "
                                              r"and layer 0 value \(2, 2, 6, 8\) are views of transformer\.encoder\."
                                              r"layers\.0\.self_attention\.query_key_value's output \(6, 2, 64\): its "
                                              r"storage holds 3072 bytes, the cached tensors in it 1536"):
        check_no_pinned_storage("optimum-habana", "chatglm", "mq-groups2", "concat")


@pytest.mark.optimum_habana
def test_a_remote_config_the_installed_release_does_not_ship_is_unavailable_naming_its_file():
    import dataclasses

    from mpt_kv.errors import TargetUnavailable

    missing = dataclasses.replace(FAMILIES["decilm"], name="nosuch",
                                  remote_config="optimum.habana.transformers.models.nosuch.configuration_nosuch:X")
    with pytest.raises(TargetUnavailable, match=r"optimum-habana 1\.21\.2 has no port of nosuch: .*models/nosuch/"
                                                r"configuration_nosuch\.py does not exist"):
        missing.config("kv-heads-4-2-1")
