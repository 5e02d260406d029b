"""Standalone reproduction: optimum-habana's MPT beam search reorders the cache into a new copy of every layer while the old cache is alive (the whole cache twice at each beam step).

optimum-habana up to 1.19.x, beam search: after every step _beam_search calls the model's
self._temporary_reorder_cache(past_key_values, beam_idx) (optimum/habana/transformers/generation/
utils.py:3368 in 1.18.1), transformers' GenerationMixin method (4.51.3 generation/utils.py:3526),
which for MPT's tuple cache calls MptForCausalLM._reorder_cache (4.51.3 models/mpt/modeling_mpt.py:
587): a new tuple of index_select copies of every layer's K and V, built while the caller
(model_kwargs["past_key_values"]) still holds the old cache. The peak is the whole cache twice,
at every beam step (the transformers issue "forward pass consumes 2x memory than required", here
in the reorder), on the concat path and on the static (token_idx) path alike. The script loads
optimum-habana's MPT module alone on CPU, replays adapt_transformers_to_gaudi's MPT lines, makes
a step on each path, reorders as the installed release's own _beam_search does (its
generation/utils.py read for the route), and checks whether the reordered K/V share any storage
with the old ones: the bytes of new storages are what the step holds on top of the cache. 1.20.0
and later call a _reorder_cache that GaudiMptForCausalLM does not have: beam search fails there
before any copy (a different finding, optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache).
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in 1.7.3 to 1.19.1 (1.7.3's beam search calls the model's _reorder_cache
directly), not in 1.20.0 and 1.21.2.
Needs torch, transformers and optimum-habana (pip install --no-deps optimum-habana), no HPU.
Exit status: 1 the bug is there, 0 it is not, 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import ast
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import traceback
import types
from pathlib import Path

try:
    import torch
    import transformers
    from transformers import MptConfig
    import transformers.models.mpt.modeling_mpt as hf
except Exception as e:  # fail closed (ImportError, or transformers' RuntimeError wrapping one): never "fixed"
    print(f"cannot run the experiment: {type(e).__name__}: {e}")
    sys.exit(2)

CALL = "model.generate(..., num_beams=N) of optimum-habana's MPT (beam search), static shapes on or off"
FIX = ("reorder one layer at a time, in place (key.copy_(key.index_select(0, beam_idx)) per layer), or give "
       "GaudiMptForCausalLM a _reorder_cache that does")

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


# mpt-kv: port_loader.part


MAX_LEN = 16  # the static path's padded length (prompt 6 + max_new_tokens 10)
BEAM_IDX = torch.tensor([1, 0])  # the beams' new order after a step (any index: the copy does not depend on it)


def beam_reorder(root: Path, model):
    """What the installed release's _beam_search calls after every step with reuse_cache off (MPT
    may not turn it on), read from its own optimum/habana/transformers/generation/utils.py: 1.20
    and later its module-level _temporary_reorder_cache(self, past_key_values, beam_idx) (compiled
    from the file's own source: the module does not import without an HPU stack); 1.10.4 to 1.19
    the model's self._temporary_reorder_cache(past_key_values, beam_idx), transformers'
    GenerationMixin method, which for a tuple cache calls the model's _reorder_cache; 1.7.x to
    1.10.0 the model's self._reorder_cache directly. (a function of (past_key_values, beam_idx),
    what it is)"""
    path = root / "transformers" / "generation" / "utils.py"
    source = path.read_text(encoding="utf-8")
    node = next((n for n in ast.parse(source, filename=str(path)).body
                 if isinstance(n, ast.FunctionDef) and n.name == "_temporary_reorder_cache"), None)
    if node is not None:
        import transformers.cache_utils as cache_utils

        namespace = {"torch": torch, **{n: getattr(cache_utils, n) for n in ("DynamicCache", "EncoderDecoderCache")
                                        if hasattr(cache_utils, n)}}
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
        function = namespace["_temporary_reorder_cache"]
        return (lambda past, beam_idx: function(model, past, beam_idx),
                f"optimum-habana's _temporary_reorder_cache(self, past_key_values, beam_idx) "
                f"(generation/utils.py:{node.lineno})")
    if "self._temporary_reorder_cache(" in source:
        return model._temporary_reorder_cache, ("self._temporary_reorder_cache(past_key_values, beam_idx) "
                                                "(transformers' GenerationMixin: a tuple cache goes to the "
                                                "model's _reorder_cache)")
    if "self._reorder_cache(" in source:
        return (lambda past, beam_idx: model._reorder_cache(past, beam_idx),
                "self._reorder_cache(past_key_values, beam_idx)")
    raise LookupError(f"{path}: no beam-search reorder this script knows")


def no_reorder(error: Exception) -> bool:
    """Whether the reorder failed for want of a _reorder_cache (1.20.0 to 1.21.2: beam search
    raises at its first step, a different finding)."""
    return isinstance(error, AttributeError) and "_reorder_cache" in str(error)


def step(model, input_ids, attention_mask, path: str):
    """generate's first forward on `path` ("concat": static shapes off; "static": the prompt and its
    mask padded to MAX_LEN, token_idx = the prompt's length), then one decode step, as before a
    beam step's reorder. The cache the port returned."""
    prompt = input_ids.shape[1]
    with torch.no_grad():
        if path == "concat":
            out = model(input_ids, attention_mask=attention_mask, past_key_values=None, use_cache=True)
            mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=out.past_key_values,
                        use_cache=True)
        else:
            mask = torch.nn.functional.pad(attention_mask, (0, MAX_LEN - prompt))
            out = model(torch.nn.functional.pad(input_ids, (0, MAX_LEN - prompt)), attention_mask=mask,
                        past_key_values=None, use_cache=True, token_idx=torch.tensor([prompt]))
            mask[:, prompt] = 1
            out = model(out.logits[:, prompt - 1:prompt].argmax(-1), attention_mask=mask,
                        past_key_values=out.past_key_values, use_cache=True, token_idx=torch.tensor([prompt + 1]))
    return out.past_key_values


