"""optimum-habana's own `generate` (GaudiGenerationMixin), run on CPU: the generate drive's flavour for its
ports (`mpt_kv.checks.generate_driver`, docs/generate.md).

On a Gaudi machine `adapt_transformers_to_gaudi()` puts GaudiGenerationMixin's methods in place of
transformers' GenerationMixin's, and the Gaudi generation config (`GaudiGenerationConfig`: static_shapes,
ignore_eos, reuse_cache, bucket_size, ...) in place of transformers' GenerationConfig. Here, on CPU:

- `generation_module()`: `optimum/habana/transformers/generation/utils.py` itself, imported under bare parent
  packages (`optimum.habana`, `optimum.habana.transformers`: their `__init__` files check the Synapse version and
  import every model); the module and what it imports (`optimum.habana.utils`, its candidate generator,
  configuration and stopping criteria) need no HPU at import (measured on 1.21.2). Where habana_frameworks is
  installed it is imported normally.
- `gaudi_generation()`: the lines of the installed release's `adapt_transformers_to_gaudi` that write into
  `transformers.generation` and the GenerationConfig names (parsed from its own modeling_utils.py, as the model
  patches are: `mpt_kv.targets.gaudi.model_patches`), applied for the duration of one generate call and undone
  after, so transformers' own GenerationMixin stays untouched for the `transformers` target in the same process.
- `gaudi_generate(...)`: `model.generate(ids, generation_config=<a GaudiGenerationConfig>, lazy_mode=False,
  hpu_graphs=False)`: eager mode, no HPU graphs (the two HPU-only switches; lazy mode imports
  habana_frameworks.torch.core for mark_step, generation/utils.py:1727-1730), `static_shapes` on the static path
  (optimum-habana's default for the models of MODELS_OPTIMIZED_WITH_STATIC_SHAPES, MPT among them: the prompt
  padded to the max length, `token_idx` per step), off on the concat path.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys

import torch

from mpt_kv import recipes
from mpt_kv.errors import TargetUnavailable, Unsupported
from mpt_kv.targets import gaudi as gaudi_target

GENERATION = "optimum.habana.transformers.generation.utils"
# the names adapt_transformers_to_gaudi writes that generate reads (the pipelines' default configs are not)
WRITES = ("transformers.generation.", "transformers.GenerationConfig", "transformers.modeling_utils.GenerationConfig")


def generation_module():
    """optimum-habana's generation/utils.py (GaudiGenerationMixin), on HPU or CPU (module doc)."""
    if GENERATION in sys.modules:
        return sys.modules[GENERATION]
    root = gaudi_target.optimum_habana_root()
    if importlib.util.find_spec("habana_frameworks") is None:
        gaudi_target.register_bare_parents(root, GENERATION)
        sys.modules.pop("optimum.habana.transformers.generation", None)  # a real package: its own __init__ runs
    try:
        return importlib.import_module(GENERATION)
    except Exception as e:
        raise TargetUnavailable(f"{gaudi_target.release()}: {GENERATION} does not import here: {type(e).__name__}: "
                                f"{e}") from e


@functools.lru_cache(maxsize=None)
def generation_lines(path: str) -> tuple[tuple[str, str, ast.expr, int], ...]:
    """(owner, attribute, value expression, line) of each line of `adapt_transformers_to_gaudi` in the
    modeling_utils.py at `path` that writes a name of `WRITES`."""
    tree = ast.parse(open(path).read(), filename=path)
    adapt = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "adapt_transformers_to_gaudi"),
                 None)
    if adapt is None:
        raise TargetUnavailable(f"{gaudi_target.release()}: {path} defines no adapt_transformers_to_gaudi")
    out = []
    for node in ast.walk(adapt):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            dotted = ast.unparse(target)
            if dotted.startswith(WRITES):
                owner, attribute = dotted.rsplit(".", 1)
                out.append((owner, attribute, node.value, node.lineno))
    if not any(attribute == "generate" for _, attribute, _, _ in out):
        raise TargetUnavailable(f"{gaudi_target.release()}: adapt_transformers_to_gaudi ({path}) does not put its "
                                "generate in place of transformers' GenerationMixin.generate")
    return tuple(sorted(out, key=lambda line: line[3]))


