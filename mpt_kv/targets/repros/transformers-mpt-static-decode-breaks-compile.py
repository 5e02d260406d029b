"""Standalone reproduction: transformers MPT's static-cache decode step does not compile as one graph.

MptAttention.forward computes query_length = seq_length + cache.get_seq_length(), and a
StaticCache's get_seq_length() is a device tensor (its filled slots counted); `position_bias_query_index
= max(0, position_bias.size(1) - query_length)` (5.24 models/mpt/modeling_mpt.py:118) then slices the
ALiBi bias with a data-dependent index (line 121). torch.compile(fullgraph=True) cannot hold that in one
graph: dynamo raises there. transformers' generate compiles a static cache's decode step by itself on
CUDA (CompileConfig: fullgraph=False), and then splits it into several graphs and recompiles instead;
a CUDA graph of the whole step cannot be captured (the host reads the position every layer). The
script prefills a tiny MPT into a StaticCache eagerly, then compiles the model's forward with
fullgraph=True, dynamic=False and the "aot_eager" backend (dynamo and AOT autograd, no code
generation: what any backend sees) and runs one decode step with the mask over the whole cache, as
generate hands a compileable cache's forward. Needs only torch and transformers. Exit status: 1 the
bug is there (dynamo fails in transformers' MPT attention), 0 it is not (the compiled step equals the
eager one), 2 the experiment could not run (among others where the release's MPT cannot run a
StaticCache at all, or torch has no torch.compile).
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import inspect
import os
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

CALL = ("model.generate(..., cache_implementation='static', compile_config=CompileConfig(fullgraph=True)) raises; "
        "with the default CompileConfig (fullgraph=False, which generate applies by itself on CUDA) every static "
        "decode step runs as several graphs with recompiles, and no CUDA graph holds the whole step")
FIX = ("compute position_bias_query_index from shapes (the ALiBi bias has one query row) or on the device, not "
       "max() of cache.get_seq_length()'s tensor: the decode step then has no data-dependent index")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
MAX_CACHE_LEN = 16
MAJOR = int(transformers.__version__.split(".")[0])
MPT_ATTENTION = os.path.join("models", "mpt", "modeling_mpt.py")


# mpt-kv: static_mpt.part


def innermost_user_frame(error: BaseException):
    """(file, line) of the innermost frame dynamo lists under "from user code:", or None."""
    text = str(error)
    if "from user code:" not in text:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+)', text.split("from user code:", 1)[1])
    return (frames[-1][0], int(frames[-1][1])) if frames else None


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if not hasattr(torch, "compile"):
        raise CannotRun(f"torch {torch.__version__} has no torch.compile")
    model = tiny_mpt()
    parameters = inspect.signature(model.forward).parameters
    keyword = "cache" if "cache" in parameters else "past_key_values"

    def forward(step_forward, tokens, mask, cache, position):
        kw = {keyword: cache}
        if "cache_position" in parameters:  # 4.x: the positions written, as generate passes them
            kw["cache_position"] = torch.arange(position, position + tokens.shape[1])
        return step_forward(tokens, attention_mask=mask, use_cache=True, **kw).logits

    # a batch of 2 prompts of 6 tokens, the first left-padded by 2; the mask spans the whole cache
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    mask = torch.zeros(2, MAX_CACHE_LEN, dtype=torch.long)
    mask[:, :6] = 1
    mask[0, :2] = 0
    caches = []
    with torch.no_grad():
        for _ in range(2):  # one cache for the eager step, one for the compiled step
            try:
                cache = static_cache(model, input_ids.shape[0])
                logits = forward(model.forward, input_ids, mask[:, :6], cache, 0)
            except Exception as e:
                raise CannotRun(f"this release's MPT cannot run a StaticCache: the prefill raised "
                                f"{type(e).__name__}: {e}") from e
            caches.append(cache)
        token = logits[:, -1:].argmax(-1)
        mask[:, 6] = 1
        want = forward(model.forward, token, mask, caches[0], 6)
        compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
        try:
            got = forward(compiled, token, mask, caches[1], 6)
        except Exception as e:  # noqa: BLE001  dynamo's verdict on the decode step
            where = innermost_user_frame(e)
            first = " ".join(str(e).split("from user code:")[0].split())[:300]
            print(f"torch.compile(model.forward, fullgraph=True, dynamic=False, backend='aot_eager') on one static "
                  f"decode step raised {type(e).__name__}: {first}")
            if where and where[0].endswith(MPT_ATTENTION):
                print(f"  where: transformers/{MPT_ATTENTION.replace(os.sep, '/')}:{where[1]}: "
                      f"{open(where[0]).read().splitlines()[where[1] - 1].strip()}")
                print("BUG: the static decode step does not compile as one graph: dynamo fails in MPT's attention")
                return 1
            raise CannotRun(f"the compile failed outside MPT's attention ({where}): not this bug") from e
        finally:
            torch._dynamo.reset()
    diff = (got - want).abs().max().item()
    print(f"the compiled decode step ran as one graph; its logits are {diff:.3g} from the eager step's")
    if diff > 1e-4 * max(1.0, want.abs().max().item()):
        raise CannotRun(f"the compiled step's logits differ from the eager step's by {diff:.3g}: another bug")
    print("OK: the static decode step compiles as one graph and equals the eager step")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except CannotRun as e:  # fail closed: no static decode step was compiled, so none can be called clean
        print(f"cannot run the experiment: {e}")
        status = 2
    except Exception:  # fail closed: a crash is not the bug this script looks for
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
