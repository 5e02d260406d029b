"""Standalone reproduction: transformers MPT's beam-search reorder holds the KV cache twice (a whole copy while the old one lives).

While MPT returns legacy tuples, beam search reorders them with MptForCausalLM._reorder_cache
(4.50.3 models/mpt/modeling_mpt.py:587, 4.40.2 :622): a new tuple of index_select copies of every
layer, built while the caller (beam search's model_kwargs["past_key_values"]) still holds the old
tuple, so the whole cache exists twice at every beam step (the transformers issue "forward pass
consumes 2x memory"). Once MPT runs on a DynamicCache, Cache.reorder_cache replaces one layer at a
time, each old layer freed as soon as its copy is made: at most one layer's K or V more than the
cache. The script decodes a tiny MPT one step, reorders its cache as the installed release's beam
search does while a caller's variable holds it, and watches every tensor the reorder allocates
(a TorchDispatchMode; weak references tell which old and new tensors are alive at each
allocation): the bytes allocated anew while the whole old cache is still alive, and whether the
returned K/V share storage with the old ones. Needs only torch and transformers. Exit status: 1
the bug is there (every layer copied whole while the old cache lived), 0 it is not (in place, or one
layer at a time), 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import sys
import traceback
import weakref

try:
    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, MptConfig
    from transformers.generation.utils import GenerationMixin
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = "model.generate(..., num_beams=N) (beam search): after every beam step"
FIX = ("reorder per layer, in place (layer_past[i].copy_(layer_past[i].index_select(0, beam_idx))) or replacing "
       "one layer at a time as Cache.reorder_cache does, never building a second whole cache while the first lives")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAJOR = int(transformers.__version__.split(".")[0])


class CannotRun(Exception):
    pass


def tiny_mpt():
    torch.manual_seed(0)
    config = MptConfig(**CONFIG)
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    except TypeError:  # before transformers 4.36 there is no attn_implementation: eager is the only one
        return AutoModelForCausalLM.from_config(config).eval()


def generate_cache(model):
    """The cache generate starts MPT with: a DynamicCache where the release gives MPT one, else None
    (legacy tuples, which MPT returns to 4.53)."""
    try:
        from transformers import DynamicCache
    except ImportError:
        return None
    supports = getattr(model, "_supports_default_dynamic_cache", None)  # what generate asks (4.42 on)
    if not (supports() if supports is not None else getattr(model, "_supports_cache_class", False)):
        return None
    return DynamicCache(config=model.config) if MAJOR >= 5 else DynamicCache()


def reorder_as_beam_search(model, cache, beam_idx):
    """Reorder as the installed release's beam search does (read from its _beam_search): 4.36-4.53
    GenerationMixin._temporary_reorder_cache; 4.54-5.24 the model's _reorder_cache where it defines
    one, else Cache.reorder_cache; before, the model's _reorder_cache. Returns (cache, route)."""
    method = getattr(GenerationMixin, "_beam_search", None) or getattr(GenerationMixin, "beam_search", None)
    if method is None:
        raise CannotRun("this release's GenerationMixin has no _beam_search or beam_search")
    source = inspect.getsource(method)
    if "self._temporary_reorder_cache(" in source:
        kind = "tuple" if isinstance(cache, (tuple, list)) else "Cache"
        return (model._temporary_reorder_cache(cache, beam_idx),
                f"GenerationMixin._temporary_reorder_cache (a {kind} cache: "
                + (f"{type(model).__name__}._reorder_cache)" if kind == "tuple" else "Cache.reorder_cache)"))
    if 'hasattr(self, "_reorder_cache")' in source:
        if hasattr(model, "_reorder_cache"):
            return model._reorder_cache(cache, beam_idx), f"{type(model).__name__}._reorder_cache"
        if not hasattr(cache, "reorder_cache"):
            raise CannotRun(f"{type(model).__name__} defines no _reorder_cache and its {type(cache).__name__} has no "
                            "reorder_cache: this release's beam search raises")
        cache.reorder_cache(beam_idx)
        return cache, f"{type(cache).__name__}.reorder_cache (the model defines no _reorder_cache)"
    if "self._reorder_cache(" in source:
        return model._reorder_cache(cache, beam_idx), f"{type(model).__name__}._reorder_cache"
    raise CannotRun(f"this release's {method.__name__} reorders the cache in none of the known ways")


def layers(cache):
    if isinstance(cache, (tuple, list)):
        return [(k, v) for k, v in cache]
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def nbytes(t) -> int:
    return t.numel() * t.element_size()


