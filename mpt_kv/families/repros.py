"""Standalone reproductions of the family findings (`python -m mpt_kv findings --repro DIR`).

A finding (a group of known failures, `mpt_kv.families.findings.grouped`) is a regex and a file:line
here; a maintainer upstream needs a script that shows it with no mpt-kv installed. Each covered
finding becomes a folder `<implementation>-<family>-<variant>-<short what>` with

    repro.py    imports only torch, transformers (and optimum-habana's own files): it prints what
                it shows and exits 1 where the bug is there, 0 where it is not, 2 where it could
                not run its experiment (a module missing, another error): never 0 then;
    README.md   the user-level call that reaches it, the upstream line, its cost at a real config,
                the versions it holds in, a suggested fix.

The scripts are filled in from templates kept in the package (`repro_templates/*.py.tmpl`,
`string.Template`), with the finding's data: the family's tiny config with the variant's
overrides, as a literal. A finding no template covers is listed as "no standalone repro yet".
"""

from __future__ import annotations

import pprint
import re
import textwrap
from dataclasses import dataclass
from string import Template

from mpt_kv import package_data
from mpt_kv.families import FAMILIES, user_path
from mpt_kv.families.findings import DTYPE_NAME, POINTS, checks_seen, human, versions, what

# Runs each script as `python repro.py` would (run_name "__main__") in one interpreter, its output
# captured: `python -c DRIVER SOURCE SCRIPT...`, SOURCE a folder taken off sys.path first ("" for
# none: the sweep's envs have the checkout on their path by a .pth file). Prints {path: {"code",
# "output"}} and every mpt_kv module the scripts imported (there must be none). A script that raises
# instead of exiting is status 2, "cannot run", its exception in its output. The sweep and
# tests/test_repros.py run the scripts through it.
DRIVER = """
import contextlib, io, json, os, runpy, sys
if sys.argv[1]:
    source = os.path.realpath(sys.argv[1])
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != source]
results = {}
for path in sys.argv[2:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # a script must exit, never raise: counted as "cannot run"
            code = 2
            print(f"the script raised {e!r}")
    results[path] = {"code": code, "output": out.getvalue()}
imported = sorted(m for m in sys.modules if m == "mpt_kv" or m.startswith("mpt_kv."))
print(json.dumps({"results": results, "mpt_kv_modules": imported}))
"""

TEMPLATES = package_data.REPRO_TEMPLATES

# Why a view finding costs memory, and how transformers 4.56 stopped it (DynamicLayer.update's
# first store goes through lazy_initialization + torch.cat, which copies)
VIEW_FIX = ("copy the first K/V into the cache in DynamicLayer.update's first store (`.contiguous()`/`.clone()` "
            "of the chunks, or allocate and `copy_`), as transformers 4.56 does (lazy_initialization, then "
            "torch.cat)")


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
}

# optimum-habana findings whose error the port's prefill forward raises: (family, variant, a text of
# the pattern) -> the folder's short name. Any forward of generate reaches them.
FORWARD_CRASHES = {
    ("codegen", "mha", "can only concatenate tuple"): "forward-typeerror",
    ("phi", "gqa", "The size of tensor a"): "forward-size-mismatch",
    ("llama", "fused-qkv", "'NoneType' object has no attribute 'weight'"): "forward-nonetype-weight",
    ("mistral", "gqa", "The size of tensor a"): "forward-rope-size-mismatch",
    ("starcoder2", "gqa", "KeyError: 'input_shape'"): "forward-keyerror-input-shape",
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
    "reorder": [("prefill",), ("reorder",)],
}
PROGRAM_CALLS = {"prefill": "the prefill", "decode": "a decode step after the prefill",
                 "(prefill|decode)": "the prefill or the decode step after it",
                 "extend": "a 3-token cached call after the prefill and 2 decode steps",
                 "reorder": "the beam-search cache reorder after the prefill"}
# (a text of the error, its short name, a one-sentence suggested fix), the first that matches
PROGRAM_ERRORS = [
    ("The expanded size of the tensor", "causal-mask-expand",
     "in GaudiAttentionMaskConverter._make_causal_mask (modeling_attn_mask_utils.py:53-54) pad the chunk's causal "
     "mask with past_key_values_length zero columns (not past_key_values_length - tgt_len), as transformers' "
     "AttentionMaskConverter does"),
    ("The size of tensor a", "size-mismatch", None),
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
     "read the K/V heads from the config in allocate_kv_cache (modeling_starcoder2.py:156): the attention "
     "module has no num_key_value_heads"),
]
SIZE_MISMATCH_FIXES = {
    ("extend", "3"): "with token_idx, build the chunk's causal mask against the whole cache (past_key_values_length = "
                     "token_idx - 1) so that to_4d's masked_fill (modeling_attn_mask_utils.py:128) gets matching shapes",
    ("extend", "2"): "have KVCache.update write a chunk of k tokens at token_idx - 1 (modeling_gptj.py:51-53), not one",
    ("prefill", "1"): "allocate the reuse_cache K/V with the heads the attention writes (allocate_kv_cache, "
                      "modeling_falcon.py:255)",
}
ALTERNATION_FIX = ("see the upstream lines: the concat path's causal mask (modeling_attn_mask_utils.py:53-54), the "
                   "static path's to_4d (:128) and a one-slot index_copy_ each refuse a chunk of k > 1 tokens")


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


def expected_errors(pattern: str) -> str:
    """`expected_error` of a pattern that may be an alternation of "<call> raised <error>" texts."""
    if pattern.startswith("(?:"):
        return re.sub(r"the implementation's \w+ raised ", "", pattern)
    return re.sub(r"^.*?raised ", "", pattern)


