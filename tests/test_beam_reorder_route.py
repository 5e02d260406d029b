"""transformers' beam-search reorder, release by release (issue 26): `TransformersRunner` reorders a
cache as the installed release's own `_beam_search` (`beam_search` before 4.40) does, read from its
source (`mpt_kv.targets.hf_generation`), and `python -m mpt_kv sweep` lists each release's route."""

import importlib.util
import inspect
import json

import pytest
import torch
from packaging.version import Version

from mpt_kv.cli import sweep
from mpt_kv.cli.run import BEAM_REORDER
from mpt_kv.targets import hf_generation as G

# the reorder statements of three releases' beam search, as they are written there
MODEL = '''
def beam_search(self, input_ids, beam_scorer):
    while True:
        if model_kwargs["past_key_values"] is not None:
            model_kwargs["past_key_values"] = self._reorder_cache(model_kwargs["past_key_values"], beam_idx)
'''  # 4.32.1 generation/utils.py:3085
TEMPORARY = '''
def _beam_search(self, input_ids, beam_scorer):
    while True:
        if model_kwargs.get("past_key_values", None) is not None:
            model_kwargs["past_key_values"] = self._temporary_reorder_cache(
                model_kwargs["past_key_values"], beam_idx
            )
'''  # 4.45.2 generation/utils.py:3344
OWN_OR_CACHE = '''
def _beam_search(self, input_ids, generation_config):
    while cur_len < max_length:
        if model_kwargs.get("past_key_values", None) is not None:
            beam_idx = self._flatten_beam_dim(running_beam_indices[..., cur_len - decoder_prompt_len])
            if hasattr(self, "_reorder_cache"):
                model_kwargs["past_key_values"] = self._reorder_cache(model_kwargs["past_key_values"], beam_idx)
            else:
                model_kwargs["past_key_values"].reorder_cache(beam_idx)
'''  # 4.55.4 generation/utils.py:4190


@pytest.mark.parametrize("source, kind, line", [(MODEL, "model", 5), (TEMPORARY, "temporary", 5),
                                                (OWN_OR_CACHE, "own-or-cache", 6)])
def test_the_route_is_read_from_the_beam_search_methods_source(source, kind, line):
    assert G.route_of_source(source) == (kind, line)


def test_a_beam_search_that_reorders_otherwise_is_no_route():
    assert G.route_of_source("def _beam_search(self):\n    cache.reorder(beam_idx)\n") is None


class Cache:
    def __init__(self):
        self.calls = []

    def reorder_cache(self, beam_idx):
        self.calls.append(("Cache.reorder_cache", beam_idx.tolist()))


class Model:
    def __init__(self, own: bool):
        if own:
            self._reorder_cache = lambda past, beam_idx: ("model._reorder_cache", past)

    def _temporary_reorder_cache(self, past, beam_idx):  # 4.36-4.53's GenerationMixin, for a Cache
        past.reorder_cache(beam_idx)
        return past


@pytest.mark.parametrize("kind, own, expected", [
    ("own-or-cache", True, "model._reorder_cache"),  # 4.54-5.24: the model's own where it defines one
    ("own-or-cache", False, "Cache.reorder_cache"),
    ("temporary", True, "Cache.reorder_cache"),      # 4.36-4.53: a Cache is reordered by itself, whatever the model has
    ("model", True, "model._reorder_cache"),         # 4.32-4.35
])
def test_the_reorder_follows_the_route(monkeypatch, kind, own, expected):
    monkeypatch.setattr(G, "reorder_route", lambda: G.Route(kind, "transformers/generation/utils.py:1"))
    cache = Cache()
    out = G.reorder_as_beam_search(Model(own), cache, torch.tensor([1, 0]))
    got = out[0] if isinstance(out, tuple) else cache.calls[0][0]
    assert got == expected


def test_without_a_reorder_of_its_own_a_tuple_cache_cannot_beam_search(monkeypatch):
    monkeypatch.setattr(G, "reorder_route", lambda: G.Route("own-or-cache", "transformers/generation/utils.py:1"))
    with pytest.raises(ValueError, match=r"Model cannot use beam search with a cache currently, as the cache cannot be "
                                         r"reordered \(transformers' own message, transformers/generation/utils.py:1\)"):
        G.reorder_as_beam_search(Model(False), ((torch.zeros(1), torch.zeros(1)),), torch.tensor([0]))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_the_installed_release_route_names_its_line():
    from transformers.generation.utils import GenerationMixin

    route = G.reorder_route()
    method = getattr(GenerationMixin, "_beam_search", None) or GenerationMixin.beam_search
    path, line = route.where.rsplit(":", 1)
    assert path.endswith("transformers/generation/utils.py")
    text = open(inspect.getsourcefile(method)).read().splitlines()[int(line) - 1]
    assert {"own-or-cache": 'hasattr(self, "_reorder_cache")', "temporary": "self._temporary_reorder_cache(",
            "model": "self._reorder_cache("}[route.kind] in text, (route, text)


def row_with_log(tmp_path, version, log):
    rel = sweep.Release("transformers", Version(version))
    report, path = tmp_path / f"{rel.slug}.json", tmp_path / f"{rel.slug}.log"
    report.write_text(json.dumps({"results": [{"target": "transformers", "device": "cpu", "dtype": "float32",
                                               "check": "ops-P1/concat", "property": "ops-P1", "path": "concat",
                                               "outcome": "passed", "nodeid": "n"}]}))
    path.write_text(log)
    return sweep.Row(rel, pins=f"transformers {version}", report=report, log=path)


def test_the_sweep_table_lists_each_releases_route(tmp_path):
    rows = [row_with_log(tmp_path, "4.45.2", f"target transformers    ok 4.45.2; {BEAM_REORDER} "
                                              f"GenerationMixin._temporary_reorder_cache (...) (x.py:3344)\n"),
            row_with_log(tmp_path, "5.24.0", f"target transformers    ok 5.24.0; {BEAM_REORDER} the model's "
                                              f"_reorder_cache where it defines one (y.py:3842)\n"),
            row_with_log(tmp_path, "4.40.2", "target transformers    ok 4.40.2\n")]  # a run from before the route
    text = "\n".join(sweep.table_lines(rows))
    assert "| release | reorders with |" in text, text
    assert "| 4.45.2 | GenerationMixin._temporary_reorder_cache (...) (x.py:3344) |" in text
    assert "| 5.24.0 | the model's _reorder_cache where it defines one (y.py:3842) |" in text
    assert "| 4.40.2 | - |" in text
    none = "\n".join(sweep.table_lines([row_with_log(tmp_path, "4.40.2", "target transformers    ok 4.40.2\n")]))
    assert "reorders with" not in none
