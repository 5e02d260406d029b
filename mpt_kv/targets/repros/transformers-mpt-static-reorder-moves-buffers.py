"""Standalone reproduction: transformers' beam-search reorder replaces a StaticCache's preallocated buffers (MPT).

A StaticCache preallocates each layer's K and V once so that a captured CUDA or HPU graph (what the
static cache is for) keeps writing into the same storage. Beam search reorders the cache after
every step; MPT defines no _reorder_cache, so the release's beam search calls
Cache.reorder_cache(beam_idx), and StaticLayer inherits CacheLayerMixin.reorder_cache (5.24
cache_utils.py:97-101): self.keys = self.keys.index_select(0, beam_idx), the same for values, new
tensors. Eagerly the values follow, but a graph captured on a decode step replays into the old
buffers after the first beam step. The script prefills a tiny MPT into a StaticCache, decodes a
step, records each layer's key/value data_ptr, reorders as the installed release's beam search
does, and compares. Needs only torch and transformers. Exit status: 1 the bug is there, 0 it is
not, 2 the experiment could not run (among others where the release's MPT cannot run a
StaticCache at all). (Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import sys
import traceback

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, MptConfig, StaticCache
    from transformers.generation.utils import GenerationMixin
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = ("model.generate(..., num_beams=N, cache_implementation='static') (beam search on a static cache, as under a "
        "captured CUDA/HPU graph or torch.compile): after every beam step")
FIX = ("reorder each static layer in place (self.keys.copy_(self.keys.index_select(0, beam_idx)), the same for "
       "values) so the preallocated buffers keep their storage")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAX_CACHE_LEN = 16
MAJOR = int(transformers.__version__.split(".")[0])


# mpt-kv: static_mpt.part


def reorder_as_beam_search(model, cache, beam_idx):
    """Reorder as the installed release's beam search does (read from its _beam_search): 4.36-4.53
    GenerationMixin._temporary_reorder_cache; 4.54-5.24 the model's _reorder_cache where it defines
    one, else Cache.reorder_cache; before, the model's _reorder_cache. Returns (cache, route)."""
    method = getattr(GenerationMixin, "_beam_search", None) or getattr(GenerationMixin, "beam_search", None)
    if method is None:
        raise CannotRun("this release's GenerationMixin has no _beam_search or beam_search")
    source = inspect.getsource(method)
    if "self._temporary_reorder_cache(" in source:
        return model._temporary_reorder_cache(cache, beam_idx), "GenerationMixin._temporary_reorder_cache"
    if 'hasattr(self, "_reorder_cache")' in source:
        if hasattr(model, "_reorder_cache"):
            return model._reorder_cache(cache, beam_idx), f"{type(model).__name__}._reorder_cache"
        cache.reorder_cache(beam_idx)
        return cache, f"{type(cache).__name__}.reorder_cache (the model defines no _reorder_cache)"
    if "self._reorder_cache(" in source:
        return model._reorder_cache(cache, beam_idx), f"{type(model).__name__}._reorder_cache"
    raise CannotRun(f"this release's {method.__name__} reorders the cache in none of the known ways")


def layers(cache):
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    model = tiny_mpt()
    parameters = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in parameters else "past_key_values"

    def forward(tokens, mask, cache, position):
        kw = {keyword: cache}
        if "cache_position" in parameters:  # 4.x: the positions written, as generate passes them
            kw["cache_position"] = torch.arange(position, position + tokens.shape[1])
        out = model(tokens, attention_mask=mask, use_cache=True, **kw)
        returned = getattr(out, "cache", None)
        return out.logits, returned if returned is not None else out.past_key_values

    # a batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them (here: 2 beams)
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    try:
        cache = static_cache(model, input_ids.shape[0])
    except Exception as e:
        raise CannotRun(f"this release's StaticCache cannot be made for MPT: {type(e).__name__}: {e}") from e
    with torch.no_grad():
        try:
            logits, returned = forward(input_ids, mask, cache, 0)
        except Exception as e:
            raise CannotRun(f"this release's MPT cannot run a StaticCache: the prefill raised {type(e).__name__}: "
                            f"{e}") from e
        if returned is not cache:
            raise CannotRun(f"the prefill returned a {type(returned).__name__}, not the StaticCache it was given")
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, returned = forward(logits[:, -1:].argmax(-1), mask, cache, input_ids.shape[1])
        if returned is not cache:
            raise CannotRun(f"the decode step returned a {type(returned).__name__}, not the StaticCache it was given")
        before = [(k.data_ptr(), v.data_ptr(), k.clone(), v.clone()) for k, v in layers(cache)]
        old = layers(cache)  # kept alive, so that no new buffer can reuse a freed one's address
        beam_idx = torch.tensor([1, 1])  # both beams continue from beam 1, as beam search may pick
        reordered, route = reorder_as_beam_search(model, cache, beam_idx)
    print(f"StaticCache(max_cache_len={MAX_CACHE_LEN}), prefill of 6 + 1 decode step, reordered by beam_idx "
          f"{beam_idx.tolist()} as this release's beam search does: {route}")
    moved = 0
    for i, ((k, v), (kp, vp, k0, v0)) in enumerate(zip(layers(reordered), before)):
        if not (torch.equal(k, k0.index_select(0, beam_idx)) and torch.equal(v, v0.index_select(0, beam_idx))):
            raise CannotRun(f"layer {i}'s cache does not hold the reordered rows after the reorder")
        for name, t, was in (("key", k, kp), ("value", v, vp)):
            moved += t.data_ptr() != was
            print(f"layer {i} {name} {tuple(t.shape)}: data_ptr {was:#x} -> {t.data_ptr():#x} "
                  f"({'a new buffer' if t.data_ptr() != was else 'the same buffer'})")
    del old
    if moved:
        print(f"BUG: the reorder replaced {moved} of {2 * len(before)} preallocated K/V buffers: a graph captured on a "
              "decode step keeps reading and writing the old ones")
        return 1
    print("OK: the reorder kept every preallocated K/V buffer (reordered in place)")
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
