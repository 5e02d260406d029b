"""optimum-habana's text-generation recipes: the command lines its README and its own CI run each model
family with, as data that the optimum-habana implementations read (docs/families.md, "Recipes").

    RECIPES["flash-bucket"].flags          ('--trim_logits', '--attn_softmax_bf16', '--bucket_size 128', ...)
    RECIPES["flash-bucket"].model_kwargs   what optimum-habana's generate turns them into
    recipes_of("llama")                    the recipes documented for that family

One `Recipe` is one command line of `examples/text-generation/run_generation.py` (the flags that reach the
model; every recipe also runs `--use_hpu_graphs --use_kv_cache --bf16` with `PT_HPU_LAZY_MODE=1`), with
where optimum-habana documents it (file:line at the repository's v1.21-release branch, commit 812fe660d,
whose optimum/habana/transformers tree is the 1.21.2 wheel's). What each flag becomes is read off
optimum-habana 1.21.2 (its generation/utils.py, GaudiGenerationMixin.generate and _sample):

    --reuse_cache         allocate_kv_cache(batch, max_len, prompt len) before the prefill (:1638-1642),
                          the prefill fed the prompt alone (the ports' prepare_inputs_for_generation slices
                          input_ids[:, :token_idx]), `reuse_cache=True` on every forward (:1611)
    --bucket_internal     with --bucket_size b: the prefill fed the prompt alone, the returned K/V padded to
                          the cache length in generate (`_pad_past_key_values`, :2953-2979, without
                          reuse_cache), then each decode passes `cache_idx`: the slot count rounded up to a
                          multiple of b (:2891-2900), which the attention slices its cache to
    --trim_logits         `trim_logits=True` (:1598): a forward of more than one token returns the logits of
                          token_idx - 1 (static) or of the last position (models/llama/modeling_llama.py:1477-1481)
    --attn_softmax_bf16   `attn_softmax_bf16=True` (:1601): the eager attention's softmax in bfloat16
    --use_flash_attention `use_flash_attention=True` (:1624): the attention calls FusedSDPA; run_generation.py
                          :498-503 turns `flash_attention_fast_softmax` on with it unless given
    --flash_attention_recompute / _causal_mask: FusedSDPA's recompute mode, and its causal mask with
                          `valid_sequence_lengths` (each row's unpadded length, run_generation.py:827-832,
                          with --max_input_tokens) on the first token (:1625-1626, :1631-1632)
    --limit_hpu_graphs    the first token outside HPU graphs (:1605); off an HPU there are no graphs: it
                          reaches nothing here (recorded, never pretended)
    PT_HPU_LAZY_MODE=1    `lazy_mode=True` (run_generation.py:543-545, :867): htcore.mark_step() in the forward

Which flags reach a port is the port's own business: `forward_kwargs(takes)` keeps those its forward
names (its prepare_inputs_for_generation passes them on as keywords; a flag a port's forward does not name
is dropped there, as in optimum-habana). A recipe with `--bucket_size 128` is driven at the tiny sessions'
scale, `TINY_BUCKET` = 4 (16 positions: at 128 `cache_idx` would be the whole cache from the first step and
no bucket boundary would be crossed); the schedule is generate's, unchanged.

No torch here: the index of checks (mpt_kv/checks/index.py) reads the recipes' path labels.
"""

from __future__ import annotations

from dataclasses import dataclass

# where the recipes are documented: optimum-habana's repository at the v1.21-release branch
UPSTREAM = "huggingface/optimum-habana@812fe660d (v1.21-release)"
README = "examples/text-generation/README.md"
CI = "tests/test_text_generation_example.py"
TINY_BUCKET = 4  # --bucket_size at the tiny sessions' scale (module doc); the same as mpt_kv.checks.index.BUCKET
SEPARATOR = "@"  # a recipe's path label: "<base path>@<recipe>", "static+reuse@flash-reuse"