class Allocations(TorchDispatchMode):
    """While active, at each op that returns a tensor in a storage of its own (not one of the old
    cache's): which old K/V tensors are still alive (weak references, the caller holding what it
    holds), and the bytes of the tensors allocated so far that are still alive."""

    def __init__(self, old):
        super().__init__()
        self.old = [(weakref.ref(t), nbytes(t)) for t in old]
        self.old_storages = {t.untyped_storage().data_ptr() for t in old}
        self.cache_bytes = sum(n for _, n in self.old)
        self.new = []                  # (weak reference, bytes) of every tensor allocated anew
        self.while_whole_old = 0       # the most bytes allocated anew alive while every old K/V was alive
        self.peak = self.cache_bytes   # the most old + new bytes alive at once

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.old_storages and \
                    t.numel() > 0:
                self.new.append((weakref.ref(t), t.untyped_storage().nbytes()))
        old_alive = [n for ref, n in self.old if ref() is not None]
        new_alive = sum(n for ref, n in self.new if ref() is not None)
        self.peak = max(self.peak, sum(old_alive) + new_alive)
        if len(old_alive) == len(self.old):
            self.while_whole_old = max(self.while_whole_old, new_alive)
        return out


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    model = tiny_mpt()
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(tokens, mask, cache):
        out = model(tokens, attention_mask=mask, use_cache=True, **{keyword: cache})
        returned = getattr(out, "cache", None)
        return out.logits, returned if returned is not None else out.past_key_values

    # a batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them (here: 2 beams)
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    beam_idx = torch.tensor([1, 1])  # both beams continue from beam 1, as beam search may pick
    with torch.no_grad():
        logits, cache = forward(input_ids, mask, generate_cache(model))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, cache = forward(logits[:, -1:].argmax(-1), mask, cache)  # a torch.cat: each K/V its own storage
        del logits
        # beam search's variable holds the cache during the reorder: model_kwargs["past_key_values"] =
        # self._temporary_reorder_cache(model_kwargs["past_key_values"], beam_idx) (or cache.reorder_cache)
        model_kwargs = {"past_key_values": cache}
        del cache
        old = [t for kv in layers(model_kwargs["past_key_values"]) for t in kv]
        if any(t.untyped_storage().nbytes() != nbytes(t) for t in old):
            raise CannotRun("after the decode step a cached K/V is a view of a larger storage: the bytes below "
                            "would not be the cache's")
        pointers = [t.untyped_storage().data_ptr() for t in old]
        expected = [t.index_select(0, beam_idx) for t in old]
        allocations = Allocations(old)
        del old  # from here only the cache (and whoever the reorder lets hold it) keeps the old K/V alive
        with allocations:
            model_kwargs["past_key_values"], route = reorder_as_beam_search(model, model_kwargs["past_key_values"],
                                                                            beam_idx)
    new = [t for kv in layers(model_kwargs["past_key_values"]) for t in kv]
    if len(new) != len(expected) or not all(torch.equal(a, b) for a, b in zip(new, expected)):
        raise CannotRun("the reordered cache does not hold the old cache's rows in beam_idx's order")
    cache_bytes, layer_bytes = allocations.cache_bytes, allocations.cache_bytes // CONFIG["n_layers"]
    shared = sum(t.untyped_storage().data_ptr() == p for t, p in zip(new, pointers))
    print(f"{type(model_kwargs['past_key_values']).__name__} cache of {CONFIG['n_layers']} layers, 7 positions: "
          f"{cache_bytes} bytes ({layer_bytes} per layer, K and V); reordered by beam_idx {beam_idx.tolist()} as this "
          f"release's beam search does: {route}")
    print(f"returned K/V sharing storage with the old ones: {shared} of {len(new)}")
    print(f"bytes allocated anew and alive while the whole old cache was still alive: {allocations.while_whole_old} "
          f"({allocations.while_whole_old / cache_bytes:.2f}x the cache)")
    print(f"most bytes of old and new K/V alive at once during the reorder: {allocations.peak} "
          f"({allocations.peak / cache_bytes:.2f}x the cache)")
    if allocations.while_whole_old >= cache_bytes:
        print("BUG: the reorder copied every layer whole while the old cache was alive: the whole cache twice at "
              "every beam step")
        return 1
    print("OK: the reorder never held a second whole cache beside the old one (in place, or one layer at a time)")
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
