"""Standalone reproduction: transformers' assisted-decoding crop keeps MPT's cropped positions allocated (slices are views).

Assisted decoding verifies the draft's candidate tokens in one cached forward, then crops the
rejected ones from the cache. The crop slices: to 4.53 MPT returns legacy tuples, which
_crop_past_key_values crops as past_key_values[idx][0][:, :, :max_length, :]
(generation/candidate_generator.py; generation/utils.py before 4.38); from 4.54 DynamicLayer.crop does self.keys =
self.keys[..., :max_length, :] (4.55.4 cache_utils.py:134-135) or self.keys[..., :-abs(tokens_to_remove), :]
(5.24 cache_utils.py:180-181). Either way each layer's K and V become views whose storage still
holds the cropped candidates, until the next torch.cat copies them. The script runs a tiny MPT as
assisted decoding drives it (prefill, two decode steps, a 4-token verification call), crops the 3
rejected candidates the way the installed release's assisted decoding does, and compares each
layer's K/V storage bytes with the bytes of the positions that survive. Needs only torch and
transformers. Exit status: 1 the bug is there, 0 it is not, 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import sys
import traceback

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, MptConfig
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = ("model.generate(..., assistant_model=draft) (assisted decoding): after each verification the rejected "
        "candidates are cropped from the target model's cache")
FIX = ("crop by copying the surviving positions (clone the slice) in DynamicLayer.crop and "
       "_crop_past_key_values, so the cropped candidates' bytes are freed at the crop")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAJOR = int(transformers.__version__.split(".")[0])


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


def crop_as_assisted_decoding(model, cache, keep: int):
    """Crop `cache` to its first `keep` positions as the release's _assisted_decoding does; returns
    (the cache to keep, how it was cropped)."""
    if isinstance(cache, (tuple, list)):
        try:
            from transformers.generation.candidate_generator import _crop_past_key_values
        except ImportError:  # before 4.38 it is in generation/utils.py
            from transformers.generation.utils import _crop_past_key_values

        return _crop_past_key_values(model, cache, keep), "_crop_past_key_values(model, past_key_values, max_length)"
    length = cache.get_seq_length()
    if MAJOR >= 5:  # 5.x: the number of tokens to remove, negative (5.24 accepts nothing else)
        cache.crop(keep - length)
        return cache, f"cache.crop({keep - length})"
    cache.crop(keep)  # 4.x: the length to keep
    return cache, f"cache.crop({keep})"


def layers(cache):
    if isinstance(cache, (tuple, list)):
        return [(k, v) for k, v in cache]
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def held(t) -> int:
    """Bytes of the storage `t` keeps alive, beyond its own elements."""
    return t.untyped_storage().nbytes() - t.numel() * t.element_size()


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    model = tiny_mpt()
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def forward(tokens, mask, cache):
        out = model(tokens, attention_mask=mask, use_cache=True, **{keyword: cache})
        returned = getattr(out, "cache", None)
        return out.logits, returned if returned is not None else out.past_key_values

    # a batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    with torch.no_grad():
        logits, cache = forward(input_ids, mask, generate_cache(model))
        for _ in range(2):  # two greedy decode steps
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits, cache = forward(logits[:, -1:].argmax(-1), mask, cache)
        # the verification call: 4 candidate tokens of a draft model in one cached forward
        candidates = torch.randint(1, CONFIG["vocab_size"], (2, 4))
        mask = torch.cat([mask, torch.ones_like(candidates)], dim=1)
        logits, cache = forward(candidates, mask, cache)
    print(f"cache: {type(cache).__name__}, {layers(cache)[0][0].shape[-2]} positions (6 prompt + 2 decoded "
          "+ 4 candidates)")
    before = [(held(k), held(v)) for k, v in layers(cache)]
    keep = 9  # the first candidate accepted, 3 rejected
    cache, how = crop_as_assisted_decoding(model, cache, keep)
    print(f"cropped to {keep} positions as assisted decoding does: {how}")
    found = 0
    for i, ((k, v), (k0, v0)) in enumerate(zip(layers(cache), before)):
        for name, t, was in (("key", k, k0), ("value", v, v0)):
            if t.shape[-2] != keep:
                print(f"cannot run the experiment: layer {i} {name} has {t.shape[-2]} positions after the crop, "
                      f"not {keep}")
                return 2
            kept = held(t) - was  # what the crop itself leaves (the verification's torch.cat copied)
            found += kept > 0
            print(f"layer {i} {name} {tuple(t.shape)}: {t.numel() * t.element_size()} bytes of surviving "
                  f"positions in a storage of {t.untyped_storage().nbytes()} bytes: the crop keeps {kept} bytes "
                  f"of cropped positions ({'a view' if kept > 0 else 'its own storage'})")
    if found:
        print(f"BUG: the crop leaves {found} of {2 * len(before)} cached K/V as views: the cropped candidates' bytes "
              "stay allocated until the next step's torch.cat copies")
        return 1
    print("OK: after the crop every cached K/V holds only the surviving positions")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a crash is not the bug this script looks for
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
