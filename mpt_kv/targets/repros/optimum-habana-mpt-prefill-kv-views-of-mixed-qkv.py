"""Standalone reproduction: optimum-habana's Gaudi MPT caches the prefill's K/V as views of the fused Wqkv output (mixed_qkv), pinning its q third.

optimum-habana 1.7.3 to 1.12.1 (the seed bug): the attention's prefill stores past_key_value =
(key_states, value_states), which are views of mixed_qkv, the fused Wqkv projection's output
(gaudi_mpt_attention_forward, models/mpt/modeling_mpt.py). A view keeps its whole storage alive,
so each layer pins the whole (B, S, 3D) buffer, q third included, for the whole generation, on
the concat path (no token_idx) and the static path (token_idx). optimum-habana #1158 (1.13.0)
allocates the first K/V and copies into them; 1.14.0 clones them. The script loads
optimum-habana's MPT module alone on CPU, replays what the installed release's
adapt_transformers_to_gaudi does for MPT (parsed from its own modeling_utils.py: 1.7.3 to 1.13
set functions on transformers' classes, 1.14 and later replace the classes), hooks Wqkv during
the prefill, and checks, on both paths, whether a cached K or V lies in a Wqkv output's storage.
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in 1.7.3 to 1.12.1, copies from 1.13.2 on.
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

CALL = ("model.generate(...) of optimum-habana's MPT on Gaudi, static shapes on (token_idx) or off: its prefill "
        "(first forward with use_cache=True)")
FIX = ("store copies of the first K/V (key_states.clone(), value_states.clone(), as 1.14.0 does), never views of "
       "mixed_qkv")
MAX_LEN = 16  # the static path's padded length (prompt 6 + max_new_tokens 10)

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


# mpt-kv: port_loader.part


def storage(tensor) -> tuple[int, int]:
    """(address, bytes) of the storage a tensor views."""
    return tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()


def prefill(model, input_ids, attention_mask, path: str):
    """generate's first forward on `path`: "concat" (static shapes off: no token_idx) or "static"
    (the prompt and its mask padded to MAX_LEN, token_idx = the prompt's length). Wqkv's outputs
    are kept (alive, so no address is reused) by a forward hook. (the returned cache, Wqkv's outputs)"""
    kwargs = {}
    if path == "static":
        prompt = input_ids.shape[1]
        input_ids = torch.nn.functional.pad(input_ids, (0, MAX_LEN - prompt))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, MAX_LEN - prompt))
        kwargs["token_idx"] = torch.tensor([prompt])
    fused = []
    hooks = [block.attn.Wqkv.register_forward_hook(lambda module, args, output: fused.append(output))
             for block in model.transformer.blocks]
    try:
        with torch.no_grad():
            out = model(input_ids, attention_mask=attention_mask, past_key_values=None, use_cache=True, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return out.past_key_values, fused


def main() -> int:
    port, _ = setup()
    input_ids, attention_mask = prompts()
    model = gaudi_mpt(port, input_ids, attention_mask)
    paths = ["concat"] + (["static"] if "token_idx" in inspect.signature(model.forward).parameters else [])
    print(f"{type(model).__name__} ({model.dtype}), prompt {tuple(input_ids.shape)}, paths {paths}")
    seen = []
    for path in paths:
        cache, fused = prefill(model, input_ids, attention_mask, path)
        if len(fused) != len(model.transformer.blocks):
            print(f"cannot run the experiment: the Wqkv hook saw {len(fused)} outputs for "
                  f"{len(model.transformer.blocks)} layers")
            return 2
        outputs = dict(storage(t) for t in fused)
        print(f"path {path}: the prefill's Wqkv outputs: {[tuple(t.shape) for t in fused]}")
        for layer, (key, value) in enumerate(cache):
            views = [(name, t) for name, t in (("key", key), ("value", value)) if storage(t)[0] in outputs]
            if not views:
                print(f"  layer {layer}: cached key {tuple(key.shape)} and value {tuple(value.shape)} own their "
                      f"storage ({storage(key)[1]} + {storage(value)[1]} bytes): copies")
                continue
            held = sum(dict(storage(t) for _, t in views).values())
            own = sum(t.numel() * t.element_size() for _, t in views)
            print(f"  layer {layer}: cached " + " and ".join(f"{name} {tuple(t.shape)}" for name, t in views)
                  + f" view Wqkv's output: {held} bytes held for {own} bytes of K/V, {held - own} pinned beyond them")
            seen.append(f"{path} layer {layer}: {held - own} bytes pinned")
    if seen:
        print("BUG: the prefill caches views of mixed_qkv (Wqkv's output), pinning its q third: " + "; ".join(seen))
        return 1
    print("OK: the prefill's cached K/V are copies, none lies in Wqkv's output")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