def crash_program(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana crash finding: its call from the pattern, its path from the
    entries (concat where an entry holds there, else static, else concat where an entry holds on
    every path, else static+reuse)."""
    entry = entries[0]
    if implementation(entry) != "optimum-habana" or entry["family"] not in PORT_PATCHES:
        return None
    pattern = entry["pattern"].replace("\\", "")
    found = re.search(r"(\(prefill\|decode\)|prefill|decode|extend|reorder) raised \w+", pattern)
    if not found:
        return None
    call = found.group(1)
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
            fix = SIZE_MISMATCH_FIXES.get((call, dim))
            if fix is None:
                return None
    # family-P2 alone: the concat path first, then the static one (check_static_concat)
    paths = ("concat", path) if path != "concat" and all(e.get("property") == "family-P2" for e in entries) else (path,)
    prefix = re.match(r"(family-\w+) ", pattern)  # a second finding of the same error, seen by one check
    short = "-".join(filter(None, [slugify("-then-".join(paths)), "beam-reorder" if call == "reorder" else slugify(call), error,
                                   slugify(prefix.group(1)) if prefix else None]))
    return Program(call, path, paths, short, expected_errors(entry["pattern"]), fix)


# optimum-habana findings seen in what a call leaves, not in an error (port_program.py.tmpl's
# OBSERVE): the seed bug class in a port (the cache views the fused projection's output after the
# prefill), and a port's logits against the eager reference (transformers' eager Falcon ALiBi
# attention adds ALiBi twice: not the port's error, its sdpa equals the port), with, for family-P1,
# the crash that run meets after (the error's last line on each path, as the entry's reason says)
VIEWS_FIX = ("copy the prefill's K/V out of the fused projection's output before caching them (index_select, "
             "`.contiguous()` or `.clone()` of the slices), as optimum-habana's MPT port has done since it stopped "
             "caching views of mixed_qkv")
EAGER_ALIBI_FIX = ("in transformers' eager Falcon attention add ALiBi once: it is already folded into the causal "
                   "mask (_update_causal_mask, modeling_falcon.py:911-916), so drop `attention_scores + alibi` "
                   "(:393-394), as its sdpa path does")
EAGER_ALIBI_SEEN = ("the prefill's logits equal transformers' sdpa forward, not its eager forward (mpt-kv's "
                    "reference), which adds ALiBi twice")
EXTEND_CRASHES = {"concat": r"RuntimeError: The expanded size of the tensor \(\d+\) must match the existing size",
                  "static": r"RuntimeError: The size of tensor a \(\d+\) must match the size of tensor b"}
EXTEND_CRASH_FIXES = {"concat": PROGRAM_ERRORS[0][2], "static": SIZE_MISMATCH_FIXES[("extend", "3")]}


def observed_program(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana finding seen after a call (`views` or `logits`)."""
    entry = entries[0]
    if implementation(entry) != "optimum-habana" or entry["family"] not in PORT_PATCHES:
        return None
    path = next((e["path"] for e in entries if e.get("path")), "concat")
    if entry.get("views") and path in ("concat", "static"):
        memory = entry["pattern"].startswith("family-memory")
        observe = (("prefill", "memory"), ("prefill", "views")) if memory else (("prefill", "views"),)
        seen = ("the cache's storages hold more bytes than its K/V: " if memory else "") + what(entry).replace("`", "")
        return Program("prefill", path, (path,), f"{path}-prefill-" + ("storage-bytes" if memory else "kv-views"),
                       None, VIEWS_FIX, observe, f"after the prefill, {seen}")
    if "vs transformers' uncached forward" in entry["pattern"] and (entry["family"], entry["variant"]) == (
            "falcon", "alibi"):
        if "did not get past extend 3" not in entry["pattern"]:  # family-P0 and the ops' prefill
            return Program("prefill", "concat", ("concat",), "prefill-logits-vs-eager", None, EAGER_ALIBI_FIX,
                           (("prefill", "logits"),), EAGER_ALIBI_SEEN)
        if path in EXTEND_CRASHES:  # family-P1: the prefill's logits, then the 3-token call's crash
            return Program("extend", path, (path,), f"{path}-prefill-logits-vs-eager-then-extend-crash",
                           EXTEND_CRASHES[path], f"{EAGER_ALIBI_FIX}; then {EXTEND_CRASH_FIXES[path]}",
                           (("prefill", "logits"),), EAGER_ALIBI_SEEN)
    return None


PORT_OPERATIONS = {
    "forward": """\
        # the prefill forward of model.generate(..., use_cache=True)
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask, use_cache=True, **forward_kwargs(model, input_ids))""",
    "reorder": """\
        with torch.no_grad():
            out = model(input_ids, attention_mask=attention_mask, use_cache=True, **forward_kwargs(model, input_ids))
        # beam search reorders the cache after every step (generation/utils.py _beam_search,
        # reuse_cache off): optimum-habana's own _temporary_reorder_cache
        temporary_reorder_cache = generation_function(root, "_temporary_reorder_cache")
        temporary_reorder_cache(model, out.past_key_values, torch.tensor([1, 0]))""",
}
GENERATION_FUNCTION = '''\
def generation_function(root: Path, name: str):
    """A function of optimum-habana's generation/utils.py, compiled from its own source: that module
    does not import without an HPU stack, but the function itself is plain torch and transformers."""
    import ast

    path = root / "transformers" / "generation" / "utils.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:  # another release's generation code: this experiment does not apply there
        raise LookupError(f"this optimum-habana's generation/utils.py defines no {name}(): it reorders the cache "
                          "another way")
    namespace = {"torch": torch, "DynamicCache": DynamicCache, "EncoderDecoderCache": EncoderDecoderCache}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


'''
LOAD_PLAIN = "    return importlib.import_module(PORT_MODULE)"
LOAD_WITH_STANDIN = """\
    if importlib.util.find_spec("habana_frameworks") is not None:  # a real HPU stack: the normal import
        return importlib.import_module(PORT_MODULE)
    # The module imports habana_frameworks.torch.core at module level, for mark_step() only: a no-op
    # stand-in for this one import (hpu.is_available() is False and its fused kernels still fail to
    # import, so the module takes its own CPU fallbacks)
    names = ("habana_frameworks", "habana_frameworks.torch", "habana_frameworks.torch.core",
             "habana_frameworks.torch.hpu")
    standin = {}
    for name in names:
        standin[name] = types.ModuleType(name)
        standin[name].__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=name.count(".") < 2)
        if name.count(".") < 2:
            standin[name].__path__ = []
    standin["habana_frameworks"].torch = standin["habana_frameworks.torch"]
    standin["habana_frameworks.torch"].core = standin["habana_frameworks.torch.core"]
    standin["habana_frameworks.torch"].hpu = standin["habana_frameworks.torch.hpu"]
    standin["habana_frameworks.torch.core"].mark_step = lambda *args, **kwargs: None
    standin["habana_frameworks.torch.hpu"].is_available = lambda: False
    sys.modules.update(standin)
    try:
        return importlib.import_module(PORT_MODULE)
    finally:
        for name in names:  # nothing after this import sees a Gaudi stack
            sys.modules.pop(name, None)"""


@dataclass(frozen=True)
class Repro:
    """One finding's standalone reproduction: its folder name, script and README."""

    slug: str
    title: str
    script: str
    readme: str
    entries: tuple  # the finding's known-failure entries (one per check that sees it)


def implementation(entry: dict) -> str:
    """The package a finding is in: a family entry's "implementation", an MPT target entry's "target"."""
    return entry.get("implementation") or entry.get("target") or "transformers"


def is_transformers_view(entry: dict) -> bool:
    """A transformers finding whose cached K/V view a larger buffer (a "views" entry)."""
    return bool(entry.get("views")) and implementation(entry) == "transformers"


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def slug(entry: dict, short: str) -> str:
    return slugify(f"{implementation(entry)}-{entry['family']}-{entry['variant']}-{short}")


def tiny_config(family_name: str, variant: str) -> dict:
    """The tiny config's keyword arguments, as `Family.config` builds it: TINY-style settings with
    the variant's overrides (a shallow merge)."""
    family = FAMILIES[family_name]
    return {**family.tiny, **family.variants[variant]}


def config_literal(config: dict) -> str:
    """`config` as a Python dict literal, one key a line."""
    text = pprint.pformat(config, indent=4, width=100, sort_dicts=False)
    return "{\n    " + text[1:-1].strip() + ",\n}" if len(config) > 1 else text


def class_names(family_name: str) -> tuple[str, str]:
    """(config class, causal LM class) transformers names for the family's model_type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = FAMILIES[family_name].model_type
    return CONFIG_MAPPING_NAMES[model_type], MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def template(name: str) -> Template:
    return Template((TEMPLATES / name).read_text(encoding="utf-8"))


def view_repro(entries: list[dict]) -> Repro:
    """A transformers view finding: the prefill's cached K/V view the fused projection's output."""

    entry = entries[0]
    family, variant = entry["family"], entry["variant"]
    config_class, _ = class_names(family)
    pins = what(entry)
    title = f"transformers {family}/{variant}: after the prefill, {pins.replace('`', '')}"
    summary = textwrap.fill(entry["reason"], 96)
    script = template("view.py.tmpl").substitute(
        title=title, summary=summary, upstream=entry["upstream"], when=versions(entry), config_class=config_class,
        family=family, variant=variant, config=config_literal(tiny_config(family, variant)),
        pins=pins.replace("`", ""))
    call = ("model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=N) - any generate with "
            "use_cache=True (the default) and the default DynamicCache")
    readme = readme_text(entries, title, call, VIEW_FIX)
    return Repro(slug_of(entries), title, script, readme, tuple(entries))


# transformers findings a prefill shows (transformers_call.py.tmpl): (family, variant, a text of the
# pattern) -> (short name, the functions, the operation, what the script runs, a suggested fix)
TRANSFORMERS_CALLS = {
    ("falcon", "new-arch-gqa", "the cached tensors themselves hold"): (
        "kv-cache-all-heads", '''\
def cached_tensors(cache):
    """Each layer's cached (key, value), from whatever the forward returned as past_key_values."""
    if hasattr(cache, "layers"):  # a Cache object (transformers >= 4.54)
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):  # an older DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    return [tuple(layer) for layer in cache]  # legacy tuples

