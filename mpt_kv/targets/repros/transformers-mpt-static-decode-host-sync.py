"""Standalone reproduction: transformers MPT makes a host sync in every layer of a static-cache decode step.

MptAttention.forward computes query_length = seq_length + cache.get_seq_length(), and a
StaticCache's get_seq_length() is a device tensor (its filled slots counted), so
`position_bias_query_index = max(0, position_bias.size(1) - query_length)` (5.24
models/mpt/modeling_mpt.py:118) is bool() of a tensor: the host reads a scalar off the device in
every layer of every decode step, what a CUDA or HPU graph cannot hold and what stalls the host
eagerly. The script prefills a tiny MPT into a StaticCache and watches one decode step with a
TorchDispatchMode that records the scalar reads (aten.is_nonzero, aten._local_scalar_dense,
aten.item) and the line of transformers that made each. Needs only torch and transformers. Exit
status: 1 the bug is there, 0 it is not, 2 the experiment could not run (among others where the
release's MPT cannot run a StaticCache at all: no static decode step to watch).
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import linecache
import os
import sys
import traceback

try:
    import torch
    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, MptConfig, StaticCache
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = ("model.generate(..., cache_implementation='static') (and any decode step with a StaticCache, the cache "
        "CUDA/HPU graphs and torch.compile need): every layer of every decode step")
FIX = ("compute position_bias_query_index from shapes (the ALiBi bias has one query row) or on the device, not "
       "max() of cache.get_seq_length()'s tensor")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAX_CACHE_LEN = 16
MAJOR = int(transformers.__version__.split(".")[0])
SCALAR_READS = ("aten.is_nonzero", "aten._local_scalar_dense", "aten.item")
TORCH = os.path.dirname(torch.__file__) + os.sep
TRANSFORMERS = os.path.dirname(transformers.__file__) + os.sep


# mpt-kv: static_mpt.part


class ScalarReads(TorchDispatchMode):
    """Records each scalar read off a tensor with the innermost frame outside torch (the line that
    asked for it)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in SCALAR_READS:
            frame = sys._getframe(1)
            while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(TORCH):
                frame = frame.f_back
            if frame is not None:
                code = frame.f_code
                where = (code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name))
            else:
                where = ("?", 0, "?")
            self.seen.append((name, where))
        return func(*args, **(kwargs or {}))


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
            logits, returned = forward(input_ids, mask, cache, 0)
        except Exception as e:
            raise CannotRun(f"this release's MPT cannot run a StaticCache: the prefill raised {type(e).__name__}: "
                            f"{e}") from e
        if returned is not cache:
            raise CannotRun(f"the prefill returned a {type(returned).__name__}, not the StaticCache it was given")
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        reads = ScalarReads()
        with reads:
            logits, returned = forward(logits[:, -1:].argmax(-1), mask, cache, input_ids.shape[1])
    if returned is not cache:
        raise CannotRun(f"the decode step returned a {type(returned).__name__}, not the StaticCache it was given")
    length = cache.get_seq_length()
    print(f"one decode step with a StaticCache(max_cache_len={MAX_CACHE_LEN}) after a 6-token prefill, "
          f"{CONFIG['n_layers']} layers (the cache's get_seq_length() returns {type(length).__name__} "
          f"{length!r}): {len(reads.seen)} scalar read(s) off a tensor")
    found = 0
    for op, (path, line, function) in reads.seen:
        inside = os.path.abspath(path).startswith(TRANSFORMERS)
        found += inside
        short = "transformers/" + os.path.relpath(path, TRANSFORMERS) if inside else path
        print(f"  {op} from {short}:{line} in {function}: {linecache.getline(path, line).strip()}")
    if found:
        print(f"BUG: the static decode step made {found} host sync(s) in transformers' code: the host waits for the "
              "device in every layer of every step")
        return 1
    print("OK: the static decode step made no host sync in transformers' code")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except CannotRun as e:  # fail closed: no static decode step ran, so none can be called clean
        print(f"cannot run the experiment: {e}")
        status = 2
    except Exception:  # fail closed: a crash is not the bug this script looks for
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