def resolve(dotted: str):
    """The object a dotted name of transformers names (a module, or an attribute of one)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


@contextlib.contextmanager
def gaudi_generation():
    """GaudiGenerationMixin's methods and the Gaudi generation config in transformers' place, as the installed
    release's adapt_transformers_to_gaudi puts them, for the duration (module doc)."""
    module = generation_module()
    package = sys.modules["optimum.habana.transformers.generation"]
    namespace = {**vars(package), **vars(module), "staticmethod": staticmethod}
    source = gaudi_target.optimum_habana_root() / "transformers" / "modeling_utils.py"
    applied = []
    try:
        for owner_name, attribute, value, line in generation_lines(str(source)):
            try:
                owner = resolve(owner_name)
                new = eval(compile(ast.Expression(value), str(source), "eval"), namespace)  # noqa: S307  (the file's own line)
            except Exception as e:
                raise TargetUnavailable(f"{gaudi_target.release()}: modeling_utils.py:{line}: {owner_name}.{attribute} = "
                                        f"{ast.unparse(value)} cannot be applied here: {type(e).__name__}: {e}") from e
            missing = object()
            applied.append((owner, attribute, owner.__dict__.get(attribute, missing) if hasattr(owner, "__dict__")
                            else getattr(owner, attribute, missing), missing))
            setattr(owner, attribute, new)
        yield module
    finally:
        for owner, attribute, old, missing in reversed(applied):
            if old is missing:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, old)


def gaudi_generate(model, ids, mask, mode: str, path: str, new_tokens: int, draft=None, *, candidates: int,
                   num_beams: int, eos):
    """GaudiGenerationMixin.generate on CPU (module doc), greedy, with an end-of-sequence token no step reaches
    (`eos(model)`); the drive's beams and candidates (`mpt_kv.checks.generate_flavours`: it builds this flavour)."""

    module = generation_module()
    if mode == "chunked" and "prefill_chunk_size" not in inspect.getsource(module):
        raise Unsupported(f"{gaudi_target.release()}: GaudiGenerationMixin (its generation/utils.py) never reads "
                          "prefill_chunk_size: its generate runs the prefill whole, no chunked prefill to check")
    if mode == "multi-turn":
        raise Unsupported(f"{gaudi_target.release()}: GaudiGenerationMixin's multi-turn (a second generate continuing "
                          "the cache of the first) is not driven yet: its ports keep legacy tuple caches, sized on "
                          "the static path to one call's max length (docs/generate.md, \"Not yet\")")
    config = gaudi_config(module, model)
    base, recipe = recipes.split(path)
    config.update(max_new_tokens=new_tokens, do_sample=False, use_cache=True, num_beams=1, pad_token_id=0,
                  eos_token_id=eos(model), static_shapes=base != "concat", ignore_eos=False,
                  reuse_cache=base == "static+reuse", **recipe_settings(recipe, mask))
    kwargs = {}
    if mode == "beam":
        config.update(num_beams=num_beams, num_return_sequences=1, early_stopping=False, length_penalty=0.0)
    elif mode == "prompt-lookup":
        config.update(prompt_lookup_num_tokens=candidates)
    elif mode == "constrained":  # run_generation.py --num_beams --force_words
        from mpt_kv.checks.generate_flavours import FORCED

        config.update(num_beams=num_beams, num_return_sequences=1, early_stopping=False, length_penalty=0.0,
                      force_words_ids=[[FORCED % int(model.config.vocab_size)]])
    elif mode == "contrastive":  # run_generation.py --penalty_alpha --top_k
        from mpt_kv.checks.generate_flavours import PENALTY_ALPHA, TOP_K

        config.update(penalty_alpha=PENALTY_ALPHA, top_k=TOP_K)
    elif mode == "draft":
        draft.generation_config = gaudi_config(module, draft)  # as from_pretrained under adapt_transformers_to_gaudi
        draft.generation_config.num_assistant_tokens = candidates
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = draft
    # use_cache as a keyword (run_generation.py's --use_kv_cache): a config value equal to the global default
    # gives way to the model's own (MptConfig's use_cache is False)
    from mpt_kv.checks.generate_flavours import refusing  # what generate refuses by design: Unsupported

    return refusing(model, mode, path, lambda: model.generate(ids, attention_mask=mask, generation_config=config,
                                                              lazy_mode=False, hpu_graphs=False, use_cache=True,
                                                              **kwargs))


