"""optimum-habana's own generation code for the cache operations, on CPU.

`optimum/habana/transformers/generation/utils.py` does not import without an HPU stack (it needs
`optimum.utils` and `optimum.habana.utils`, which import habana_frameworks), but the functions
the cache operations go through are plain torch and transformers code. `optimum_habana_function`
compiles one of them from the installed file's own source (its `def`, nothing rewritten) with
the names it uses, so a fork installed in optimum-habana's place is run as it is.

What optimum-habana 1.21.2 does (docs/operations.md cites the lines):
- beam search (`_beam_search`) reorders the cache after every step with
  `_temporary_reorder_cache(self, past_key_values, beam_idx)` unless `reuse_cache` is on (MPT
  may not turn it on: `_prepare_generation_config`'s reuse_cache assertion does not list mpt); for
  a tuple/list cache that calls `self._reorder_cache`, which GaudiMptForCausalLM does not define;
- assisted decoding (`_assisted_decoding`) crops with `outputs.past_key_values.crop(new_cur_len - 1)`,
  a `Cache` method: MPT's cache is a tuple of [key, value] lists.

Releases before 1.20 do it otherwise, and each release is driven by its own code (read from its
file, so the release sweep runs what each one runs): their `_beam_search` calls the model's
`self._temporary_reorder_cache(...)` (transformers' GenerationMixin method; 1.18.1
generation/utils.py:3368; 1.7.x the model's `_reorder_cache` directly) and their assisted decoding
crops with transformers' `_crop_past_key_values(self, outputs.past_key_values, new_cache_size)`
(1.18.1 :4088; 1.11.1 has no `_assisted_decoding` of its own: transformers' calls it), which
slices tuple caches.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from mpt_kv.errors import TargetUnavailable
from mpt_kv.versions import transformers_major

UTILS = Path("transformers") / "generation" / "utils.py"


def generation_utils_path() -> Path:
    """The installed optimum-habana's generation/utils.py (TargetUnavailable if not installed)."""
    spec = importlib.util.find_spec("optimum")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "habana" / UTILS
        if path.is_file():
            return path
    raise TargetUnavailable("optimum-habana is not installed: its generation functions cannot be loaded")


def installed_generation_source() -> str | None:
    """The text of the installed optimum-habana's generation/utils.py, None if not installed."""
    try:
        return generation_utils_path().read_text()
    except TargetUnavailable:
        return None


def has_module_function(source: str, name: str) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in ast.parse(source).body)


def optimum_habana_function(name: str):
    """The module-level function `name` of optimum-habana's generation/utils.py, compiled from its
    source with the names it reads from transformers (`DynamicCache`, `EncoderDecoderCache`,
    where the installed transformers has them: 4.40 has no EncoderDecoderCache). Cached by the
    file it is compiled from (path, mtime, size), not by the name alone: another release's file
    (an installed one, a test's) is compiled anew."""
    path = generation_utils_path()
    stat = path.stat()
    return _compiled_function(name, path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _compiled_function(name: str, path, mtime_ns: int, size: int):
    import torch
    import transformers.cache_utils as cache_utils

    tree = ast.parse(path.read_text(), filename=str(path))
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if not found:
        raise TargetUnavailable(f"{path} has no module-level function {name!r}")
    module = ast.Module(body=found, type_ignores=[])
    namespace = {"torch": torch, **{n: getattr(cache_utils, n) for n in ("DynamicCache", "EncoderDecoderCache")
                                    if hasattr(cache_utils, n)}}
    exec(compile(module, str(path), "exec"), namespace)  # line numbers are the file's own
    fn = namespace[name]
    fn.source = f"{path}:{found[0].lineno}"
    return fn


def optimum_habana_method(name: str, owner: str = "GaudiGenerationMixin"):
    """The method `name` of the class `owner` in optimum-habana's generation/utils.py, compiled from its
    source as a plain function `(self, ...)` (its line numbers the file's own), cached by the file as
    `optimum_habana_function` is: what generate itself runs, called with the model as `self`."""
    path = generation_utils_path()
    stat = path.stat()
    return _compiled_method(owner, name, path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _compiled_method(owner: str, name: str, path, mtime_ns: int, size: int):
    import torch

    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner), None)
    found = [node for node in (cls.body if cls else []) if isinstance(node, ast.FunctionDef) and node.name == name]
    if not found:
        raise TargetUnavailable(f"{path} has no method {owner}.{name}")
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    fn = namespace[name]
    fn.source = f"{path}:{found[0].lineno}"
    return fn


