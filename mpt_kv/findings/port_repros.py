"""The standalone repros of optimum-habana's family findings (`mpt_kv.findings.repros` picks which):
its port's module loaded on CPU under bare parent packages (the habana_frameworks stand-in where the
port needs one), the lines of its `adapt_transformers_to_gaudi` replayed (`PORT_PATCHES`), then

    templates/port.py.tmpl          the prefill forward or the beam-search reorder that raises
                                    (`port_operation`: `FORWARD_CRASHES`, `REORDER_CRASH`)
    templates/port_program.py.tmpl  a short program of generate's calls that raises (`crash_program`:
                                    `PROGRAMS`, `PROGRAM_ERRORS`) or leaves views or wrong logits
                                    behind (`observed_program`)
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from mpt_kv import recipes
from mpt_kv.families import FAMILIES
from mpt_kv.findings.raw import target_of
from mpt_kv.findings.grouping import versions, what
from mpt_kv.findings.scripts import (Repro, class_names, config_literal, fill, part, readme_text, slugify, template,
                                     tiny_config)


# What optimum-habana 1.21.2's adapt_transformers_to_gaudi (transformers/modeling_utils.py) writes
# into each family's transformers module, (name, attribute or None for the class itself, the
# port's name), in file order: the repro scripts replay these lines. tests/test_repros.py checks
# them against the installed release's own lines (mpt_kv.targets.gaudi.model_patches).
PORT_PATCHES = {
    "mpt": [("MptForCausalLM", None, "GaudiMptForCausalLM"), ("MptModel", None, "GaudiMptModel"),
            ("MptAttention", None, "GaudiMptAttention"), ("MptBlock", None, "GaudiMptBlock")],
    "bloom": [("BloomAttention", "forward", "gaudi_bloom_attention_forward"),
              ("BloomBlock", "forward", "gaudi_bloom_block_forward"),
              ("BloomModel", "forward", "gaudi_bloom_model_forward"), ("BloomMLP", None, "GaudiBloomMLP"),
              ("BloomForCausalLM", None, "GaudiBloomForCausalLM"),
              ("BloomPreTrainedModel", "_convert_to_standard_cache", "gaudi_bloom_convert_to_standard_cache"),
              ("BloomPreTrainedModel", "_convert_to_bloom_cache", "gaudi_bloom_convert_to_bloom_cache")],
    "gpt2": [("GPT2Attention", None, "GaudiGPT2Attention"), ("GPT2Model", "forward", "gaudi_gpt2_forward"),
             ("GPT2LMHeadModel", None, "GaudiGPT2LMHeadModel"),
             ("GPT2DoubleHeadsModel", None, "GaudiGPT2DoubleHeadsModel"), ("GPT2Block", None, "GaudiGPT2Block")],
    "phi": [("PhiForCausalLM", None, "GaudiPhiForCausalLM"), ("PhiAttention", None, "GaudiPhiAttention"),
            ("PhiDecoderLayer", None, "GaudiPhiDecoderLayer"), ("PhiModel", None, "GaudiPhiModel")],
    "falcon": [("FalconAttention", None, "GaudiFalconAttention"), ("FalconForCausalLM", None, "GaudiFalconForCausalLM"),
               ("FalconMLP", None, "GaudiFalconMLP"), ("FalconModel", None, "GaudiFalconModel"),
               ("FalconDecoderLayer", None, "GaudiFalconDecoderLayer"),
               ("FalconLinear", "forward", "gaudi_falcon_linear_forward")],
    "gpt_bigcode": [("GPTBigCodeAttention", None, "GaudiGPTBigCodeAttention"),
                    ("GPTBigCodeForCausalLM", None, "GaudiGPTBigCodeForCausalLM"),
                    ("GPTBigCodeBlock", "forward", "gaudi_gpt_bigcode_block_forward"),
                    ("GPTBigCodeModel", "forward", "gaudi_gpt_bigcode_model_forward")],
    "gptj": [("GPTJAttention", None, "GaudiGPTJAttention"), ("GPTJForCausalLM", None, "GaudiGPTJForCausalLM"),
             ("GPTJBlock", None, "GaudiGPTJBlock"), ("GPTJModel", None, "GaudiGPTJModel")],
    "starcoder2": [("Starcoder2ForCausalLM", None, "GaudiStarcoder2ForCausalLM"),
                   ("Starcoder2Model", None, "GaudiStarcoder2Model"),
                   ("Starcoder2Attention", None, "GaudiStarcoder2Attention"),
                   ("Starcoder2DecoderLayer", None, "GaudiStarcoder2DecoderLayer")],
    "llama": [("LlamaForCausalLM", None, "GaudiLlamaForCausalLM"), ("LlamaModel", None, "GaudiLlamaModel"),
              ("LlamaAttention", None, "GaudiLlamaAttention"), ("LlamaMLP", None, "GaudiLlamaMLP"),
              ("LlamaDecoderLayer", None, "GaudiLlamaDecoderLayer"),
              ("LlamaRotaryEmbedding", None, "GaudiLlamaRotaryEmbedding"),
              ("LlamaRMSNorm", "forward", "gaudi_llama_rmsnorm_forward")],
    "codegen": [("CodeGenAttention", None, "GaudiCodeGenAttention"), ("CodeGenForCausalLM", None, "GaudiCodeGenForCausalLM"),
                ("CodeGenModel", "forward", "gaudi_codegen_model_forward"),
                ("CodeGenBlock", "forward", "gaudi_codegen_block_forward")],
    "mistral": [("MistralForCausalLM", None, "GaudiMistralForCausalLM"), ("MistralAttention", None, "GaudiMistralAttention"),
                ("MistralDecoderLayer", None, "GaudiMistralDecoderLayer"), ("MistralModel", None, "GaudiMistralModel"),
                ("MistralRMSNorm", "forward", "gaudi_mistral_rmsnorm_forward")],
    "gpt_neox": [("GPTNeoXAttention", None, "GaudiGPTNeoXAttention"), ("GPTNeoXForCausalLM", None, "GaudiGPTNeoXForCausalLM"),
                 ("GPTNeoXLayer", None, "GaudiGPTNeoXLayer"), ("GPTNeoXModel", "forward", "gaudi_gpt_neox_model_forward")],
    "persimmon": [("PersimmonAttention", None, "GaudiPersimmonAttention"),
                  ("PersimmonDecoderLayer", None, "GaudiPersimmonDecoderLayer"),
                  ("PersimmonForCausalLM", None, "GaudiPersimmonForCausalLM"),
                  ("PersimmonModel", "forward", "gaudi_persimmon_model_forward")],
    "stablelm": [("StableLmAttention", None, "GaudiStableLmAttention"),
                 ("StableLmDecoderLayer", None, "GaudiStableLmDecoderLayer"),
                 ("StableLmForCausalLM", None, "GaudiStableLmForCausalLM"),
                 ("StableLmModel", "forward", "gaudi_stablelm_model_forward")],
    "qwen2": [("Qwen2ForCausalLM", None, "GaudiQwen2ForCausalLM"),
              ("Qwen2ForSequenceClassification", None, "GaudiQwen2ForSequenceClassification"),
              ("Qwen2ForTokenClassification", None, "GaudiQwen2ForTokenClassification"),
              ("Qwen2Model", None, "GaudiQwen2Model"), ("Qwen2Attention", None, "GaudiQwen2Attention"),
              ("Qwen2MLP", None, "GaudiQwen2MLP"), ("Qwen2DecoderLayer", None, "GaudiQwen2DecoderLayer"),
              ("Qwen2RMSNorm", "forward", "gaudi_qwen2_rmsnorm_forward")],
    "gemma": [("GemmaForCausalLM", None, "GaudiGemmaForCausalLM"), ("GemmaMLP", None, "GaudiGemmaMLP"),
              ("GemmaAttention", None, "GaudiGemmaAttention"), ("GemmaDecoderLayer", None, "GaudiGemmaDecoderLayer"),
              ("GemmaModel", None, "GaudiGemmaModel")],
    "gemma2": [("Gemma2ForCausalLM", None, "GaudiGemma2ForCausalLM"), ("Gemma2MLP", None, "GaudiGemma2MLP"),
               ("Gemma2Attention", None, "GaudiGemma2Attention"),
               ("Gemma2DecoderLayer", None, "GaudiGemma2DecoderLayer"), ("Gemma2Model", None, "GaudiGemma2Model"),
               ("Gemma2RotaryEmbedding", None, "GaudiGemma2RotaryEmbedding"),
               ("Gemma2RMSNorm", "forward", "gaudi_gemma2_rmsnorm_forward")],
    "gemma3": [("Gemma3ForCausalLM", None, "GaudiGemma3ForCausalLM"), ("Gemma3MLP", None, "GaudiGemma3MLP"),
               ("Gemma3Attention", None, "GaudiGemma3Attention"),
               ("Gemma3DecoderLayer", None, "GaudiGemma3DecoderLayer"),
               ("Gemma3TextModel", None, "GaudiGemma3TextModel"), ("Gemma3Model", None, "GaudiGemma3Model"),
               ("Gemma3ForConditionalGeneration", None, "GaudiGemma3ForConditionalGeneration"),
               ("Gemma3RMSNorm", "forward", "gaudi_gemma3_rmsnorm_forward")],
    "qwen3": [("Qwen3ForCausalLM", None, "GaudiQwen3ForCausalLM"), ("Qwen3Model", None, "GaudiQwen3Model"),
              ("Qwen3ForSequenceClassification", None, "GaudiQwen3ForSequenceClassification"),
              ("Qwen3ForTokenClassification", None, "GaudiQwen3ForTokenClassification"),
              ("Qwen3Attention", None, "GaudiQwen3Attention"), ("Qwen3MLP", None, "GaudiQwen3MLP"),
              ("Qwen3DecoderLayer", None, "GaudiQwen3DecoderLayer"),
              ("Qwen3RMSNorm", "forward", "gaudi_qwen3_rmsnorm_forward")],
    "gpt_neo": [("GPTNeoForCausalLM", None, "GaudiGPTNeoForCausalLM"),
                ("GPTNeoModel", "forward", "gaudi_gpt_neo_model_forward"),
                ("GPTNeoBlock", "forward", "gaudi_gpt_neo_block_forward"),
                ("GPTNeoAttention", "forward", "gaudi_gpt_neo_attention_forward"),
                ("GPTNeoSelfAttention", "forward", "gaudi_gpt_neo_selfattention_forward")],
    "opt": [("OPTAttention", "forward", "gaudi_opt_attention_forward"),
            ("OPTDecoder", "forward", "gaudi_opt_decoder_forward"), ("OPTForCausalLM", None, "GaudiOPTForCausalLM"),
            ("OPTModel", "forward", "gaudi_opt_model_forward"), ("OPTDecoderLayer", None, "GaudiOPTDecoderLayer"),
            ("OPTLearnedPositionalEmbedding", None, "GaudiOPTLearnedPositionalEmbedding")],
    "cohere": [("CohereDecoderLayer", None, "GaudiCohereDecoderLayer"),
               ("CohereForCausalLM", None, "GaudiCohereForCausalLM"),
               ("CohereModel", "forward", "gaudi_cohere_model_forward"),
               ("CohereAttention", None, "GaudiCohereAttention")],
    "xglm": [("XGLMForCausalLM", None, "GaudiXGLMForCausalLM"), ("XGLMModel", "forward", "gaudi_xglm_model_forward"),
             ("XGLMAttention", "forward", "gaudi_xglm_attention_forward"),
             ("XGLMDecoderLayer", "forward", "gaudi_xglm_decoder_layer_forward")],
    "mixtral": [("MixtralAttention", None, "GaudiMixtralAttention"), ("MixtralForCausalLM", None, "GaudiMixtralForCausalLM"),
                ("MixtralModel", None, "GaudiMixtralModel"), ("MixtralSparseMoeBlock", None, "GaudiMixtralSparseMoeBlock"),
                ("MixtralDecoderLayer", None, "GaudiMixtralDecoderLayer"),
                ("MixtralRMSNorm", "forward", "gaudi_mixtral_rmsnorm_forward")],
    "qwen2_moe": [("Qwen2MoeMLP", None, "GaudiQwen2MoeMLP"), ("Qwen2MoeAttention", None, "GaudiQwen2MoeAttention"),
                  ("Qwen2MoeDecoderLayer", None, "GaudiQwen2MoeDecoderLayer"), ("Qwen2MoeModel", None, "GaudiQwen2MoeModel"),
                  ("Qwen2MoeForCausalLM", None, "GaudiQwen2MoeForCausalLM"),
                  ("Qwen2MoeRMSNorm", "forward", "gaudi_qwen2moe_rmsnorm_forward"),
                  ("Qwen2MoeSparseMoeBlock", "forward", "gaudi_qwen2moe_block_sparse_moe_forward")],
    "qwen3_moe": [("Qwen3MoeForCausalLM", None, "GaudiQwen3MoeForCausalLM"), ("Qwen3MoeModel", None, "GaudiQwen3MoeModel"),
                  ("Qwen3MoeForSequenceClassification", None, "GaudiQwen3MoeForSequenceClassification"),
                  ("Qwen3MoeForTokenClassification", None, "GaudiQwen3MoeForTokenClassification"),
                  ("Qwen3MoeAttention", None, "GaudiQwen3MoeAttention"), ("Qwen3MoeMLP", None, "GaudiQwen3MoeMLP"),
                  ("Qwen3MoeDecoderLayer", None, "GaudiQwen3MoeDecoderLayer"),
                  ("Qwen3MoeSparseMoeBlock", None, "GaudiQwen3MoeSparseMoeBlock"),
                  ("Qwen3MoeRMSNorm", "forward", "gaudi_qwen3moe_rmsnorm_forward")],
    # the DeepSeek ports are copies of the Hub's remote code: one line replaces transformers' model class
    "deepseek_v2": [("DeepseekV2ForCausalLM", None, "DeepseekV2ForCausalLM")],
    "deepseek_v3": [("DeepseekV3ForCausalLM", None, "DeepseekV3ForCausalLM")],
    "gpt_oss": [("GptOssForCausalLM", None, "GaudiGptOssForCausalLM"), ("GptOssModel", None, "GaudiGptOssModel"),
                ("GptOssExperts", None, "GaudiGptOssExperts"),
                ("GptOssDecoderLayer", "forward", "gaudi_gpt_oss_decoder_layer_forward"),
                ("GptOssAttention", None, "GaudiGptOssAttention"),
                ("GptOssRMSNorm", "forward", "gaudi_gpt_oss_rmsnorm_forward")],
}

# The recipe keywords (mpt_kv/recipes.py: what generate passes for a recipe's flags) each port's ForCausalLM
# forward names in optimum-habana 1.21.2, for the scripts of the recipes' findings (a flag a forward does not
# name its prepare_inputs_for_generation drops). tests/test_repros.py checks them against the installed release.
RECIPE_FORWARD_NAMES = {
    "llama": ("lazy_mode", "trim_logits", "attn_softmax_bf16", "use_flash_attention", "flash_attention_recompute",
              "flash_attention_causal_mask", "flash_attention_fast_softmax"),
    "qwen2": ("lazy_mode", "trim_logits", "attn_softmax_bf16", "use_flash_attention", "flash_attention_recompute",
              "flash_attention_causal_mask", "flash_attention_fast_softmax"),
    "falcon": ("trim_logits", "use_flash_attention", "flash_attention_recompute", "flash_attention_causal_mask"),
    "starcoder2": ("lazy_mode", "trim_logits", "attn_softmax_bf16", "use_flash_attention", "flash_attention_recompute",
                   "flash_attention_causal_mask"),
    "gemma3": ("lazy_mode", "trim_logits", "attn_softmax_bf16", "use_flash_attention", "flash_attention_recompute",
               "flash_attention_causal_mask", "flash_attention_fast_softmax"),
}


def recipe_forward_kwargs(family: str, recipe_name: str | None) -> dict:
    """What generate passes a port's forward for the recipe's flags (RECIPE_FORWARD_NAMES); {} without one."""
    if recipe_name is None:
        return {}
    if family not in RECIPE_FORWARD_NAMES:
        raise ValueError(f"a finding of the recipe {recipe_name} on {family}: add the family to RECIPE_FORWARD_NAMES "
                         "(the recipe keywords its forward names)")
    return recipes.RECIPES[recipe_name].forward_kwargs(RECIPE_FORWARD_NAMES[family].__contains__)


# optimum-habana findings whose error the port's prefill forward raises: (family, variant, a text of
# the pattern) -> the folder's short name. Any forward of generate reaches them.
FORWARD_CRASHES = {
    ("codegen", "mha", "can only concatenate tuple"): "forward-typeerror",
    ("phi", "gqa", "The size of tensor a"): "forward-size-mismatch",
    ("llama", "fused-qkv", "'NoneType' object has no attribute 'weight'"): "forward-nonetype-weight",
    ("mistral", "gqa", "The size of tensor a"): "forward-rope-size-mismatch",
    ("starcoder2", "gqa", "KeyError: 'input_shape'"): "forward-keyerror-input-shape",
    ("cohere", "gqa-qk-norm", "unexpected keyword argument 'output_attentions'"): "forward-unexpected-output-attentions",
    ("xglm", "mha", "has no attribute '_shape'"): "forward-no-attribute-shape",
}

# The beam-search reorder of a legacy tuple cache calls the model's `_reorder_cache`
# (generation/utils.py `_temporary_reorder_cache`), which these ports do not define; reached on the
# default path (no static shapes): the findings whose checks see it there
REORDER_CRASH = "no attribute '_reorder_cache'"

# optimum-habana findings a short program of generate's calls raises (port_program.py.tmpl): the
# call the pattern names ("<call> raised <error>"), after what the family checks run before it
PROGRAMS = {
    "prefill": [("prefill",)],
    "decode": [("prefill",), ("extend", 1)],
    "(prefill|decode)": [("prefill",), ("extend", 1)],
    # family-P1/P2: the prefill, 2 greedy steps, then a chunk of 3 tokens in one cached call
    "extend": [("prefill",), ("extend", 1), ("extend", 1), ("extend", 3)],
    # family-ops' assisted program: candidates verified in one 3-token cached call right after the prefill
    "assisted-extend": [("prefill",), ("extend", 3)],
    "reorder": [("prefill",), ("reorder",)],
    "uncached": [("uncached",)],  # family-P0: the forward with use_cache=False
    # family-ops' beam search: a step, the reorder, the next step
    "beam-decode": [("prefill",), ("extend", 1), ("reorder",), ("extend", 1)],
    # family-P1's second decode step: a query past a window longer than the prompt (gpt_oss's 7)
    "decode-2": [("prefill",), ("extend", 1), ("extend", 1)],
}

PROGRAM_CALLS = {"prefill": "the prefill", "decode": "a decode step after the prefill",
                 "(prefill|decode)": "the prefill or the decode step after it",
                 "extend": "a 3-token cached call after the prefill and 2 decode steps",
                 "assisted-extend": "a 3-token cached call right after the prefill (assisted decoding's first "
                                    "verification of its candidates)",
                 "reorder": "the beam-search cache reorder after the prefill",
                 "uncached": "the uncached forward (use_cache=False)",
                 "beam-decode": "the decode step after a beam-search cache reorder",
                 "decode-2": "the second decode step after the prefill"}

BEAM_AXIS_FIX = ("select the beams along the batch dimension of each cached (batch, heads, seq, head_dim) K/V "
                 "(index_select(0, beam_idx)) in the port's _reorder_cache (the upstream line), not along the heads")

# (a text of the error, its short name, a one-sentence suggested fix), the first that matches
PROGRAM_ERRORS = [
    ("The expanded size of the tensor", "causal-mask-expand",
     "in GaudiAttentionMaskConverter._make_causal_mask (modeling_attn_mask_utils.py:53-54) pad the chunk's causal "
     "mask with past_key_values_length zero columns (not past_key_values_length - tgt_len), as transformers' "
     "AttentionMaskConverter does"),
    ("The size of tensor a", "size-mismatch", None),
    # before index_copy_'s chunk error: the same function's other messages
    ("expected to have the same dtype", "dtype-mismatch",
     "allocate the reuse_cache K/V in the model's dtype (KVCache.allocate, the upstream line), not bfloat16 always"),
    ("Source/destination tensor must have same slice shapes", "index-copy-slice-shapes", BEAM_AXIS_FIX),
    ("index_copy_", "index-copy",
     "write the chunk's k slots (index_copy_ with token_idx - 1 + arange(k)) instead of one slot per call"),
    ("index_add_", "index-add", "add the chunk's k slots (token_idx - 1 + arange(k)) instead of one index"),
    ("INDICES element is out of DATA bounds", "index-out-of-bounds",
     "index the multi-head layout's token axis (dim 2 of (B, H, T, 2 head_dim)), not dim 1, at "
     "modeling_gpt_bigcode.py:358-361"),
    ("is invalid for input of size", "view-shape",
     "repeat the K/V heads to the query heads' groups for any num_kv_heads (modeling_falcon.py:301), not only 8"),
    ("get_usable_length", "no-get-usable-length",
     "use past_key_values.get_seq_length() (transformers >= 4.55 removed Cache.get_usable_length)"),
    ("'_reorder_cache'", "no-reorder-cache",
     "define `_reorder_cache` on the port (index_select of every layer's K and V along the batch), or have "
     "_temporary_reorder_cache reorder a legacy tuple cache itself"),
    ("'reorder_kv_cache'", "no-reorder-kv-cache",
     "define `reorder_kv_cache(beam_idx)` on the port (index_select of each layer's preallocated K/V along the "
     "batch, as the llama port does), or refuse reuse_cache with beam search up front"),
    ("output with shape", "broadcast",
     "allocate the reuse_cache K/V with the shape the attention writes (allocate_kv_cache, "
     "modeling_falcon.py:257)"),
    ("num_key_value_heads", "no-num-key-value-heads",
     "read the K/V heads from the config in allocate_kv_cache (the upstream line): the attention "
     "module has no num_key_value_heads"),
    ("too many indices for tensor of dimension 2", "trim-logits-index-error",
     "trim the last position without token_idx as a 3-D slice, hidden_states[:, -1:, :] (the upstream line), as the "
     "token_idx branch's index_select(1, token_idx - 1) keeps it"),
    ("'torch.Size' object has no attribute 'shape'", "past-size-has-no-shape",
     "with reuse_cache the past is the preallocated cache's shape (a torch.Size): read its length as "
     "past_key_value[0][-2] there (or from token_idx), not past_key_value[0].shape[-2] (modeling_gemma.py:316)"),
    ("Sizes of tensors must match except in dimension", "cat-size-mismatch", BEAM_AXIS_FIX),
    ("The provided attention mask has length", "attention-mask-length",
     "compare the attention mask against past_key_values_length + seq_length (modeling_opt.py:273-288), as "
     "transformers' OPT does: mask_seq_length = past_key_values_length leaves out the call's own tokens"),
]

SIZE_MISMATCH_FIXES = {
    ("extend", "3"): "with token_idx, build the chunk's causal mask against the whole cache (past_key_values_length = "
                     "token_idx - 1) so that to_4d's masked_fill (modeling_attn_mask_utils.py:128) gets matching shapes",
    ("extend", "2"): "have KVCache.update write a chunk of k tokens at token_idx - 1 (modeling_gptj.py:51-53), not one",
    ("decode", "3"): "build the sliding-window causal mask for the call's own query length against the whole cache: "
                     "to_4d (modeling_attn_mask_utils.py:98) builds one for every query length once sliding_window is "
                     "set, a mask of the decode step's 1 query against its past-only length",
    ("prefill", "1"): "allocate the reuse_cache K/V with the heads the attention writes (allocate_kv_cache, "
                      "modeling_falcon.py:255)",
}

ALTERNATION_FIX = ("see the upstream lines: the concat path's causal mask (modeling_attn_mask_utils.py:53-54), the "
                   "static path's to_4d (:128) and a one-slot index_copy_ each refuse a chunk of k > 1 tokens")


# optimum-habana findings whose pattern names no call (every check met it at the same call): (family,
# variant, a text of the pattern) -> the call that raises it, as the family checks drive the port
UNNAMED_CALLS = {
    ("gemma2", "hybrid-window4", "The size of tensor a"): "decode",
    ("gemma3", "hybrid-window9", "The size of tensor a"): "decode",
    ("chatglm", "mq-groups2", "expected to have the same dtype"): "decode",
    ("gpt_oss", "hybrid-window7", "The size of tensor a"): "decode",
}


@dataclass(frozen=True)
class Program:
    """An optimum-habana finding the program template covers: its calls, path, error and what is
    observed after a call (the template's OBSERVE)."""

    call: str        # the last call the finding needs: a key of PROGRAMS
    path: str        # concat | static | static+reuse
    paths: tuple     # the paths driven: (path,), or family-P2's ("concat", path)
    short: str       # the folder's short name
    expected: str | None  # the error's last line (a regular expression); None: no error is part of it
    fix: str
    observe: tuple = ()   # ((call, "views" | "memory" | "logits"), ...)
    seen: str = ""        # what the observation sees, for the title
    pads: tuple = (2, 0)  # each prompt's left padding (the batch: its length)
    fused: str | None = None  # the module whose output "views" looks for (default: the family's fused)
    prompt: int = 6       # each prompt's length
    recipe: str | None = None  # the text-generation recipe whose flags the finding is seen with (mpt_kv/recipes.py)


def with_recipe(entries: list[dict]) -> tuple[list[dict], str | None]:
    """(the entries with each recipe path as its base path, the recipe's name): a finding of a recipe's
    cells alone (mpt_kv/recipes.py) is driven on its base path with the recipe's flags (RECIPE_FORWARD_NAMES);
    one its plain paths have too is driven as on them (its recipe entries left out)."""
    names = [recipes.recipe_of(e["path"]).name for e in entries if e.get("path") and recipes.recipe_of(e["path"])]
    if len(names) < len(entries):
        plain = [e for e in entries if not (e.get("path") and recipes.recipe_of(e["path"]))]
        return plain, None
    return [{**e, "path": recipes.split(e["path"])[0]} if e.get("path") else e for e in entries], names[0]


def recipe_program(make):
    """`make(entries) -> Program | None` applied to a recipe finding's entries on their base paths, the recipe
    named in the Program and its folder's short name."""
    def program(entries: list[dict]) -> Program | None:
        base, recipe = with_recipe(entries)
        found = make(base)
        if found is None or recipe is None:
            return found
        return dataclasses.replace(found, recipe=recipe, short=f"{found.short}-{recipe}")
    program.__name__, program.__doc__ = make.__name__, make.__doc__
    return program


def expected_errors(pattern: str) -> str:
    """`expected_error` of a pattern that may be an alternation of "<call> raised <error>" texts."""
    if pattern.startswith("(?:"):
        return re.sub(r"the implementation's \w+ raised ", "", pattern)
    return re.sub(r"^.*?raised ", "", pattern)


def templated(family: str) -> bool:
    """Whether the port templates cover the family: its adapt_transformers_to_gaudi lines are
    replayed (PORT_PATCHES), or it is remote code (the port's own model: nothing to patch)."""
    return family in PORT_PATCHES or bool(FAMILIES[family].remote_code)


@recipe_program
def crash_program(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana crash finding: its call from the pattern, its path from the
    entries (concat where an entry holds there, else static, else concat where an entry holds on
    every path, else static+reuse)."""
    entry = entries[0]
    implementation, family, variant = target_of(entry)
    if implementation != "optimum-habana" or not templated(family):
        return None
    pattern = entry["pattern"].replace("\\", "")
    found = re.search(r"(\(prefill\|decode\)|prefill|decode|extend|reorder) raised \w+", pattern)
    call = found.group(1) if found else next(
        (c for (f, v, text), c in UNNAMED_CALLS.items() if (f, v) == (family, variant) and text in pattern), None)
    if call is None:
        return None
    if call == "decode" and re.search(r"beam step \d+ \(decode\)", pattern):  # family-ops' beam program
        call = "beam-decode"
    # family-ops' assisted program: its own finding of the k-token call (3 rows, an 8-token prompt, the extend
    # right after the prefill), where the checks that extend after 2 decode steps meet another error or none
    assisted = call == "extend" and all(e.get("property") == "family-ops" for e in entries)
    if assisted:
        call = "assisted-extend"
    paths = {e.get("path") for e in entries}
    # an entry without a path holds on every path the check drives (family-P2: concat, then static)
    path = ("concat" if "concat" in paths else "static" if "static" in paths else "concat" if None in paths
            else "static+reuse")
    if pattern.startswith("(?:"):  # family-P2: the first of the concat and static paths' errors
        error, fix = "mask-or-index-error", ALTERNATION_FIX
    else:
        error, fix = next(((name, fix) for text, name, fix in PROGRAM_ERRORS if text in pattern), (None, None))
        if error is None:
            return None
        if error == "size-mismatch":
            dim = re.search(r"dimension (\d)", pattern).group(1)
            fix = SIZE_MISMATCH_FIXES.get(("extend" if assisted else call, dim))
            if fix is None:
                return None
    # family-P2 alone: the concat path first, then the static one (check_static_concat)
    paths = ("concat", path) if path != "concat" and all(e.get("property") == "family-P2" for e in entries) else (path,)
    prefix = re.match(r"(family-\w+) ", pattern)  # a second finding of the same error, seen by one check
    short = "-".join(filter(None, [slugify("-then-".join(paths)), "beam-reorder" if call == "reorder" else slugify(call), error,
                                   slugify(prefix.group(1)) if prefix else None]))
    # family-ops' beam program: batch 3 (mpt-kv's OPS_PADS), whose first reorder [2, 0, 1] reaches
    # past a dimension of 2 (ChatGLM's 2 multi-query groups, where its _reorder_cache selects)
    beam = call in ("reorder", "beam-decode") and all(e.get("property") == "family-ops" for e in entries)
    return Program(call, path, paths, short, expected_errors(entry["pattern"]), fix,
                   pads=(2, 0, 1) if beam or assisted else (2, 0), prompt=8 if assisted else 6)


# optimum-habana findings seen in what a call leaves, not in an error (port_program.py.tmpl's
# OBSERVE): the seed bug class in a port (the cache views the fused projection's output after the
# prefill), and a port's logits against the eager reference (transformers' eager Falcon ALiBi
# attention adds ALiBi twice: not the port's error, its sdpa equals the port), with, for family-P1,
# the crash that run meets after (the error's last line on each path, as the entry's reason says)
VIEWS_FIX = ("copy the prefill's K/V out of the fused projection's output before caching them (index_select, "
             "`.contiguous()` or `.clone()` of the slices), as optimum-habana's MPT port has done since it stopped "
             "caching views of mixed_qkv")

# family variants whose cached V views another module's output than the fused projection: that module
# (MiniCPM3's port splits its nope-K and V out of kv_b_proj's output, modeling_minicpm.py:846)
VIEWED_MODULES = {("minicpm", "mla"): "kv_b_proj"}

EAGER_ALIBI_FIX = ("in transformers' eager Falcon attention add ALiBi once: it is already folded into the causal "
                   "mask (_update_causal_mask, modeling_falcon.py:911-916), so drop `attention_scores + alibi` "
                   "(:393-394), as its sdpa path does")

EAGER_ALIBI_SEEN = ("the prefill's logits equal transformers' sdpa forward, not its eager forward (mpt-kv's "
                    "reference), which adds ALiBi twice")

WINDOW_FIX = ("cache a local (sliding-window) layer's window only: on the concat path its last window - 1 "
              "positions (the next query attends to itself and those), on the static path a buffer of "
              "min(length, window) slots written as a ring, as transformers 5.x's DynamicSlidingWindowLayer and "
              "StaticSlidingWindowLayer do; the global layers keep the whole history")

EXTEND_CRASHES = {"concat": r"RuntimeError: The expanded size of the tensor \(\d+\) must match the existing size",
                  "static": r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b"}

EXTEND_CRASH_FIXES = {"concat": PROGRAM_ERRORS[0][2], "static": SIZE_MISMATCH_FIXES[("extend", "3")]}


# optimum-habana findings of wrong logits (the family checks' P0, P1, P2 and ops comparisons), by
# the property whose check saw them and what the pattern compares: (the call, the observation, what
# the folder's short name says, what is seen); prefill or decode from the pattern's step
LOGITS_SEEN = {
    "uncached": "the port's uncached logits differ from transformers' uncached forward (same weights)",
    "prefill": "the prefill's logits differ from transformers' uncached forward (same weights)",
    "decode": "a decode step's logits differ from transformers' uncached forward over the same tokens",
    "static-vs-concat": "a decode step's logits on the static path differ from the concat path's (same tokens)",
}


@recipe_program
def logits_program(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana finding of wrong logits against transformers' uncached
    forward (family-P0, P1, ops) or the concat path's (family-P2): the call the pattern's step
    names, on the finding's path (concat where an entry holds there or on every path)."""
    entry = entries[0]
    implementation, family, _ = target_of(entry)
    # transformers' own model is the reference: a remote-code family has none
    if implementation != "optimum-habana" or family not in PORT_PATCHES:
        return None
    pattern = entry["pattern"].replace("\\", "")
    found = re.match(r"(family-\w+) (.*?)logits vs (transformers' uncached forward|the concat path's)", pattern)
    if found is None:
        return None
    prop, step, against = found.groups()
    paths = {e.get("path") for e in entries}
    path = "concat" if "concat" in paths or None in paths else "static" if "static" in paths else None
    if path is None:
        return None
    if prop == "family-P0":
        call, kind, short = "uncached", "uncached-logits", "uncached-logits-vs-transformers"
    elif "prefill" in step:
        call, kind, short = "prefill", "uncached-logits", f"{path}-prefill-logits-vs-uncached"
    elif "decode" in step:
        call = "decode-2" if "decode step 2" in step else "decode"
        kind = "concat-logits" if against == "the concat path's" else "uncached-logits"
        short = f"{path}-decode-logits-vs-" + ("concat" if kind == "concat-logits" else "uncached")
    else:
        return None
    if prop not in ("family-P0", "family-P1", "family-P2"):  # a second finding of the same comparison
        short += f"-{slugify(prop)}"
    seen = LOGITS_SEEN["static-vs-concat" if kind == "concat-logits" else call.split("-")[0]]
    observe = (("extend" if call.startswith("decode") else call, kind),)
    paths_driven = ("concat", path) if kind == "concat-logits" else (path,)
    fix = f"see the upstream line{'s' if ' and ' in entry['upstream'] else ''}: {entry['upstream']}"
    # family-ops' beam program prefills 8 tokens (3 rows, left-padded 2, 0, 1): where a window is longer than
    # the default prompt of 6 only that prompt reaches past it (gpt_oss's 7)
    family_entry = FAMILIES[family]
    windows = [w for w in family_entry.layer_windows(family_entry.config(target_of(entry)[2])) if w]
    longer = prop == "family-ops" and call == "prefill" and windows and min(windows) > 6
    return Program(call, path, paths_driven, short, None, fix, observe, seen,
                   **({"prompt": 8, "pads": (2, 0, 1)} if longer else {}))


@recipe_program
def observed_program(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana finding seen after a call (`views` or `logits`)."""
    entry = entries[0]
    implementation, family, variant = target_of(entry)
    if implementation != "optimum-habana" or not templated(family):
        return None
    path = next((e["path"] for e in entries if e.get("path")), "concat")
    fused = FAMILIES[family].fused
    # the views, as the entry lists them or as a family-P3 pattern names them ("... are views of
    # <module>.<fused>'s output")
    named = fused and re.search(rf"are views of .*{re.escape(fused)}'s output", entry["pattern"].replace("\\", ""))
    if (entry.get("views") or named) and path in ("concat", "static"):
        memory = entry["pattern"].startswith("family-memory")
        observe = (("prefill", "memory"), ("prefill", "views")) if memory else (("prefill", "views"),)
        views = what(entry).replace("`", "") if entry.get("views") else f"K and V view {fused}'s output"
        seen = ("the cache's storages hold more bytes than its K/V: " if memory else "") + views
        return Program("prefill", path, (path,), f"{path}-prefill-" + ("storage-bytes" if memory else "kv-views"),
                       None, VIEWS_FIX, observe, f"after the prefill, {seen}")
    viewed = VIEWED_MODULES.get((family, variant))
    if viewed and "is a view of a buffer that is no fused projection's output" in entry["pattern"] and \
            path in ("concat", "static"):
        # a cached tensor that views another module's output than the family's fused projection
        return Program("prefill", path, (path,), f"{path}-prefill-value-view-of-{slugify(viewed)}", None, VIEWS_FIX,
                       (("prefill", "views"),), f"after the prefill, the cached V views {viewed}'s output",
                       fused=viewed)
    if entry["pattern"].startswith("the cached tensors themselves hold") and "windows per layer" in entry["pattern"]:
        # family-memory of a window: the local layers' cache against the window's analytic bytes
        static = path.startswith("static")
        return Program("prefill", path, (path,), f"{path}-prefill-local-layers-beyond-window", None, WINDOW_FIX,
                       (("prefill", "window-memory"),),
                       "after the prefill, the local layers' cached K/V hold more positions than their window "
                       + ("(the static buffer's every slot)" if static else "(the whole history)"))
    if "vs transformers' uncached forward" in entry["pattern"] and (family, variant) == (
            "falcon", "alibi"):
        if "did not get past extend 3" not in entry["pattern"]:  # family-P0 and the ops' prefill
            return Program("prefill", "concat", ("concat",), "prefill-logits-vs-eager", None, EAGER_ALIBI_FIX,
                           (("prefill", "logits"),), EAGER_ALIBI_SEEN)
        if path in EXTEND_CRASHES:  # family-P1: the prefill's logits, then the 3-token call's crash
            return Program("extend", path, (path,), f"{path}-prefill-logits-vs-eager-then-extend-crash",
                           EXTEND_CRASHES[path], f"{EAGER_ALIBI_FIX}; then {EXTEND_CRASH_FIXES[path]}",
                           (("prefill", "logits"),), EAGER_ALIBI_SEEN)
    return None


def load_part(port) -> str:
    """The body of a script's load_port: the plain import, under the loading stand-in, or under the kernel
    stand-in (a port that declares `GaudiPort.kernels`: what its cells ran with, shipped in the script)."""
    return part("load_with_kernel_standin" if port.kernels else "load_with_standin" if port.standin else "load_plain")


def standin_kernels(port, flash: bool = False) -> str:
    """For a port that declares `GaudiPort.kernels`, or a finding of a recipe with --use_flash_attention
    (`flash`: FusedSDPA among them): the script's constants its kernel stand-in needs
    (load_with_kernel_standin.part, flash_standin.part), the stand-in kernels' source as mpt-kv ships it
    (mpt_kv/families/hpu_kernels.py, one source for the cells and the scripts) among them; else nothing."""
    if not port.kernels and not flash:
        return ""
    kernels = tuple(dict.fromkeys(tuple(port.kernels) + (("FusedSDPA",) if flash else ())))
    from mpt_kv.families import habana_standin, hpu_kernels

    source = Path(hpu_kernels.__file__).read_text(encoding="utf-8")
    if "'''" in source or source.rstrip().endswith("\\"):
        raise ValueError("mpt_kv/families/hpu_kernels.py cannot be shipped as a raw string (it holds ''' or ends "
                         "in a backslash)")
    modules = {k: habana_standin.KERNELS[k].rsplit(".", 1)[0] for k in kernels if k != "mixture_of_experts"}
    return ("\n# The HPU kernels this port calls with no CPU fallback, run by mpt-kv's CPU stand-ins of them as its\n"
            "# cpu+standin cells ran them (load_port below imports it under them), each written from the kernel's\n"
            "# documented semantics (STANDIN_KERNELS: mpt_kv/families/hpu_kernels.py as shipped; its docstrings\n"
            "# cite them); HPU_BRANCHES: the port's functions whose CPU branch cannot run, taken on their HPU branch\n"
            f"KERNELS = {kernels!r}\nKERNEL_MODULES = {modules!r}\n"
            f"HPU_BRANCHES = {tuple(port.hpu_branches)!r}\nSTANDIN_KERNELS = r'''{source}'''\n")


def expected_error(entry: dict) -> str:
    """The finding's pattern from the exception's type on: the last line of the error."""
    return re.sub(r"^.*?raised ", "", entry["pattern"])


def port_repro(entries: list[dict], slug: str) -> Repro:
    """An optimum-habana finding its port's prefill forward or beam-search reorder raises."""

    entry = entries[0]
    _, family, variant = target_of(entry)
    operation, _ = port_operation(entries)
    port = FAMILIES[family].gaudi
    config_class, _ = class_names(family)
    expected = expected_error(entry)
    what_fails = {"forward": "the prefill forward",
                  "reorder": "the beam-search cache reorder after the prefill"}[operation]
    title = f"optimum-habana {family}/{variant}: {what_fails} raises {expected.replace(chr(92), '')}"
    patches = "\n".join(f"    hf.{name}{'.' + attribute if attribute else ''} = port.{value}"
                        for name, attribute, value in PORT_PATCHES[family])
    script = fill(
        template("port.py.tmpl"), title=title, summary=textwrap.fill(entry["reason"], 96), upstream=entry["upstream"], when=versions(entry),
        family=family, variant=variant, config_class=config_class, hf_module=port.hf_module,
        port_module=port.module, causal_lm=port.causal_lm, expected=repr(expected),
        config=config_literal(tiny_config(family, variant)), forward_kwargs=repr(dict(port.forward_kwargs)),
        generation_config=repr(dict(port.generation)), patches=patches,
        load_module=load_part(port), standin_kernels=standin_kernels(port),
        operation=part(f"port_{operation}"), what_fails=what_fails,
        generation_function=part("generation_function") if operation == "reorder" else "")
    calls = {"forward": "model.generate(input_ids, attention_mask=attention_mask) - any generate of the port, "
                        "on an HPU or on CPU; here its first forward",
             "reorder": "model.generate(input_ids, attention_mask=attention_mask, num_beams=2) - beam search "
                        "with reuse_cache off (the default); here its first reorder"}
    fixes = {"forward": f"see the upstream line: the port's forward must run the tiny {family} ({variant}) "
                        "config that transformers' own model runs",
             "reorder": f"define `_reorder_cache` on {port.causal_lm} (index_select of every layer's K and V "
                        "along the batch, as transformers' legacy models did), or have "
                        "_temporary_reorder_cache reorder a legacy tuple cache itself"}
    readme = readme_text(entries, title, calls[operation], fixes[operation])
    return Repro(slug, title, script, readme, tuple(entries))


def program_repro(entries: list[dict], slug: str) -> Repro:
    """An optimum-habana finding a short program of generate's calls raises (`crash_program`) or
    leaves in its cache or logits (`observed_program`)."""

    entry = entries[0]
    _, family, variant = target_of(entry)
    program = program_of(entries)
    port = FAMILIES[family].gaudi
    config_class, imports, remote_config, remote_weights = model_source(family)
    what_fails = PROGRAM_CALLS[program.call]
    recipe = recipes.RECIPES[program.recipe] if program.recipe else None
    flash = bool(recipe and recipe.use_flash_attention)
    where = {"concat": "static shapes off", "static": "static shapes (token_idx)",
             "static+reuse": "static shapes and reuse_cache"}[program.path]
    if recipe is not None:
        where += f", the recipe {recipe.name} ({recipe.describe()})"
    if len(program.paths) > 1:
        where = f"static shapes off, then {where}"
    if program.observe:  # what is seen, then the error that follows it, if the finding has one
        then = (f"; then {PROGRAM_CALLS[program.call]} raises {program.expected.replace(chr(92), '')}"
                if program.expected else "")
        title = f"optimum-habana {family}/{variant}, {where}: {program.seen}{then}"
        what_fails = program.seen
    else:
        title = (f"optimum-habana {family}/{variant}, {where}: {what_fails} raises "
                 f"{program.expected.replace(chr(92), '')}")
    patches = "\n".join(f"    hf.{name}{'.' + attribute if attribute else ''} = port.{value}"
                        for name, attribute, value in PORT_PATCHES.get(family, ())) or "    # (none: remote code)"
    script = fill(
        template("port_program.py.tmpl"), title=title, summary=textwrap.fill(entry["reason"], 96), upstream=entry["upstream"], when=versions(entry),
        family=family, variant=variant, config_class=config_class, imports=imports, remote_config=remote_config,
        remote_weights=remote_weights,
        port_module=port.module, causal_lm=port.causal_lm, expected=repr(program.expected),
        config=config_literal(tiny_config(family, variant)),
        forward_kwargs=repr({**port.forward_kwargs, **recipe_forward_kwargs(family, program.recipe)}),
        recipe_note=f"; with the recipe {recipe.name}'s flags: {recipe.describe()}" if recipe else "",
        valid_lengths=repr(bool(recipe and recipe.flash_attention_causal_mask)),
        flash_standin=part("flash_standin") if flash else "    return\n",
        generation_config=repr(dict(port.generation)), patches=patches,
        load_module=load_part(port), standin_kernels=standin_kernels(port, flash), what_fails=what_fails,
        program=repr(PROGRAMS[program.call]), paths=repr(program.paths), observe=repr(list(program.observe)),
        fused=program.fused or FAMILIES[family].fused, generation_function=part("generation_function"),
        layout=layout_literal(family, variant, program), vocab_key=repr(vocab_key(family, variant)),
        pads=repr(program.pads), prompt=program.prompt, fresh_transformers=FRESH_TRANSFORMERS if FAMILIES[family].remote_code else "")
    options = {"concat": "static_shapes=False", "static": "static_shapes=True (the default on Gaudi)",
               "static+reuse": "static_shapes=True, reuse_cache=True"}[program.path]
    if recipe is not None:  # the recipe's flags as generate's options (reuse_cache is its path's)
        options += "".join(f", {k}=True" for k in ("trim_logits", "attn_softmax_bf16", "use_flash_attention",
                                                   "flash_attention_recompute", "flash_attention_causal_mask")
                           if getattr(recipe, k))
    calls = {"prefill": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its prefill",
             "decode": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its first decode "
                       "step",
             "decode-2": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its second "
                         "decode step",
             "(prefill|decode)": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its "
                                 "prefill and first decode step",
             "extend": "model.generate(new_ids, attention_mask=mask, past_key_values=<an earlier generate's cache>, "
                       f"{options}) - a cached call of k > 1 tokens; here a prefill, 2 greedy steps, then 3 tokens "
                       "in one call",
             "assisted-extend": f"model.generate(input_ids, attention_mask=attention_mask, prompt_lookup_num_tokens=3, "
                                f"{options}) - assisted decoding's verification of its candidates; here a prefill, "
                                "then 3 tokens in one cached call",
             "reorder": f"model.generate(input_ids, attention_mask=attention_mask, num_beams=2, {options}) - here "
                        "its first reorder",
             "beam-decode": f"model.generate(input_ids, attention_mask=attention_mask, num_beams=2, {options}) - here "
                            "its prefill, a step, the reorder and the next step",
             "uncached": "model(input_ids, attention_mask=attention_mask, use_cache=False) - any forward of the "
                         "port; here the uncached one, as transformers' own model's"}
    readme = readme_text(entries, title, calls[program.call], program.fix)
    return Repro(slug, title, script, readme, tuple(entries))


# A remote-code port imports transformers' classes itself (DeciLM's subclass Llama's): in an interpreter
# that ran other optimum-habana scripts, whose replayed patches replaced those classes in place, the
# modules are read again first and the port imported anew
FRESH_TRANSFORMERS = (
    "    # transformers' model modules read again: another optimum-habana script run in this interpreter may\n"
    "    # have patched their classes (adapt_transformers_to_gaudi), which this remote-code port imports\n"
    "    for name in [n for n in sys.modules if n.startswith(\"transformers.models.\") and \".modeling_\" in n]:\n"
    "        importlib.reload(sys.modules[name])\n"
    "    sys.modules.pop(PORT_MODULE, None)\n")


def vocab_key(family_name: str, variant: str) -> str:
    """The tiny config's key of the vocabulary size (ChatGLM's remote config names it padded_vocab_size)."""
    config = tiny_config(family_name, variant)
    return next(key for key in ("vocab_size", "padded_vocab_size") if key in config)


def layout_literal(family_name: str, variant: str, program: Program) -> str:
    """The script's LAYOUT: each caching layer's window (None: global), its K/V heads and head dim,
    from the family entry (mpt_kv/families/<family>.py), where the script checks a window's bytes."""
    if not any(kind == "window-memory" for _, kind in program.observe):
        return "LAYOUT = None  # (this script checks no window's bytes)"
    family = FAMILIES[family_name]
    config = family.config(variant)
    layout = {"windows": family.layer_windows(config), "kv_heads": family.kv_heads(config),
              "head_dim": family.head_dim(config)}
    return ("# Each caching layer's window (None: a global layer), its K/V heads and head dim\n"
            f"LAYOUT = {layout!r}")


def model_source(family_name: str) -> tuple[str, str, str, str]:
    """(the config class's name, the script's imports of it and of transformers' module of the
    family, the line that takes a remote-code config class from the port's folder once it is
    loaded, the lines that set a remote-code model's unset weights), for port_program.py.tmpl."""
    family = FAMILIES[family_name]
    if not family.remote_code:
        config_class, _ = class_names(family_name)
        return (config_class, f"    from transformers import {config_class}\n    import {family.gaudi.hf_module} as hf",
                "", "")
    module, config_class = family.remote_config.split(":")
    imports = ("    hf = None  # remote code: transformers has no module of this family, the port's own model is "
               "the model")
    remote_config = (f"    # remote code: the config class is the port's own copy of the Hub file, beside its model\n"
                     f"    {config_class} = importlib.import_module({module!r}).{config_class}\n")
    remote_weights = ("    # remote code leaves some parameters as torch.empty for a checkpoint to fill (whatever memory "
                      "held):\n    # the 1-D weights (the norms') set to 1 and 1-D biases to 0, as their own init does "
                      "elsewhere\n    with torch.no_grad():\n        for name, param in model.named_parameters():\n"
                      "            if param.dim() == 1:\n"
                      "                param.fill_(1.0 if name.endswith(\"weight\") else 0.0)\n")
    return config_class, imports, remote_config, remote_weights


def port_operation(entries: list[dict]) -> tuple[str, str] | None:
    """(operation, short name) of an optimum-habana finding a port template covers, else None."""
    entry = entries[0]
    implementation, family, variant = target_of(entry)
    if implementation != "optimum-habana" or family not in PORT_PATCHES:  # port.py.tmpl replays the patches
        return None
    for (crash_family, crash_variant, text), short in FORWARD_CRASHES.items():
        if (family, variant) == (crash_family, crash_variant) and text in entry["pattern"]:
            return "forward", short
    if REORDER_CRASH in entry["pattern"].replace("\\", "") and any(e.get("path") in (None, "concat") for e in entries):
        return "reorder", "beam-reorder-no-reorder-cache"
    return None


def program_of(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana finding port_program.py.tmpl covers: a crash or an observation."""
    return crash_program(entries) or observed_program(entries) or logits_program(entries)
