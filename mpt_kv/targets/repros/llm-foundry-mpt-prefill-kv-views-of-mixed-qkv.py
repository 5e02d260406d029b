"""Standalone reproduction: llm-foundry MPT's prefill caches K and V as views of the Wqkv output (the seed bug).

On attn_impl="torch", scaled_multihead_dot_product_attention (llmfoundry/models/layers/attention.py, 0.22.0
lines 136-151) rearranges the key and value, slices of qkv.split(...) of the Wqkv output (get_qkv, :781-789),
into (b, h, d, s) and (b, h, s, d) views and, on the first call, stores them as the cache as they are
(past_key_value = (k, v)): every layer's cache pins the whole fused (b, s, 3 d_model) buffer, its q third
included, until the first decode step's torch.cat copies. The script prefills a tiny llm-foundry MPT with
use_cache=True, as generate's first step does, and compares each cached tensor's storage with the Wqkv
output of its layer. Needs torch, transformers and llm-foundry's files (no training stack). Exit status:
1 the bug is there, 0 it is not, 2 the experiment could not run.
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

CALL = ("AutoModelForCausalLM.from_pretrained('mosaicml/mpt-7b', trust_remote_code=True).generate(..., "
        "use_cache=True): from the prefill until the first decode step")
FIX = ("copy the first K/V into the cache (k.contiguous() / v.contiguous() of the rearranged views, or clone()) in "
       "scaled_multihead_dot_product_attention when past_key_value is empty")
UPSTREAM = 'llm-foundry 0.22.0 llmfoundry/models/layers/attention.py:136-151 (scaled_multihead_dot_product_attention stores the rearranged views as the first cache entry) and :781-789 (get_qkv: qkv.split of the Wqkv output)'
WHAT = "K and V view `Wqkv`'s output"
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
    outputs = {}
    for i, block in enumerate(model.transformer.blocks):
        block.attn.Wqkv.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 6))
    with torch.no_grad():
        inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        past = model(**inputs).past_key_values
    pinned = 0
    for i, (k, v) in enumerate(past):
        storage = outputs[i].untyped_storage()
        views = [n for n, t in (("key", k), ("value", v)) if t.untyped_storage().data_ptr() == storage.data_ptr()]
        extra = storage.nbytes() - sum(t.numel() * t.element_size() for t in (k, v) if t.untyped_storage().data_ptr()
                                       == storage.data_ptr())
        print(f"layer {i}: key {tuple(k.shape)} (stored (b, h, d, s)), value {tuple(v.shape)}: "
              + (f"{' and '.join(views)} view the Wqkv output {tuple(outputs[i].shape)}, {storage.nbytes()} bytes: "
                 f"{extra} bytes pinned beyond the cache" if views else "own storage"))
        pinned += extra if views else 0
    if pinned:
        print(f"BUG: the cache pins {pinned} bytes of the Wqkv outputs beyond itself (at mpt-7b, bf16, batch 16 x 1024 "
              "tokens: 4.00 GiB, the q third of every layer)")
        return 1
    print("OK: no cached K/V views the Wqkv output")
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