''', '''\
    # the prefill forward of generate, with its default DynamicCache
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, use_cache=True)
    cached = sum(t.numel() * t.element_size() for layer in cached_tensors(out.past_key_values) for t in layer)
    # grouped-query attention needs num_kv_heads K/V heads per layer, not one per query head
    head_dim = config.hidden_size // config.num_attention_heads
    size = torch.empty((), dtype=model.dtype).element_size()
    analytic = 2 * config.num_hidden_layers * input_ids.numel() * config.num_kv_heads * head_dim * size
    print(f"cached K/V: {cached} bytes; num_kv_heads={config.num_kv_heads} K/V heads need {analytic} bytes "
          f"(ratio {cached / analytic:.2f}; num_attention_heads / num_kv_heads = "
          f"{config.num_attention_heads / config.num_kv_heads:.2f})")
    if cached > analytic:
        print(f"BUG: the cache holds {cached / analytic:.2f} times the grouped-query K/V")
        return 1
    print("OK: the cache holds num_kv_heads K/V heads")
    return 0''',
        "model.generate(input_ids, attention_mask=attention_mask) - any generate of a new-architecture Falcon with "
        "num_kv_heads < num_attention_heads, the default DynamicCache; here its prefill",
        "cache the num_kv_heads K/V heads and broadcast them to the query heads after the cache update "
        "(modeling_falcon.py:256-261), as llama's repeat_kv does"),
    ("falcon", "rotary-mqa", "index_copy_"): (
        "static-cache-prefill-index-copy", "", '''\
    # generate(cache_implementation="static"): a StaticCache of the model's config, the prefill's
    # cache_position the prompt's slots
    from transformers.cache_utils import StaticCache

    if int(transformers.__version__.split(".")[0]) >= 5:
        cache = StaticCache(config=config, max_cache_len=MAX_LEN)
    else:
        cache = StaticCache(config=config, max_batch_size=2, max_cache_len=MAX_LEN, dtype=model.dtype)
    try:
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(input_ids.shape[1]))
    except RuntimeError as e:
        last_line = traceback.format_exception_only(type(e), e)[-1].strip()
        if "index_copy_" not in last_line:
            raise  # another error than this finding's
        print(f"BUG: the prefill into a StaticCache raised {last_line}")
        return 1
    print("OK: the prefill into a StaticCache ran")
    return 0''',
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - multi-query "
        "Falcon; here its prefill",
        "preallocate StaticCache's K/V heads as the model caches them (1 for multi-query Falcon: "
        "config.num_kv_heads, absent from num_key_value_heads), as transformers 4.56 does"),
}

# --- the Gaudi zoo's transformers findings (windows, hybrids, latents) ------------------------------------------

CACHED_TENSORS = TRANSFORMERS_CALLS[("falcon", "new-arch-gqa", "the cached tensors themselves hold")][1]
# each layer's window, read from the tiny config as the family entry reads it
HYBRID_WINDOWS = ("[config.sliding_window if kind == \"sliding_attention\" else None "
                  "for kind in config.layer_types]")
GPT_NEO_WINDOWS = "[config.window_size if kind == \"local\" else None for kind in config.attention_layers]"


def window_slice_operation() -> str:
    """5.x's DynamicSlidingWindowLayer: after each call, a local layer's cached K is a slice whose
    storage holds more positions than the slice (the ones it evicted)."""
    return '''\
    # generate's default cache in transformers 5.x: DynamicCache(config=...), a sliding-window layer per
    # local layer; the prefill, then greedy decode steps until every window has slid
    from transformers import DynamicCache

    # (4.x: generate's DynamicCache() has no sliding-window layer, generation/utils.py:2087)
    cache = DynamicCache(config=config) if int(transformers.__version__.split(".")[0]) >= 5 else DynamicCache()
    ids, mask = input_ids, attention_mask
    for step in range(5):
        with torch.no_grad():
            out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        for i, (key, value) in enumerate(cached_tensors(cache)):
            held = key.untyped_storage().nbytes()
            own = key.numel() * key.element_size()
            if held > own:
                call = "the prefill" if step == 0 else f"decode step {step}"
                print(f"BUG: after {call}, layer {i}'s cached key {tuple(key.shape)} is a slice of a {held}-byte "
                      f"storage: {held - own} bytes of evicted positions pinned (the value likewise)")
                return 1
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], 1)
    print("OK: every cached K/V owns its storage")
    return 0'''


def history_operation(windows: str, static: bool) -> str:
    """A local layer's cache holds more positions than its window needs."""
    if static:
        make = '''\
    # transformers 4.x's generate refuses cache_implementation="static" where the class cannot compile
    # its full graph (4.55.4 generation/utils.py:2046): no user reaches a StaticCache there
    if int(transformers.__version__.split(".")[0]) < 5 and not getattr(type(model), "_can_compile_fullgraph", False):
        print("OK: this transformers' generate refuses a StaticCache for the model: the path does not exist here")
        return 0
    # generate(cache_implementation="static"): a StaticCache of the model's config
    from transformers import StaticCache

    if int(transformers.__version__.split(".")[0]) >= 5:
        cache = StaticCache(config=config, max_cache_len=MAX_LEN)
    else:
        cache = StaticCache(config=config, max_batch_size=2, max_cache_len=MAX_LEN, dtype=model.dtype)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(input_ids.shape[1]))