@dataclass(frozen=True)
class Recipe:
    """One command line of optimum-habana's text-generation recipes (module doc).

    name: the recipe's name in path labels and reports; families: "<family>/<variant>" of the families whose
    README or CI rows run it, each with the tiny variant of the documented models' attention layout (the
    variant its cells run on: docs/cost.md); sources: where optimum-habana documents it, file:line (README, CI test) at `UPSTREAM`; the flags,
    each as generate reads it; note: what it does not reach here, in a line."""

    name: str
    families: tuple[str, ...]
    sources: tuple[str, ...]
    reuse_cache: bool = False
    bucket_size: int = -1
    bucket_internal: bool = False
    trim_logits: bool = False
    attn_softmax_bf16: bool = False
    use_flash_attention: bool = False
    flash_attention_recompute: bool = False
    flash_attention_causal_mask: bool = False
    limit_hpu_graphs: bool = False
    note: str = ""

    def __post_init__(self):
        if self.bucket_internal and self.bucket_size <= 0:
            raise ValueError(f"recipe {self.name}: --bucket_internal needs --bucket_size > 0 (generation/utils.py:1417)")
        if (self.flash_attention_recompute or self.flash_attention_causal_mask) and not self.use_flash_attention:
            raise ValueError(f"recipe {self.name}: the flash attention modes need --use_flash_attention")
        if SEPARATOR in self.name or "/" in self.name:
            raise ValueError(f"recipe {self.name!r}: a name without {SEPARATOR!r} or '/'")

    @property
    def flags(self) -> tuple[str, ...]:
        """The command line's flags that reach the model, as run_generation.py takes them."""
        out = []
        for name in ("reuse_cache", "trim_logits", "attn_softmax_bf16", "limit_hpu_graphs"):
            if getattr(self, name):
                out.append(f"--{name}")
        if self.bucket_size > 0:
            out.append(f"--bucket_size {self.bucket_size}")
        if self.bucket_internal:
            out.append("--bucket_internal")
        for name in ("use_flash_attention", "flash_attention_recompute", "flash_attention_causal_mask"):
            if getattr(self, name):
                out.append(f"--{name}")
        return tuple(out)

    def describe(self) -> str:
        return " ".join(self.flags)

    @property
    def base_path(self) -> str:
        """The family path it drives: static shapes, with reuse_cache where it has it."""
        return "static+reuse" if self.reuse_cache else "static"

    @property
    def path(self) -> str:
        """Its cells' path label: "<base path>@<name>"."""
        return f"{self.base_path}{SEPARATOR}{self.name}"

    @property
    def fast_softmax(self) -> bool:
        """run_generation.py:498-503: --use_flash_attention turns flash_attention_fast_softmax on unless given."""
        return self.use_flash_attention

    @property
    def bucket(self) -> int | None:
        """The bucket the tiny sessions drive (`TINY_BUCKET`), None without --bucket_internal."""
        return TINY_BUCKET if self.bucket_internal else None

    @property
    def pads_returned_cache(self) -> bool:
        """generate pads the prefill's returned K/V to the cache length (bucket_internal without
        reuse_cache: generation/utils.py:2953-2979 `_pad_past_key_values`)."""
        return self.bucket_internal and not self.reuse_cache

    @property
    def prefill_prompt_only(self) -> bool:
        """The prefill is fed the prompt alone, not padded to the cache length (reuse_cache or
        bucket_internal: the ports' prepare_inputs_for_generation, models/llama/modeling_llama.py:1544-1548)."""
        return self.reuse_cache or self.bucket_internal

    def model_kwargs(self) -> dict:
        """What generate puts into model_kwargs for these flags (generation/utils.py:1597-1632,
        run_generation.py:543), before a port's prepare_inputs_for_generation picks its own."""
        return {"lazy_mode": True, "trim_logits": self.trim_logits, "attn_softmax_bf16": self.attn_softmax_bf16,
                "limit_hpu_graphs": self.limit_hpu_graphs, "reuse_cache": self.reuse_cache,
                "bucket_internal": self.bucket_internal, "use_flash_attention": self.use_flash_attention,
                "flash_attention_recompute": self.flash_attention_recompute,
                "flash_attention_causal_mask": self.flash_attention_causal_mask,
                "flash_attention_fast_softmax": self.fast_softmax}

    def forward_kwargs(self, takes) -> dict:
        """The model_kwargs a port's forward names (`takes(name)`), as its prepare_inputs_for_generation
        passes them; reuse_cache and cache_idx are the session's (they change the protocol, not only a
        keyword)."""
        return {k: v for k, v in self.model_kwargs().items()
                if k not in ("reuse_cache", "bucket_internal", "limit_hpu_graphs") and takes(k)}

    def dropped(self, takes) -> list[str]:
        """The recipe's flags whose keyword the port's forward does not name (nothing reaches it there)."""
        named = {"trim_logits", "attn_softmax_bf16", "use_flash_attention", "flash_attention_recompute",
                 "flash_attention_causal_mask"}
        return [f"--{k}" for k in sorted(named) if getattr(self, k) and not takes(k)] + (
            ["--bucket_internal"] if self.bucket_internal and not takes("cache_idx") else []) + (
            ["--reuse_cache"] if self.reuse_cache and not takes("reuse_cache") else [])

    def cache_idx(self, token_idx: int, kv_cache_len: int) -> int | None:
        """generate's cache_idx for the forward at 1-based `token_idx` after the prefill
        (generation/utils.py:2891-2900: `token_idx_cpu` is the next token's, incremented after each
        forward), at the tiny bucket; None without bucket_internal."""
        if self.bucket is None:
            return None
        if token_idx <= (kv_cache_len // self.bucket) * self.bucket:
            return ((token_idx - 1) // self.bucket + 1) * self.bucket
        return kv_cache_len


def _sources(*where: str) -> tuple[str, ...]:
    return tuple(where)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("reuse-trim-softmax", ("llama/gqa",), _sources(
        f"{CI}:241-242 (llama: --trim_logits --attn_softmax_bf16)",
        f"{CI}:270-271 (--reuse_cache where the row says so: Llama-2-7b :30-31, Meta-Llama-3-8B :39-40, "
        "CodeLlama-34b :46-47)"),
        reuse_cache=True, trim_logits=True, attn_softmax_bf16=True),
    Recipe("flash-bucket", ("llama/gqa",), _sources(
        f"{README}:753-779 (Using Habana Flash Attention, Llama-2-70b)",
        f"{README}:622-648 (the same without the causal mask)", f"{CI}:309-318 (fp8 Llama-2)"),
        bucket_size=128, bucket_internal=True, trim_logits=True, attn_softmax_bf16=True, use_flash_attention=True,
        flash_attention_recompute=True, flash_attention_causal_mask=True, limit_hpu_graphs=True),
    Recipe("flash-reuse", ("llama/gqa", "falcon/new-arch-gqa"), _sources(
        f"{README}:494-510 (Llama-3.1-405B)", f"{README}:453-469 (Falcon-180B)"),
        reuse_cache=True, trim_logits=True, use_flash_attention=True, flash_attention_recompute=True,
        flash_attention_causal_mask=True, limit_hpu_graphs=True),
    Recipe("falcon", ("falcon/new-arch-gqa",), _sources(
        f"{CI}:244-245 (falcon: --use_flash_attention --flash_attention_causal_mask)",
        f"{CI}:270-271 (--reuse_cache: falcon-40b :32)"),
        reuse_cache=True, use_flash_attention=True, flash_attention_causal_mask=True),
    Recipe("starcoder", ("gpt_bigcode/mqa",), _sources(
        f"{CI}:247-253 (starcoder: --use_flash_attention; \"starcoder doesn't support reuse_cache, but implements "
        "bucket_internal instead\": --bucket_size 128 --bucket_internal, bigcode/starcoder :33)"),
        bucket_size=128, bucket_internal=True, use_flash_attention=True),
    Recipe("starcoder2", ("starcoder2/gqa",), _sources(
        f"{CI}:244-245 and :255-256 (starcoder2: --use_flash_attention --flash_attention_causal_mask "
        "--flash_attention_recompute; bigcode/starcoder2-3b :48)"),
        use_flash_attention=True, flash_attention_recompute=True, flash_attention_causal_mask=True),
    Recipe("gemma", ("gemma/gqa", "gemma2/hybrid-window4", "gemma3/hybrid-window9"), _sources(
        f"{CI}:258-259 (gemma: --use_flash_attention; gemma-7b, gemma-2-9b, gemma-3-4b-it :51-56)"),
        use_flash_attention=True),
    Recipe("mistral-fp8", ("mistral/gqa",), _sources(
        f"{CI}:319-323 (fp8 Mistral: --use_flash_attention --flash_attention_recompute --attn_softmax_bf16 "
        "--trim_logits)", f"{CI}:105-108 (--reuse_cache: its fp8 rows)"),
        reuse_cache=True, trim_logits=True, attn_softmax_bf16=True, use_flash_attention=True,
        flash_attention_recompute=True),
    Recipe("reuse-bucket", ("mixtral/moe-2of4",), _sources(
        f"{README}:235-260 (Mixtral-8x7B on the mlcommons dataset)", f"{CI}:324-326 (fp8 Mixtral)"),
        reuse_cache=True, bucket_size=128, bucket_internal=True, limit_hpu_graphs=True),
    Recipe("beam-flash", ("qwen2/gqa",), _sources(
        f"{README}:328-349 (Using Beam Search: Qwen2-7b-Instruct, --num_beams 3)",
        f"{CI}:297-301, :148 and :627-630 (beam search: --reuse_cache, --bucket_internal)"),
        reuse_cache=True, bucket_size=128, bucket_internal=True, trim_logits=True, use_flash_attention=True,
        limit_hpu_graphs=True),
    Recipe("trim", ("deepseek_v3/mla",), _sources(
        f"{CI}:267-268 (moonlight-16b-a3b: --trim_logits)", f"{README}:182-193 (Moonlight-16B-A3B)"),
        trim_logits=True),
    Recipe("seed", ("mpt/alibi",), _sources(
        "optimum-habana pull request \"refine use cache for mpt model\" (the seed): run_generation.py --use_hpu_graphs "
        "--use_kv_cache --limit_hpu_graph --trim_logits --attn_softmax_bf16 --bf16"),
        trim_logits=True, attn_softmax_bf16=True, limit_hpu_graphs=True,
        note="MPT's prepare_inputs_for_generation passes none of its flags on (optimum-habana 1.21.2 "
             "models/mpt/modeling_mpt.py:334-400): its cells are the plain static path's"),
)}

