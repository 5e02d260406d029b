"""transformers' own beam-search reorder, as the installed release does it.

Beam search reorders the cache after every step, and how has changed across releases (read from
each release's `generation/utils.py`, the method `_beam_search`, `beam_search` before 4.40):

    model        4.32-4.35: `self._reorder_cache(past_key_values, beam_idx)`, always (legacy tuples)
    temporary    4.36-4.53: `self._temporary_reorder_cache(past_key_values, beam_idx)`, a GenerationMixin
                 method: a tuple/list cache goes to the model's `_reorder_cache`, a `Cache` (but for
                 gptbigcode) to `Cache.reorder_cache`, even where the model defines `_reorder_cache`
    own-or-cache 4.54-5.24: `if hasattr(self, "_reorder_cache")` the model's own, `elif` the cache has
                 `reorder_cache` that, else a ValueError (the model cannot beam search with a cache)

`reorder_route()` reads which one the installed release's method does (its AST: what it calls and
whether it asks `hasattr(self, "_reorder_cache")`), with the file and line, so that
`TransformersRunner` reorders as that release's `generate` does and the release sweep runs each
release's own route (`python -m mpt_kv sweep` shows it per release). A method that does none of
the three is an error naming it, never a guess.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

from mpt_kv.errors import TargetUnavailable

ROUTES = {
    "model": "the model's _reorder_cache",
    "temporary": "GenerationMixin._temporary_reorder_cache (a tuple cache: the model's _reorder_cache; a Cache: "
                 "Cache.reorder_cache)",
    "own-or-cache": "the model's _reorder_cache where it defines one, else Cache.reorder_cache",
}


@dataclass(frozen=True)
class Route:
    kind: str    # a key of ROUTES
    where: str   # "transformers/generation/utils.py:3842": the line that reorders

    def describe(self) -> str:
        return f"{ROUTES[self.kind]} ({self.where})"


def route_of_source(source: str) -> tuple[str, int] | None:
    """(kind, line within `source`) of a beam-search method's reorder, or None if it does none of
    the known three (module doc)."""
    tree = ast.parse(textwrap.dedent(source))
    calls: dict[str, int] = {}
    asks = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
            calls.setdefault(node.func.attr, node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" and \
                len(node.args) == 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == "self" and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value == "_reorder_cache":
            asks = node.lineno if asks is None else min(asks, node.lineno)
    if "_temporary_reorder_cache" in calls:
        return "temporary", calls["_temporary_reorder_cache"]
    if asks is not None:
        return "own-or-cache", asks
    if "_reorder_cache" in calls:
        return "model", calls["_reorder_cache"]
    return None


@functools.lru_cache(maxsize=None)
def reorder_route() -> Route:
    """The installed transformers' beam-search reorder (module doc)."""
    from transformers.generation.utils import GenerationMixin

    method = getattr(GenerationMixin, "_beam_search", None) or getattr(GenerationMixin, "beam_search", None)
    if method is None:
        raise TargetUnavailable("the installed transformers' GenerationMixin has no _beam_search or beam_search: mpt-kv "
                                "does not know how its beam search reorders the cache")
    lines, first = inspect.getsourcelines(method)
    found = route_of_source("".join(lines))
    path = inspect.getsourcefile(method) or "generation/utils.py"
    short = "transformers/" + path.replace("\\", "/").split("/transformers/", 1)[-1]
    if found is None:
        raise TargetUnavailable(f"{short}:{first} {method.__name__} reorders the cache in none of the ways mpt-kv knows "
                                f"({', '.join(ROUTES)}): mpt_kv/targets/hf_generation.py needs its route")
    kind, line = found
    return Route(kind, f"{short}:{first + line - 1}")


def reorder_as_beam_search(model, cache, beam_idx):
    """Reorder `cache` as the installed release's beam search does; returns the cache to keep."""
    kind = reorder_route().kind
    if kind == "temporary":
        return model._temporary_reorder_cache(cache, beam_idx)
    if kind == "model":
        return model._reorder_cache(cache, beam_idx)
    if hasattr(model, "_reorder_cache"):
        return model._reorder_cache(cache, beam_idx)
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(beam_idx)
        return cache
    raise ValueError(f"{type(model).__name__} cannot use beam search with a cache currently, as the cache cannot be "
                     f"reordered (transformers' own message, {reorder_route().where})")
