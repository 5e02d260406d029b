"""Standalone reproduction: llm-foundry MPT's beam-search reorder builds a second whole KV cache while the first lives.

Beam search reorders a legacy tuple cache with the model's own _reorder_cache (transformers 4.51
generation/utils.py _temporary_reorder_cache, called as model_kwargs["past_key_values"] =
self._temporary_reorder_cache(model_kwargs["past_key_values"], beam_idx)); llm-foundry's
(llmfoundry/models/mpt/modeling_mpt.py, 0.22.0 lines 1405-1421) returns a new list of index_select copies
of every layer, built while the caller still holds the old one: the whole cache twice at every beam step
(the transformers issue "forward pass consumes 2x memory"). The script reorders a tiny llm-foundry MPT's
cache as beam search does and counts the bytes allocated while every old layer is still referenced. Needs
torch, transformers and llm-foundry's files (no training stack). Exit status: 1 the bug is there, 0 it is
not, 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import traceback
import types
from pathlib import Path

try:
    import torch
    import transformers
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = "AutoModelForCausalLM.from_pretrained('mosaicml/mpt-7b', trust_remote_code=True).generate(..., num_beams=N): every beam step"
FIX = ("reorder in place, one layer at a time (for each layer: k.copy_(k.index_select(0, beam_idx)), or replace the "
       "caller's list entry by entry), never building a second whole cache while the first lives")
UPSTREAM = 'llm-foundry 0.22.0 llmfoundry/models/mpt/modeling_mpt.py:1405-1421 (_reorder_cache: a new list of index_select copies), called by transformers 4.51.3 GenerationMixin._temporary_reorder_cache'
WHAT = 'a second whole KV cache at every beam step'
CONFIG = {"vocab_size": 64, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 32}


class CannotRun(Exception):
    pass


# mpt-kv: foundry_loader.part


def versions() -> str:
    from importlib.metadata import version
    return f"llm-foundry {version('llm-foundry')}, torch {torch.__version__}, transformers {transformers.__version__}"


def main() -> int:
    modeling, configuration = load_foundry()
    model = tiny_mpt(modeling, configuration)
    print(versions())
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 6))
    with torch.no_grad():
        past = model(ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
        past = [tuple(t.clone() for t in layer) for layer in past]  # own storages: the bytes below are the cache's
        old = [t for layer in past for t in layer]
        cache_bytes = sum(t.numel() * t.element_size() for t in old)
        beam_idx = torch.tensor([1, 1])
        reorder = getattr(model, "_temporary_reorder_cache", None) or model._reorder_cache
        reordered = reorder(past, beam_idx)  # beam search's variable (past) still holds the old cache here
    new = [t for layer in reordered for t in layer]
    old_ptrs = {t.untyped_storage().data_ptr() for t in old}
    copied = sum(t.numel() * t.element_size() for t in new if t.untyped_storage().data_ptr() not in old_ptrs)
    print(f"cache {cache_bytes} bytes ({CONFIG['n_layers']} layers); reordered by {type(model).__name__}"
          f"{'._temporary_reorder_cache' if reorder.__name__ == '_temporary_reorder_cache' else '._reorder_cache'}: "
          f"{copied} bytes of new K/V made while the caller still holds every old layer")
    if copied >= cache_bytes:
        print("BUG: a second whole cache beside the first at every beam step")
        return 1
    print("OK: the reorder did not build a second whole cache")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except CannotRun as e:  # fail closed: what did not run cannot be called clean
        print(f"cannot run the experiment: {e}")
        status = 2
    except Exception:  # fail closed: a crash is not the bug this script looks for
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