# The recipes that run as a family matrix's cells: a recipe whose every flag a family's port drops
# (MPT's seed) would repeat the plain static path, so it has no cells of its own (`Recipe.note`).
MATRIX_RECIPES = tuple(r for r in RECIPES.values() if not r.note)
PATHS = tuple(r.path for r in MATRIX_RECIPES)  # the family matrix's recipe paths (index.FAMILY_PATHS has them)
# what else optimum-habana's CI runs these families with: --reuse_cache alone, which is the plain static+reuse path
REUSE_ONLY = {"mistral": f"{CI}:36", "qwen2_moe": f"{CI}:62", "baichuan": f"{CI}:77 (Baichuan2-7B)",
              "chatglm": f"{CI}:80-81", "phi": f"{CI}:114 (fp8 phi-2)"}


def recipes_of(family: str, variant: str | None = None) -> tuple[Recipe, ...]:
    """The matrix recipes documented for `family` (by its registry name), on `variant` where given (the
    variant each recipe's cells run on: `Recipe.families`)."""
    return tuple(r for r in MATRIX_RECIPES for f in r.families
                 if f.split("/")[0] == family and (variant is None or f == f"{family}/{variant}"))


def split(path: str) -> tuple[str, Recipe | None]:
    """A family path label -> (its base path, its recipe or None): "static+reuse@flash-reuse" ->
    ("static+reuse", RECIPES["flash-reuse"]). KeyError naming the recipes for an unknown one."""
    if SEPARATOR not in path:
        return path, None
    base, name = path.split(SEPARATOR, 1)
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r} in path {path!r}: recipes {sorted(RECIPES)}")
    return base, RECIPES[name]


def recipe_of(path: str) -> Recipe | None:
    return split(path)[1]


def describe_path(path: str) -> str:
    """A path label as the report names it: the recipe's flags after the label."""
    recipe = recipe_of(path)
    return path if recipe is None else f"{path} ({recipe.describe()})"