def recipe_settings(recipe, mask) -> dict:
    """The GaudiGenerationConfig settings of a text-generation recipe's flags (`mpt_kv.recipes`: what
    run_generation.py sets from its command line, generation/utils.py reads), at the tiny sessions' bucket
    (`recipes.TINY_BUCKET`); none for no recipe. `valid_sequence_lengths`: each row's unpadded prompt length,
    which run_generation.py passes with --flash_attention_causal_mask (:827-832)."""
    if recipe is None:
        return {}
    # the flags as generate puts them into model_kwargs (one map of them: Recipe.model_kwargs); reuse_cache is the
    # path's (static+reuse), lazy_mode no config setting (an HPU switch: gaudi_generate passes lazy_mode=False)
    settings = {k: v for k, v in recipe.model_kwargs().items() if k not in ("lazy_mode", "reuse_cache")}
    settings["bucket_size"] = recipes.TINY_BUCKET if recipe.bucket_size > 0 else -1
    if recipe.flash_attention_causal_mask and mask is not None:
        settings["valid_sequence_lengths"] = mask.sum(-1, dtype=torch.int32)
    return settings


def gaudi_config(module, model):
    """The model's generation config as a GaudiGenerationConfig (what a model loaded under
    adapt_transformers_to_gaudi has: transformers.modeling_utils.GenerationConfig is the Gaudi one there), its
    settings kept (the port's: `mpt_kv.families.gaudi.set_generation_settings`)."""
    current = model.generation_config
    if isinstance(current, module.GaudiGenerationConfig):
        return current
    config = module.GaudiGenerationConfig(**{k: v for k, v in current.to_dict().items() if not k.startswith("_")})
    for name, value in vars(current).items():  # settings a port's forward reads that to_dict() does not carry
        if not name.startswith("_") and not hasattr(config, name):
            setattr(config, name, value)
    return config


def gaudi_sequence(args, kwargs, prepared=None):
    """The sequence optimum-habana's generate holds for a call (its prepare_inputs_for_generation's input and
    output, `prepared`): with static shapes the ids and mask are padded to the max length and `token_idx`
    (1-based) says how far they are written: the prefix before it, once a cache exists; at the prefill too
    where the port is fed the prompt alone (reuse_cache or bucket_internal on a port that slices
    input_ids[:, :token_idx] then) or returns the logits of token_idx - 1 alone (trim_logits)."""
    ids, mask = (args[0] if args else kwargs.get("input_ids")), kwargs.get("attention_mask")
    token_idx = kwargs.get("token_idx")
    if token_idx is None or ids is None:
        return ids, mask
    fed = prepared.get("input_ids") if isinstance(prepared, dict) else None
    prefix_only = (kwargs.get("past_key_values") is not None or (fed is not None and fed.shape[1] < ids.shape[1])
                   or bool(isinstance(prepared, dict) and prepared.get("trim_logits")))
    if prefix_only:
        n = int(token_idx.reshape(-1)[0])
        ids = ids[:, :n]
        mask = None if mask is None else mask[:, :n]
    return ids, mask
