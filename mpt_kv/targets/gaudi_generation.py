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
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from mpt_kv.errors import TargetUnavailable

UTILS = Path("transformers") / "generation" / "utils.py"


def generation_utils_path() -> Path:
    """The installed optimum-habana's generation/utils.py (TargetUnavailable if not installed)."""
    spec = importlib.util.find_spec("optimum")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "habana" / UTILS
        if path.is_file():
            return path
    raise TargetUnavailable("optimum-habana is not installed: its generation functions cannot be loaded")


@functools.lru_cache(maxsize=None)
def optimum_habana_function(name: str):
    """The module-level function `name` of optimum-habana's generation/utils.py, compiled from its
    source with the names it reads from transformers (`DynamicCache`, `EncoderDecoderCache`)."""
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    path = generation_utils_path()
    tree = ast.parse(path.read_text(), filename=str(path))
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if not found:
        raise TargetUnavailable(f"{path} has no module-level function {name!r}")
    module = ast.Module(body=found, type_ignores=[])
    namespace = {"torch": torch, "DynamicCache": DynamicCache, "EncoderDecoderCache": EncoderDecoderCache}
    exec(compile(module, str(path), "exec"), namespace)  # line numbers are the file's own
    fn = namespace[name]
    fn.source = f"{path}:{found[0].lineno}"
    return fn


def temporary_reorder_cache(model, past_key_values, beam_idx):
    """optimum-habana's `_temporary_reorder_cache(model, past_key_values, beam_idx)`: what its
    `_beam_search` calls after every step with reuse_cache off. Without optimum-habana installed,
    the same three branches (a tuple/list cache: `model._reorder_cache`; else `Cache.reorder_cache`)."""
    try:
        fn = optimum_habana_function("_temporary_reorder_cache")
    except TargetUnavailable:
        fn = None
    if fn is not None:
        return fn(model, past_key_values, beam_idx)
    if isinstance(past_key_values, (tuple, list)):
        return model._reorder_cache(past_key_values, beam_idx)
    past_key_values.reorder_cache(beam_idx)
    return past_key_values


def assisted_crop(past_key_values, length: int):
    """What optimum-habana's `_assisted_decoding` does to the cache after the candidates are
    checked: `outputs.past_key_values.crop(new_cur_len - 1)` (a `Cache` method; transformers 4.x
    takes the length to keep, 5.x the number of tokens to remove, as a negative int)."""
    crop = past_key_values.crop  # a tuple/list cache: AttributeError, as in _assisted_decoding
    from mpt_kv.targets.wrappers import transformers_major

    if transformers_major() >= 5 and hasattr(past_key_values, "get_seq_length"):
        crop(length - int(past_key_values.get_seq_length()))
    else:
        crop(length)
    return past_key_values