'''
        need = "min(MAX_LEN, window)"
    else:  # the prefill and greedy decode steps, as generate's default cache holds them after each
        return f'''\
    windows = {windows}
    ids, mask, cache = input_ids, attention_mask, None
    for step in range(5):
        with torch.no_grad():
            out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        for i, (key, value) in enumerate(cached_tensors(cache)):
            window = windows[i]
            if window is not None and key.shape[-2] > min(mask.shape[1], window - 1):
                call = "the prefill" if step == 0 else f"decode step {{step}}"
                print(f"BUG: after {{call}} layer {{i}} attends to a window of {{window}} positions but caches "
                      f"{{key.shape[-2]}} (key {{tuple(key.shape)}}): the cache keeps more than the window needs")
                return 1
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], 1)
    print("OK: each local layer caches no more than its window needs")
    return 0'''
    return make + f'''\
    windows = {windows}
    for i, (key, value) in enumerate(cached_tensors(out.past_key_values)):
        window = windows[i]
        if window is not None and key.shape[-2] > {need}:
            print(f"BUG: layer {{i}} attends to a window of {{window}} positions but caches {{key.shape[-2]}} "
                  f"(key {{tuple(key.shape)}}): the cache keeps more than the window needs")
            return 1
    print("OK: each local layer caches no more than its window needs")
    return 0'''


def static_prefill_logits_operation() -> str:
    return '''\
    # transformers 4.x's generate refuses cache_implementation="static" where the class cannot compile
    # its full graph (4.55.4 generation/utils.py:2046): no user reaches a StaticCache there
    if int(transformers.__version__.split(".")[0]) < 5 and not getattr(type(model), "_can_compile_fullgraph", False):
        print("OK: this transformers' generate refuses a StaticCache for the model: the path does not exist here")
        return 0
    # generate(cache_implementation="static"): a StaticCache of the model's config, the prefill
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=MAX_LEN)
    with torch.no_grad():
        cached = model(input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True).logits
        plain = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    error = (cached - plain)[attention_mask.bool()].abs().max().item()
    print(f"prefill logits into a StaticCache of {MAX_LEN} vs the uncached forward: max |diff| {error:.3e}")
    if error > 1e-4:
        print("BUG: the prefill's logits depend on the cache's length")
        return 1
    print("OK: the same logits")
    return 0'''


def expanded_latent_operation(check_view: bool) -> str:
    if check_view:
        judge = '''\
    for i, (key, value) in enumerate(cached_tensors(out.past_key_values)):
        held, own = value.untyped_storage().nbytes(), value.numel() * value.element_size()
        if held > own:
            print(f"BUG: layer {i}'s cached value {tuple(value.shape)} is a view of a {held}-byte buffer "
                  f"(kv_b_proj's output): {held - own} bytes pinned beyond it")
            return 1
    print("OK: every cached value owns its storage")
    return 0'''
    else:
        judge = '''\
    size = torch.empty((), dtype=model.dtype).element_size()
    latent = config.num_hidden_layers * input_ids.numel() * (config.kv_lora_rank + config.qk_rope_head_dim) * size
    cached = sum(t.numel() * t.element_size() for layer in cached_tensors(out.past_key_values) for t in layer)
    print(f"cached: {cached} bytes; the latent (kv_lora_rank + qk_rope_head_dim per token and layer): {latent} bytes")
    if cached > latent:
        print(f"BUG: the cache holds the expanded K and V, {cached / latent:.1f} times the latent")
        return 1
    print("OK: the cache holds the latent")
    return 0'''
    return '''\
    # the prefill forward of generate, with its default cache
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, use_cache=True)
''' + judge


def static_index_copy_operation() -> str:
    return TRANSFORMERS_CALLS[("falcon", "rotary-mqa", "index_copy_")][2]


WINDOW_FIX = ("keep the window's positions as a tensor of their own (`.clone()` the slice, or a preallocated ring "
              "buffer written in place), so the concatenation's evicted positions are freed")
for _family, _variant in (("gemma2", "hybrid-window4"), ("gemma3", "hybrid-window9"), ("gpt_oss", "hybrid-window7")):
    TRANSFORMERS_CALLS[(_family, _variant, "is a view of a buffer that is no fused")] = (
        "window-slice-pins-evicted", CACHED_TENSORS, window_slice_operation(),
        "model.generate(input_ids, attention_mask=attention_mask) - transformers 5.x's default DynamicCache; here "
        "the prefill and greedy decode steps", WINDOW_FIX)
    TRANSFORMERS_CALLS[(_family, _variant, "stored_windows")] = (
        "local-layers-cache-whole-history", CACHED_TENSORS, history_operation(HYBRID_WINDOWS, static=False),
        "model.generate(input_ids, attention_mask=attention_mask) - the default cache (4.55: DynamicCache() "
        "without the config); here its prefill",
        "make generate's default cache from the model's config (a sliding-window layer per local layer), as "
        "transformers 5.x does")
TRANSFORMERS_CALLS[("gpt_neo", "global-local4", "stored_windows")] = (
    "local-layers-cache-whole-history", CACHED_TENSORS, history_operation(GPT_NEO_WINDOWS, static=False),
    "model.generate(input_ids, attention_mask=attention_mask) - the default cache; here its prefill",
    "give GPTNeoConfig layer_types (sliding_attention for its local layers) so the cache keeps a window there")
TRANSFORMERS_CALLS[("gpt_neo", "global-local4", "stored_windows:static")] = (
    "static-local-layers-full-length", CACHED_TENSORS, history_operation(GPT_NEO_WINDOWS, static=True),
    "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its prefill",
    "preallocate window_size slots for the local layers (StaticSlidingWindowLayer), from layer_types")
for _text, _seen in (("family-P1 prefill", "p1"), ("family-P2 prefill", "p2"), ("family-ops beam prefill", "ops")):
    TRANSFORMERS_CALLS[("gpt_neo", "global-local4", _text)] = (
        f"static-cache-mask-from-key-length-{_seen}", "", static_prefill_logits_operation(),
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its "
        "prefill",
        "take the causal/local mask rows from the queries' positions (cache_position), not from the key length "
        "(modeling_gpt_neo.py:116)")
for _family in ("deepseek_v2", "deepseek_v3"):
    TRANSFORMERS_CALLS[(_family, "mla", "is a view of a buffer that is no fused")] = (
        "value-view-of-kv-b-proj", CACHED_TENSORS, expanded_latent_operation(check_view=True),
        "model.generate(input_ids, attention_mask=attention_mask) - the default DynamicCache; here its prefill",
        "cache the latent (as transformers 5.x does), or at least copy V out of kv_b_proj's output")
    TRANSFORMERS_CALLS[(_family, "mla", "stored_width")] = (
        "caches-expanded-kv-not-latent", CACHED_TENSORS, expanded_latent_operation(check_view=False),
        "model.generate(input_ids, attention_mask=attention_mask) - the default DynamicCache; here its prefill",
        "cache the compressed latent and the rope key part and expand them with kv_b_proj after the cache "
        "update, as transformers 5.x does")
    TRANSFORMERS_CALLS[(_family, "mla", "index_copy_")] = (
        "static-cache-prefill-index-copy", "", static_index_copy_operation(),
        "model.generate(input_ids, attention_mask=attention_mask, cache_implementation=\"static\") - here its "
        "prefill",
        "preallocate StaticCache's K (qk_nope + qk_rope) and V (v_head_dim) as the model caches them, or the "
        "latent")


TRANSFORMERS_TITLES = {"kv-cache-all-heads": "the prefill caches K/V for every query head, not num_kv_heads",
                      "window-slice-pins-evicted": "a sliding-window layer's cached K/V are slices that pin the "
                                                   "positions they evicted",
                      "local-layers-cache-whole-history": "the local (sliding-window) layers cache the whole history",
                      "static-local-layers-full-length": "the StaticCache preallocates the local layers to the cache "
                                                         "length, not the window",
                      "value-view-of-kv-b-proj": "the cached V is a view of kv_b_proj's output, pinning its K part",
                      "caches-expanded-kv-not-latent": "the cache holds the expanded K and V, not the latent",
                      "static-cache-prefill-index-copy": "the prefill into a StaticCache raises in index_copy_",
                      **{f"static-cache-mask-from-key-length-{seen}": "with a StaticCache the prefill's logits are "
                         f"wrong: the attention mask is taken from the key length (seen by {check})" for seen, check in (("p1", "family-P1"), ("p2", "family-P2"), ("ops", "family-ops"))}}


def transformers_call(entries: list[dict]):
    entry = entries[0]
    if implementation(entry) != "transformers":
        return None
    # a text "<pattern text>:static" covers only the finding on the static path (gpt_neo's stored
    # windows: the static one preallocates, the concat one keeps the history)
    found = [(text, value) for (family, variant, text), value in TRANSFORMERS_CALLS.items()
             if (entry["family"], entry["variant"]) == (family, variant) and text.split(":")[0] in entry["pattern"]]
    if entry.get("path") == "static" and any(text.endswith(":static") for text, _ in found):
        found = [(text, value) for text, value in found if text.endswith(":static")]
    else:
        found = [(text, value) for text, value in found if not text.endswith(":static")]
    found = [value for _, value in found]
    return found[0] if found else None


def transformers_repro(entries: list[dict]) -> Repro:
    """A transformers finding a prefill shows, other than the view findings (`TRANSFORMERS_CALLS`)."""
    entry = entries[0]
    family, variant = entry["family"], entry["variant"]
    short, functions, operation, call, fix = transformers_call(entries)
    config_class, _ = class_names(family)
    # the pattern's own words, where it is plain text (a regular expression is no title)
    shown = TRANSFORMERS_TITLES.get(short, what(entry).replace("`", ""))
    title = f"transformers {family}/{variant}: {shown}"
    script = template("transformers_call.py.tmpl").substitute(
        title=title, summary=textwrap.fill(entry["reason"], 96), upstream=entry["upstream"], when=versions(entry),
        config_class=config_class, family=family, variant=variant,
        config=config_literal(tiny_config(family, variant)), functions=functions, operation=operation)
    return Repro(slug_of(entries), title, script, readme_text(entries, title, call, fix), tuple(entries))


def expected_error(entry: dict) -> str:
    """The finding's pattern from the exception's type on: the last line of the error."""
    return re.sub(r"^.*?raised ", "", entry["pattern"])


def port_repro(entries: list[dict]) -> Repro:
    """An optimum-habana finding its port's prefill forward or beam-search reorder raises."""

    entry = entries[0]
    family, variant = entry["family"], entry["variant"]
    operation, _ = port_operation(entries)
    port = FAMILIES[family].gaudi
    config_class, _ = class_names(family)
    expected = expected_error(entry)
    what_fails = {"forward": "the prefill forward",
                  "reorder": "the beam-search cache reorder after the prefill"}[operation]
    title = f"optimum-habana {family}/{variant}: {what_fails} raises {expected.replace(chr(92), '')}"
    patches = "\n".join(f"    hf.{name}{'.' + attribute if attribute else ''} = port.{value}"
                        for name, attribute, value in PORT_PATCHES[family])
    script = template("port.py.tmpl").substitute(
        title=title, summary=textwrap.fill(entry["reason"], 96), upstream=entry["upstream"], when=versions(entry),
        family=family, variant=variant, config_class=config_class, hf_module=port.hf_module,
        port_module=port.module, causal_lm=port.causal_lm, expected=repr(expected),
        config=config_literal(tiny_config(family, variant)), forward_kwargs=repr(dict(port.forward_kwargs)),
        generation_config=repr(dict(port.generation)), patches=patches,
        load_module=LOAD_WITH_STANDIN if port.standin else LOAD_PLAIN,
        operation=PORT_OPERATIONS[operation], what_fails=what_fails,
        generation_function=GENERATION_FUNCTION if operation == "reorder" else "")
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
    return Repro(slug_of(entries), title, script, readme, tuple(entries))


def program_repro(entries: list[dict]) -> Repro:
    """An optimum-habana finding a short program of generate's calls raises (`crash_program`) or
    leaves in its cache or logits (`observed_program`)."""

    entry = entries[0]
    family, variant = entry["family"], entry["variant"]
    program = program_of(entries)
    port = FAMILIES[family].gaudi
    config_class, _ = class_names(family)
    what_fails = PROGRAM_CALLS[program.call]
    where = {"concat": "static shapes off", "static": "static shapes (token_idx)",
             "static+reuse": "static shapes and reuse_cache"}[program.path]
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
                        for name, attribute, value in PORT_PATCHES[family])
    script = template("port_program.py.tmpl").substitute(
        title=title, summary=textwrap.fill(entry["reason"], 96), upstream=entry["upstream"], when=versions(entry),
        family=family, variant=variant, config_class=config_class, hf_module=port.hf_module,
        port_module=port.module, causal_lm=port.causal_lm, expected=repr(program.expected),
        config=config_literal(tiny_config(family, variant)), forward_kwargs=repr(dict(port.forward_kwargs)),
        generation_config=repr(dict(port.generation)), patches=patches,
        load_module=LOAD_WITH_STANDIN if port.standin else LOAD_PLAIN, what_fails=what_fails,
        program=repr(PROGRAMS[program.call]), paths=repr(program.paths), observe=repr(list(program.observe)),
        fused=FAMILIES[family].fused, generation_function=GENERATION_FUNCTION)
    options = {"concat": "static_shapes=False", "static": "static_shapes=True (the default on Gaudi)",
               "static+reuse": "static_shapes=True, reuse_cache=True"}[program.path]
    calls = {"prefill": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its prefill",
             "decode": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its first decode "
                       "step",
             "(prefill|decode)": f"model.generate(input_ids, attention_mask=attention_mask, {options}) - here its "
                                 "prefill and first decode step",
             "extend": "model.generate(new_ids, attention_mask=mask, past_key_values=<an earlier generate's cache>, "
                       f"{options}) - a cached call of k > 1 tokens; here a prefill, 2 greedy steps, then 3 tokens "
                       "in one call",
             "reorder": f"model.generate(input_ids, attention_mask=attention_mask, num_beams=2, {options}) - here "
                        "its first reorder"}
    readme = readme_text(entries, title, calls[program.call], program.fix)
    return Repro(slug_of(entries), title, script, readme, tuple(entries))


def readme_text(entries: list[dict], title: str, call: str, fix: str) -> str:
    """A repro folder's README: how to run it, what reaches it, where upstream, what it costs."""

    entry = entries[0]
    lines = [f"# {title}", "", "```", "python repro.py", "```", "",
             "Exit status 1: the bug is there; 0: it is not; 2: the experiment could not run (a module missing, "
             "another error).", "",
             f"- **Reached by**: {user_path.cell(entries)}",
             f"- **What the script runs**: `{call.split(' - ')[0]}`" + (f" ({call.split(' - ', 1)[1]})" if " - " in call
                                                                       else ""),
             f"- **Upstream**: {entry['upstream']}",
             f"- **Holds in**: {versions(entry)}",
             f"- **Cost**: {cost_text(entry)}",
             f"- **Why**: {entry['reason']}",
             f"- **Suggested fix**: {fix}.",
             f"- **Seen by mpt-kv's checks**: {checks_seen(entries)} ({implementation(entry)}/{entry['family']}/"
             f"{entry['variant']})"]
    return "\n".join(lines) + "\n"


def cost_text(entry: dict) -> str:
    """What the finding pins at a real config, as the findings table computes it."""
    import torch

    from mpt_kv.families.costs import finding_cost

    cost = finding_cost(entry, POINTS, getattr(torch, DTYPE_NAME))
    if cost.pinned is None:
        return cost.why_none
    parts = []
    for batch, tokens in POINTS:
        n = cost.pinned[(batch, tokens)]
        if n is None:
            continue
        length = tokens if tokens is not None else cost.config.context()
        parts.append(f"{human(n)} pinned after a prefill of batch {batch} x {length} tokens")
    return (f"at {cost.config.checkpoint} ({DTYPE_NAME}): " + "; ".join(parts)
            + f" (the K/V cache itself at batch {POINTS[0][0]} x {POINTS[0][1]}: {human(cost.kv[POINTS[0]])})")


def port_operation(entries: list[dict]) -> tuple[str, str] | None:
    """(operation, short name) of an optimum-habana finding a port template covers, else None."""
    entry = entries[0]
    if implementation(entry) != "optimum-habana" or entry["family"] not in PORT_PATCHES:
        return None
    for (family, variant, text), short in FORWARD_CRASHES.items():
        if (entry["family"], entry["variant"]) == (family, variant) and text in entry["pattern"]:
            return "forward", short
    if REORDER_CRASH in entry["pattern"].replace("\\", "") and any(e.get("path") in (None, "concat") for e in entries):
        return "reorder", "beam-reorder-no-reorder-cache"
    return None


def slug_of(entries: list[dict]) -> str | None:
    """The folder name of the finding's repro; None where no template covers it."""
    entry = entries[0]
    if is_transformers_view(entry):
        return slug(entry, "kv-views")
    if transformers_call(entries):
        return slug(entry, transformers_call(entries)[0])
    covered = port_operation(entries)
    if covered:
        return slug(entry, covered[1])
    program = program_of(entries)
    return slug(entry, program.short) if program else None


def program_of(entries: list[dict]) -> Program | None:
    """The program of an optimum-habana finding port_program.py.tmpl covers: a crash or an observation."""
    return crash_program(entries) or observed_program(entries)


def plan(groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """(the repros, the findings without one), in the file's order."""
    repros, missing = [], []
    for entries in groups:
        if slug_of(entries) is None:
            missing.append(entries)
        elif is_transformers_view(entries[0]):
            repros.append(view_repro(entries))
        elif transformers_call(entries):
            repros.append(transformers_repro(entries))
        elif port_operation(entries):
            repros.append(port_repro(entries))
        else:
            repros.append(program_repro(entries))
    return repros, missing


def describe(entries: list[dict]) -> str:
    """One line naming a finding, for the list of findings without a repro."""

    entry = entries[0]
    if "target" in entry:  # an MPT target's entry
        return f"MPT target {entry['target']} {entry['property']} ({versions(entry)}): {entry['reason'][:160]}"
    return (f"{implementation(entry)} {entry['family']}/{entry['variant']} ({versions(entry)}): "
            f"{what(entry)} [{entry['upstream']}]")


def index_text(repros: list[Repro], missing: list[list[dict]], shared: dict | None = None) -> str:
    """DIR/README.md: every repro folder, and every finding without a repro (the gap, visible)."""

    lines = ["# Standalone reproductions of mpt-kv's family findings", "",
             "Each folder's `repro.py` needs only torch and transformers (and, for an optimum-habana finding, "
             "optimum-habana installed): `python repro.py` exits 1 where the bug is there, 0 where it is not, "
             "2 where it could not run its experiment. Its README.md says what reaches it, where upstream, what "
             "it costs and a suggested fix.", "",
             "| folder | finding | holds in |", "|---|---|---|"]
    # every range its entries give (a kept MPT target repro serves checks that see it in different ones)
    lines += [f"| [{r.slug}]({r.slug}/README.md) | {r.title} | "
              f"{'; '.join(dict.fromkeys(versions(e) for e in r.entries))} |" for r in repros]
    if shared:
        lines += ["", "MPT target findings whose repro is a family finding's (the same bug):", ""]
        lines += [f"- {', '.join(dict.fromkeys(e['target'] + ' ' + e['property'] for e in entries))}: "
                  f"[{slug}]({slug}/README.md)" for slug, entries in shared.items()]
    lines += ["", f"## Findings without a standalone repro ({len(missing)})", ""]
    lines += [f"- no standalone repro yet: {describe(entries)}".replace("|", "\\|") for entries in missing]
    return "\n".join(lines) + "\n"


# --- the MPT targets' findings (mpt_kv/targets/known_failures.json) ----------------------------------
# Each entry names its repro ("repro"): a script written once and kept in mpt_kv/targets/repros/
# (<slug>.py: standalone as the generated ones; its docstring's first line is its title, and its
# CALL and FIX say what reaches it and the suggested fix, for its README), or the folder of a family
# finding that is the same bug (the family checks see it in MPT too).


def target_entries() -> list[dict]:
    """The MPT targets' known failures, as raw entries (every key kept)."""
    import json

    return json.loads(package_data.MPT_KNOWN_FAILURES.read_text(encoding="utf-8"))


# A kept script's line "# mpt-kv: NAME.part" is replaced by mpt_kv/targets/repros/NAME.part (its
# leading comment, which says what it needs, left out): code several kept scripts share, written once
PART = re.compile(r"^# mpt-kv: ([\w-]+\.part)\n", re.M)


def target_script(slug: str) -> str | None:
    """The text of mpt_kv/targets/repros/<slug>.py with its parts filled in, None where there is none."""
    folder = package_data.KEPT_REPROS
    path = folder / f"{slug}.py"
    if not path.is_file():
        return None

    def part(found: re.Match) -> str:
        text = (folder / found.group(1)).read_text(encoding="utf-8")
        return re.sub(r"\A(#[^\n]*\n)+\n*", "", text)

    return PART.sub(part, path.read_text(encoding="utf-8"))


def script_constants(script: str) -> dict:
    """A kept script's docstring ("doc") and its string constants (CALL, FIX), read without running it."""
    import ast

    tree = ast.parse(script)
    found = {"doc": ast.get_docstring(tree) or ""}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and \
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found[node.targets[0].id] = node.value.value
    return found


def target_readme(entries: list[dict], title: str, call: str, fix: str) -> str:
    """A kept MPT target repro's README, from its entries (one per check that sees the finding)."""
    lines = [f"# {title}", "", "```", "python repro.py", "```", "",
             "Exit status 1: the bug is there; 0: it is not; 2: the experiment could not run (a module missing, "
             "another error).", "",
             f"- **Reached by**: {call}",
             "- **Holds in**: " + "; ".join(dict.fromkeys(versions(e) for e in entries)),
             f"- **Suggested fix**: {fix}",
             "- **Seen by mpt-kv's checks**: " + ", ".join(dict.fromkeys(
                 f"{e['property']}" + (f" ({e['path']})" if e.get("path") else "") for e in entries))
             + f" (MPT target {implementation(entries[0])})", ""]
    lines += [f"- **Why** ({e['property']}, {versions(e)}): {e['reason']}" for e in
              {e["reason"]: e for e in entries}.values()]
    return "\n".join(lines) + "\n"


def repro_names() -> frozenset[str]:
    """The name of every repro `write` makes: the kept MPT target scripts and the family findings'
    folders (what a known-failures entry's "repro" may name)."""
    global _NAMES
    if _NAMES is None:
        from mpt_kv.families.costs import known_entries
        from mpt_kv.families.findings import grouped

        kept = {p.stem for p in package_data.KEPT_REPROS.glob("*.py")}
        _NAMES = frozenset(kept | {s for s in (slug_of(g) for g in grouped(known_entries())) if s})
    return _NAMES


_NAMES: frozenset[str] | None = None


def target_plan(entries: list[dict]) -> tuple[list[Repro], list[dict], dict[str, list[dict]]]:
    """(the kept MPT target repros, the entries without a repro, {family repro slug: the entries
    that name it}), in the file's order."""
    by_slug: dict[str, list[dict]] = {}
    missing = []
    for entry in entries:
        if "repro" in entry:
            by_slug.setdefault(entry["repro"], []).append(entry)
        else:
            missing.append(entry)
    kept, shared = [], {}
    for name, named in by_slug.items():
        script = target_script(name)
        if script is None:
            shared[name] = named
            continue
        constants = script_constants(script)
        title = constants["doc"].splitlines()[0].removeprefix("Standalone reproduction: ").rstrip(".")
        kept.append(Repro(name, title, script, target_readme(named, title, constants["CALL"], constants["FIX"]),
                          tuple(named)))
    return kept, missing, shared


def write(directory, groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """Write one folder per covered finding under `directory` (repro.py, README.md), the family
    findings' and the MPT targets' kept ones, and the index directory/README.md; (the repros, the
    findings without one)."""
    from pathlib import Path

    repros, missing = plan(groups)
    kept, target_missing, shared = target_plan(target_entries())
    repros += kept
    missing += [[entry] for entry in target_missing]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for r in repros:
        folder = root / r.slug
        folder.mkdir(exist_ok=True)
        (folder / "repro.py").write_text(r.script, encoding="utf-8")
        (folder / "README.md").write_text(r.readme, encoding="utf-8")
    (root / "README.md").write_text(index_text(repros, missing, shared), encoding="utf-8")
    return repros, missing
