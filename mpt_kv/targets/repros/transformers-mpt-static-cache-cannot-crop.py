"""Standalone reproduction: transformers' StaticCache cannot crop (StaticLayer has no crop): assisted decoding on it fails (MPT).

Assisted decoding crops the rejected candidates from the cache after each verification.
StaticCache.crop is Cache.crop, which calls every layer's crop (5.12.1 cache_utils.py:1347-1350),
and StaticLayer (cache_utils.py:363) has none in 5.12.1: AttributeError: 'StaticLayer' object has
no attribute 'crop' at the first verification. 5.24 adds StaticLayer.crop (cache_utils.py:510-521),
which moves cumulative_length back. The script prefills a tiny MPT into a StaticCache, decodes a
step, runs a 4-token verification call and crops the 3 rejected candidates as the installed
release's assisted decoding does. Needs only torch and transformers. Exit status: 1 the bug is
there (that AttributeError), 0 it is not (the cache crops to the kept positions), 2 the experiment
could not run (another error, among others where the release's MPT cannot run a StaticCache at all).
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import re
import sys
import traceback

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, MptConfig, StaticCache
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = ("model.generate(..., assistant_model=draft, cache_implementation='static') (assisted decoding on a static "
        "cache): at its first verification")
FIX = ("give StaticLayer a crop that moves its cumulative_length back (the buffers stay), as transformers 5.24's "
       "StaticLayer.crop does")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAX_CACHE_LEN = 16
MAJOR = int(transformers.__version__.split(".")[0])
NO_CROP = re.compile(r"'\w*StaticLayer' object has no attribute 'crop'")


# mpt-kv: static_mpt.part


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
        returned = returned if returned is not None else out.past_key_values
        if returned is not cache:
            raise CannotRun(f"the forward returned a {type(returned).__name__}, not the StaticCache it was given")
        return out.logits

    # a batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0
    try:
        cache = static_cache(model, input_ids.shape[0])
    except Exception as e:
        raise CannotRun(f"this release's StaticCache cannot be made for MPT: {type(e).__name__}: {e}") from e
    with torch.no_grad():
        try:
            logits = forward(input_ids, mask, cache, 0)
        except CannotRun:
            raise
        except Exception as e:
            raise CannotRun(f"this release's MPT cannot run a StaticCache: the prefill raised {type(e).__name__}: "
                            f"{e}") from e
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = forward(logits[:, -1:].argmax(-1), mask, cache, 6)
        # the verification call: 4 candidate tokens of a draft model in one cached forward
        candidates = torch.randint(1, CONFIG["vocab_size"], (2, 4))
        mask = torch.cat([mask, torch.ones_like(candidates)], dim=1)
        logits = forward(candidates, mask, cache, 7)
    length, keep = 11, 8  # the first candidate accepted, 3 rejected
    how = f"cache.crop({keep - length})" if MAJOR >= 5 else f"cache.crop({keep})"  # 5.x: tokens to remove
    print(f"StaticCache(max_cache_len={MAX_CACHE_LEN}) holding {length} positions (6 prompt + 1 decoded + 4 "
          f"candidates); cropping the 3 rejected as this release's assisted decoding does: {how}")
    try:
        cache.crop(keep - length if MAJOR >= 5 else keep)
    except AttributeError as e:
        if NO_CROP.search(str(e)):
            print(f"the crop raised AttributeError: {e}")
            print("BUG: a StaticCache cannot crop (its layers have no crop): assisted decoding on a static cache "
                  "raises at its first verification")
            return 1
        raise CannotRun(f"the crop raised another AttributeError: {e}") from e
    now = int(cache.get_seq_length())
    print(f"the crop ran: the cache now reports {now} positions")
    if now != keep:
        raise CannotRun(f"the crop returned but the cache holds {now} positions, not {keep}")
    print("OK: the StaticCache crops (to the kept positions)")
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
