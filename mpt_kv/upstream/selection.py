"""Which upstream code counts as "attention and cache functions", why a function of it was never entered,
and the floors a run must reach: the data, written once (docs/reach.md, "The upstream code a run reaches").

A file is selected by its `Source` (which implementation's run drives it, and the rule that picks its
functions); the rules:

    "all"        every function of the file: the whole file is attention or cache code (transformers'
                 cache_utils.py, masking_utils.py and integrations/sdpa_attention.py, llm-foundry's
                 models/layers/attention.py)
    "attention"  a model file: every method of a class whose name contains one of ATTENTION_CLASSES
                 (MptAttention, GaudiLlamaAttention, KVCache, ModuleFusedSDPA), every module-level function
                 whose name contains one of ATTENTION_FUNCTIONS (eager_attention_forward, repeat_kv,
                 build_mpt_alibi_tensor), and every method of another class whose name contains one of
                 CACHE_METHODS (prepare_inputs_for_generation, _reorder_cache, allocate_kv_cache,
                 _update_causal_mask)
    "cache"      a generate file: every function whose own body names the cache (a name, attribute, argument
                 or keyword containing one of CACHE_NAMES: past_key_values, use_cache, cache_position,
                 reuse_cache, _reorder_cache, ...)

Functions nested in a selected one count with it. Names are matched case-insensitively, as substrings.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_CLASSES = ("attention", "attn", "sdpa", "cache")
ATTENTION_FUNCTIONS = ("attention", "attn", "alibi", "cache", "causal_mask", "repeat_kv")
CACHE_METHODS = ("cache", "causal_mask", "prepare_inputs_for_generation")
CACHE_NAMES = ("cache", "past_key_value", "layer_past")

MODEL_FILES = "{model files}"  # a Source path: transformers' model file of every family of the registry
PORTS = "{ports}"  # a Source path: optimum-habana's port of every family of the registry


@dataclass(frozen=True)
class Source:
    """Upstream files whose functions count. implementation: the target (the run's `implementation` of its
    cases) whose run drives them; distribution: whose release names them; group: the row of the group table
    (with the release: "transformers 5.24 cache_utils"); path: relative to the folder that holds the
    distribution's top-level package, or MODEL_FILES / PORTS; rule: "all", "attention" or "cache"."""

    implementation: str
    distribution: str
    group: str
    path: str
    rule: str


SOURCES = (
    Source("transformers", "transformers", "generate", "transformers/generation/utils.py", "cache"),
    Source("transformers", "transformers", "cache_utils", "transformers/cache_utils.py", "all"),
    Source("transformers", "transformers", "masking_utils", "transformers/masking_utils.py", "all"),
    Source("transformers", "transformers", "sdpa path", "transformers/integrations/sdpa_attention.py", "all"),
    Source("transformers", "transformers", "model files", MODEL_FILES, "attention"),
    Source("optimum-habana", "optimum-habana", "GaudiGenerationMixin", "optimum/habana/transformers/generation/utils.py",
           "cache"),
    Source("optimum-habana", "optimum-habana", "ports", PORTS, "attention"),
    Source("llm-foundry", "llm-foundry", "attention", "llmfoundry/models/layers/attention.py", "all"),
    Source("llm-foundry", "llm-foundry", "MPT model", "llmfoundry/models/mpt/modeling_mpt.py", "attention"),
)

# What an upstream line calls that runs on an HPU only, with no CPU stand-in here (mpt_kv/families/habana_standin.py
# stands in for htcore.mark_step and habana_frameworks.torch.hpu.is_available only): a dotted name, matched as the
# whole name or its prefix (`torch.ops.hpu` matches torch.ops.hpu.mixture_of_experts). A line that calls one, a
# branch taken only where one imported (`if FusedSDPA:`, `if use_flash_attention and FusedSDPA is not None:`) and
# a function that can only be reached through those are "needs an HPU", listed apart from the rest. A kernel that
# gets a CPU stand-in comes off this list.
HPU_ONLY = ("torch.ops.hpu", "torch.hpu", "habana_frameworks", "hpex", "FusedSDPA", "FusedRoPE", "FusedRMSNorm",
            "wrap_in_hpu_graph")

# The options a user sets (optimum-habana's recipe flags, its generation config's, transformers' generate and
# config options): a function reached only under a condition that names one is "an option never set" when the
# run never set it.
OPTIONS = (
    # optimum-habana's text-generation recipes and GaudiGenerationConfig
    "use_flash_attention", "flash_attention_recompute", "flash_attention_causal_mask", "flash_attention_fast_softmax",
    "flash_attention_fp8", "bucket_internal", "bucket_size", "reuse_cache", "attn_softmax_bf16", "use_fused_rope",
    "lazy_mode", "trim_logits", "limit_hpu_graphs", "cache_idx", "attn_batch_split", "decode_attn_batch_split",
    "valid_sequence_lengths", "num_virtual_tokens", "use_flex_attention", "static_shapes", "kv_cache_fp8",
    # transformers' generate and config
    "output_attentions", "head_mask", "layer_head_mask", "_attn_implementation", "attn_implementation",
    "reorder_and_upcast_attn",
    "cache_implementation", "assistant_model", "prompt_lookup_num_tokens", "num_beams", "do_sample",
    "return_legacy_cache", "offloading", "quantization_config",
    # llm-foundry's attn_config (mpt_kv.targets.foundry refuses the values its oracle cannot follow)
    "attn_impl", "kv_n_heads", "qk_ln", "qk_gn", "rope", "sliding_window_size", "attn_logit_softcapping",
    "attn_uses_sequence_id",
)