def pad_past_key_values(model, past_key_values, kv_cache_len: int, pad_len: int, mqa: bool = False):
    """What optimum-habana's generate does to the prefill's returned cache with --bucket_internal and no
    reuse_cache, before the first decode (`_sample`, generation/utils.py:2953-2979): its own
    `GaudiGenerationMixin._pad_past_key_values(model_kwargs)`, which pads every K/V of the prompt's length
    with `pad_len` zero positions to `kv_cache_len` (in place in the cache's lists). Returns the cache."""
    kwargs = {"past_key_values": past_key_values, "mqa_model": mqa, "lazy_mode": False, "kv_cache_pad_len": pad_len,
              "kv_cache_len": kv_cache_len, "decode_attn_batch_split": 1}
    optimum_habana_method("_pad_past_key_values")(model, kwargs)
    return kwargs["past_key_values"]


def temporary_reorder_cache(model, past_key_values, beam_idx):
    """What the installed optimum-habana's `_beam_search` calls after every step with reuse_cache
    off: its module-level `_temporary_reorder_cache(model, past_key_values, beam_idx)` (1.20 and
    later), or before 1.20 the model's own `_temporary_reorder_cache(past_key_values, beam_idx)`
    (transformers' GenerationMixin; a model without it raises AttributeError, as there). Without
    optimum-habana installed, 1.21.2's three branches (a tuple/list cache: `model._reorder_cache`;
    else `Cache.reorder_cache`)."""
    source = installed_generation_source()
    if source is not None and has_module_function(source, "_temporary_reorder_cache"):
        return optimum_habana_function("_temporary_reorder_cache")(model, past_key_values, beam_idx)
    if source is not None and "self._temporary_reorder_cache(" in source:
        return model._temporary_reorder_cache(past_key_values, beam_idx)
    if source is not None and "self._reorder_cache(" in source:  # 1.7.x: the model's own, directly
        return model._reorder_cache(past_key_values, beam_idx)
    if isinstance(past_key_values, (tuple, list)):
        return model._reorder_cache(past_key_values, beam_idx)
    past_key_values.reorder_cache(beam_idx)
    return past_key_values


def crops_with_transformers_function(source: str | None) -> bool:
    """Whether the installed release's assisted decoding crops with transformers'
    `_crop_past_key_values` (1.13 to 1.18 call it; a release whose generation/utils.py crops
    nowhere, as 1.11.1, runs transformers' own `_assisted_decoding`, which calls it) rather than
    the cache's own `crop` method (1.20 and later)."""
    if source is None:
        return False
    if "_crop_past_key_values(self, outputs.past_key_values" in source:
        return True
    return ".past_key_values.crop(" not in source


def assisted_crop(past_key_values, length: int, model=None):
    """What the installed optimum-habana's `_assisted_decoding` does to the cache after the
    candidates are checked: `outputs.past_key_values.crop(new_cur_len - 1)` (a `Cache` method;
    transformers 4.x takes the length to keep, 5.x the number of tokens to remove, as a negative
    int), or before 1.20 `_crop_past_key_values(self, outputs.past_key_values, new_cache_size)`
    (transformers' function, which needs the model: pass `model`)."""
    if crops_with_transformers_function(installed_generation_source()):
        if model is None:
            raise TypeError("this optimum-habana release crops with transformers' _crop_past_key_values(model, ...): "
                            "pass model= to assisted_crop")
        from transformers.generation.candidate_generator import _crop_past_key_values

        return _crop_past_key_values(model, past_key_values, length)
    crop = past_key_values.crop  # a tuple/list cache: AttributeError, as in _assisted_decoding
    if transformers_major() >= 5 and hasattr(past_key_values, "get_seq_length"):
        crop(length - int(past_key_values.get_seq_length()))
    else:
        crop(length)
    return past_key_values