def storages(tensors) -> dict:
    """{storage address: bytes} of the distinct storages the tensors view."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def main() -> int:
    port, root = setup()
    input_ids, attention_mask = prompts()
    model = gaudi_mpt(port, input_ids, attention_mask)
    reorder, route = beam_reorder(root, model)
    paths = ["concat"] + (["static"] if "token_idx" in inspect.signature(model.forward).parameters else [])
    print(f"{type(model).__name__} ({model.dtype}); this release's beam search reorders with {route}")
    copied, skipped = [], []
    for path in paths:
        old = step(model, input_ids, attention_mask, path)  # held by the caller, as model_kwargs holds it
        old_tensors = [t for layer in old for t in layer[:2]]
        try:
            new = reorder(old, BEAM_IDX)
        except Exception as e:
            if not no_reorder(e):
                raise
            print(f"path {path}: the reorder raised {type(e).__name__}: {e}")
            skipped.append(path)
            continue
        new_tensors = [t for layer in new for t in layer[:2]]
        before, after = storages(old_tensors), storages(new_tensors)
        fresh = {address: size for address, size in after.items() if address not in before}
        layer_bytes = sum(storages(old[0][:2]).values())
        print(f"path {path}: the cache ({len(old)} layers) holds {sum(before.values())} bytes, one layer's K and V "
              f"{layer_bytes}; after the reorder {len(fresh)} of its {len(after)} storages are new, "
              f"{sum(fresh.values())} bytes, allocated while the old cache is alive: peak "
              f"{sum(before.values()) + sum(fresh.values())} bytes")
        if sum(fresh.values()) > layer_bytes:  # a reorder in place needs at most one layer's temporary
            copied.append(f"{path}: {sum(fresh.values())} bytes of new copies next to the {sum(before.values())} "
                          "of the old cache")
    if copied:
        print("BUG: the beam reorder copies the whole cache while the old one is alive (2x): " + "; ".join(copied))
        return 1
    if skipped:
        print(f"OK: no whole-cache copy: on path(s) {', '.join(skipped)} this release's beam search cannot reorder "
              "MPT's cache at all (the AttributeError above, a different finding: "
              "optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache)")
        return 0
    print("OK: the beam reorder keeps the cache's storages (in place)")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