@dataclass(frozen=True)
class Declared:
    """A reason the source of the function's own file cannot show. kind: "needs an HPU", "an option never set"
    or "not driven"; what: the option or kernel; file and needle: the upstream line that decides it (its number is
    looked up in the installed release: `needle` is that line's text); why: mpt-kv's side of it."""

    kind: str
    what: str
    file: str
    needle: str
    why: str


# (distribution, path, function) -> Declared: only where a function is never entered; functions it calls that
# are entered only from it inherit it ("through sdpa_attention_forward").
_SDPA = Declared("an option never set", "attn_implementation='sdpa'", "transformers/modeling_utils.py",
                 '"sdpa": sdpa_attention_forward',
                 "transformers dispatches attention by the config's attn_implementation; mpt-kv builds every "
                 "family with attn_implementation='eager': mpt_kv/families/models.py, and transformers' MPT is eager-only")
_FLASH = Declared("an option never set", "attn_impl='flash'", "llmfoundry/models/layers/attention.py",
                  "attention_implementations.register('flash', func=flash_attn_fn)",
                  "flash_attn runs on CUDA only: mpt_kv.targets.foundry:build_flash declares every device unsupported "
                  "where it does not import, and the main job runs attn_impl='torch'")
DECLARED: dict[tuple[str, str, str], Declared] = {
    ("transformers", "transformers/integrations/sdpa_attention.py", "sdpa_attention_forward"): _SDPA,
    ("llm-foundry", "llmfoundry/models/layers/attention.py", "flash_attn_fn"): _FLASH,
}

# The floors: "<distribution> <major.minor> <group>" -> (lines %, branches %) of the group's selected functions the
# main job must execute (`python -m mpt_kv coverage --check` fails below one; tests/test_upstream_coverage.py holds
# docs/reach.md's measured table to them). Measured figures rounded down a little; raise them as the reach grows. Keyed
# by release: a lock that moves a release moves its rows, and the new rows need floors (a row without one fails).
FLOORS: dict[str, tuple[int, int]] = {
    # the cpu env (transformers 5.24.0), with the generate drive and the sdpa axis: measured 54.4/39.6, 27.1/21.4,
    # 39.8/38.8, 60.9/52.6, 88.0/57.1 (before them: 0.0/0.0, 25.9/20.3, 30.4/23.5, 0.0/0.0, 87.3/56.0); with the
    # chunked prefill: generate 58.6/42.7, cache_utils 28.4/23.3; with multi-turn and the scored beam and assisted
    # modes (return_dict_in_generate, output_scores, output_logits): generate 61.7/45.4
    "transformers 5.24 generate": (61, 45),
    "transformers 5.24 cache_utils": (28, 23),
    "transformers 5.24 masking_utils": (39, 38),
    "transformers 5.24 sdpa path": (60, 52),
    "transformers 5.24 model files": (87, 57),
    # the ohabana env (transformers 4.55.4, optimum-habana 1.21.2), with the generate drive, the sdpa axis, the
    # recipe paths and the kernel stand-in: 36.3/27.5, 21.0/16.7, 36.7/33.6, 89.3/81.2, 78.7/54.3; with generate on
    # the ports, on reuse_cache and the recipes: 43.0/32.4, 63.0/51.8 (before: 0.0/0.0, 18.9/15.1, 29.3/22.4,
    # 0.0/0.0, 73.2/44.9; 0.3/0.1, 33.3/23.1; before generate on the ports: 32.2/22.9, 50.8/35.6)
    # 38.4/28.9 with the chunked prefill; 39.9/30.5 with multi-turn and scores; with contrastive search: 49.3/37.0,
    # cache_utils 23.8/20.6 (its batch_repeat_interleave and batch_select_indices), GaudiGenerationMixin 54.0/40.7, the
    # ports 63.2/52.4; with constrained beam search: generate 56.4/41.4, GaudiGenerationMixin 60.8/44.9
    "transformers 4.55 generate": (56, 41),
    "transformers 4.55 cache_utils": (23, 20),
    "transformers 4.55 masking_utils": (36, 33),
    "transformers 4.55 sdpa path": (89, 81),
    "transformers 4.55 model files": (78, 54),
    "optimum-habana 1.21 GaudiGenerationMixin": (60, 44),
    "optimum-habana 1.21 ports": (63, 52),
    # the foundry env (llm-foundry 0.22.0): 37.5/26.7, 33.3/33.3 (before: 37.3/26.1, 33.3/33.3)
    "llm-foundry 0.22 attention": (37, 26),
    "llm-foundry 0.22 MPT model": (33, 33),
}
