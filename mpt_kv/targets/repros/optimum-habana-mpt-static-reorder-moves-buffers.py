"""Standalone reproduction: optimum-habana's MPT beam search on the static path replaces the preallocated K/V buffers at every reorder (a captured HPU graph keeps using the old ones).

optimum-habana up to 1.19.x, beam search with static shapes (token_idx, the default on Gaudi):
after every step _beam_search calls the model's self._temporary_reorder_cache(past_key_values,
beam_idx) (optimum/habana/transformers/generation/utils.py:3368 in 1.18.1), transformers'
GenerationMixin method, which for MPT's tuple cache calls MptForCausalLM._reorder_cache
(transformers 4.51.3 models/mpt/modeling_mpt.py:587): a new tuple of index_select copies. So every
layer's preallocated K and V buffer, which the decode steps fill in place with index_copy_, is
replaced by a new tensor at every beam step. Eager decoding stays right (the values follow), but
an HPU graph captured on a decode step (use_hpu_graphs, what the static cache is for) replays into
the old buffers' addresses after the first beam step. The script loads optimum-habana's MPT
module alone on CPU, replays adapt_transformers_to_gaudi's MPT lines, makes a prefill and a
decode step on the static path, records each buffer's data_ptr, reorders as the installed
release's own _beam_search does (its generation/utils.py read for the route) and compares. 1.20.0
and later call a _reorder_cache that GaudiMptForCausalLM does not have: beam search fails there
before any buffer moves (a different finding, optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache).
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in 1.7.3 to 1.19.1, not in 1.20.0 and 1.21.2.
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

CALL = ("model.generate(..., num_beams=N) of optimum-habana's MPT with static shapes (the default on Gaudi), "
        "with use_hpu_graphs")
FIX = ("reorder the static buffers in place (per layer: key.index_copy_(0, arange, key.index_select(0, beam_idx)), "
       "or copy_ of the gathered tensor) so their addresses never change")

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


def main() -> int:
    port, root = setup()
    input_ids, attention_mask = prompts()
    model = gaudi_mpt(port, input_ids, attention_mask)
    if "token_idx" not in inspect.signature(model.forward).parameters:
        print("OK: this release's forward takes no token_idx: it has no static path")
        return 0
    reorder, route = beam_reorder(root, model)
    print(f"{type(model).__name__} ({model.dtype}), static path (token_idx), buffers of {MAX_LEN} slots; "
          f"this release's beam search reorders with {route}")
    cache = step(model, input_ids, attention_mask, "static")
    before = [(key.data_ptr(), value.data_ptr()) for key, value in (layer[:2] for layer in cache)]
    try:
        reordered = reorder(cache, BEAM_IDX)
    except Exception as e:
        if not no_reorder(e):
            raise
        print(f"the reorder raised {type(e).__name__}: {e}")
        print("OK: no buffer moves: this release's beam search cannot reorder MPT's cache at all (a different finding: "
              "optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache)")
        return 0
    after = [(key.data_ptr(), value.data_ptr()) for key, value in (layer[:2] for layer in reordered)]
    moved = []
    for layer, ((key0, value0), (key1, value1)) in enumerate(zip(before, after)):
        print(f"  layer {layer}: key buffer {key0:#x} -> {key1:#x}, value buffer {value0:#x} -> {value1:#x}")
        moved += [f"layer {layer} {name}" for name, a, b in (("key", key0, key1), ("value", value0, value1)) if a != b]
    if moved:
        print(f"BUG: the reorder replaced the static cache's preallocated buffers ({', '.join(moved)}): "
              "a graph captured on a decode step keeps writing into and reading the old ones")
        return 1
    print("OK: the reorder keeps every preallocated buffer in place")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
