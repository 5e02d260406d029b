"""Standalone reproduction: optimum-habana's Gaudi MPT, bucketed cache (cache_idx, bucket_internal): a decode step attends never-written torch.empty slots, so garbage there (NaN) makes its logits NaN.

With bucket_internal the prefill allocates each layer's K/V cache with torch.empty (optimum-habana
1.21.2 optimum/habana/transformers/models/mpt/modeling_mpt.py:100-107, kv_cache_len slots) and
writes the prompt's slots only; each decode step then attends over slots [0, cache_idx), cache_idx
rounded up to a bucket, never-written slots included (modeling_mpt.py:89-91). The mask hides them
from the softmax, but they still meet the second matmul, attn_weights @ value_states, as 0 * v:
whatever fresh memory held there reaches the output, and 0 * NaN = NaN. Memory from torch.empty
holds anything; to make that deterministic the script patches torch.empty within the port's
module (and nowhere else) during the prefill to return NaN-filled tensors, then makes one
bucketed decode step as generate does, and looks at its logits. A control run fills the same
memory with zeros: its logits must be finite (the NaN then comes from the unwritten slots alone).
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug from 1.14.1 (the first with cache_idx; 1.14 to 1.16 run in bf16, their attention's
softmax is bf16 only) to 1.21.2.
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

CALL = "model.generate(..., static_shapes=True, bucket_size=..., bucket_internal=True) (optimum-habana's MPT on Gaudi)"
FIX = ("allocate the bucketed cache with torch.zeros (as transformers' StaticCache does), or attend only over the "
       "written slots [0, token_idx)")
MAX_LEN = 16  # kv_cache_len: the prompt padded by static shapes (6 + max_new_tokens 10)
BUCKET = 4    # bucket_size: the decode at token_idx 7 attends slots [0, 8), slot 7 never written

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


# mpt-kv: port_loader.part


class FreshMemory(types.ModuleType):
    """torch as the port's module sees it while it is installed as that module's `torch`: every
    name is torch's, but torch.empty returns tensors filled with `fill` (what fresh device memory
    may hold, made deterministic); each allocation is recorded."""

    def __init__(self, fill: float):
        super().__init__("torch")
        self.fill, self.allocated = fill, []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        tensor = torch.empty(*args, **kwargs).fill_(self.fill)
        self.allocated.append(tuple(tensor.shape))
        return tensor


def bucketed_decode(port, model, input_ids, attention_mask, fill: float):
    """generate's calls with static_shapes, bucket_size=BUCKET, bucket_internal=True (optimum-habana's
    prepare_inputs_for_generation and _update_model_kwargs_for_generation): the prefill with the
    unpadded prompt at token_idx = cache_idx = its length, every block's attn.kv_cache_len = MAX_LEN;
    then one decode step at token_idx = prompt + 1 over the mask's first cache_idx columns.
    torch.empty within the port returns `fill` during the prefill. (prefill logits, decode logits,
    cache, allocations, cache_idx)"""
    prompt = input_ids.shape[1]
    for block in model.transformer.blocks:
        block.attn.kv_cache_len = MAX_LEN
    fresh, saved = FreshMemory(fill), port.torch
    port.torch = fresh  # within the port's module only
    try:
        with torch.no_grad():
            out = model(input_ids, attention_mask=attention_mask, past_key_values=None, use_cache=True,
                        token_idx=torch.tensor([prompt]), cache_idx=torch.tensor([prompt]))
    finally:
        port.torch = saved
    prefill = out.logits
    mask = torch.nn.functional.pad(attention_mask, (0, MAX_LEN - prompt))  # static shapes: padded to MAX_LEN
    mask[:, prompt] = 1  # the decode's token
    token_idx = prompt + 1
    cache_idx = ((token_idx - 1) // BUCKET + 1) * BUCKET  # generate's bucket_internal cache_idx
    token = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        out = model(token, attention_mask=mask[:, :cache_idx], past_key_values=out.past_key_values, use_cache=True,
                    token_idx=torch.tensor([token_idx]), cache_idx=cache_idx)
    return prefill, out.logits, out.past_key_values, fresh.allocated, cache_idx


def main() -> int:
    port, _ = setup()
    input_ids, attention_mask = prompts()
    model = gaudi_mpt(port, input_ids, attention_mask)
    if "cache_idx" not in inspect.signature(model.forward).parameters:
        print("OK: this release's forward takes no cache_idx: it has no bucketed cache (buckets came in 1.14)")
        return 0
    prompt = input_ids.shape[1]
    print(f"{type(model).__name__} ({model.dtype}), kv_cache_len {MAX_LEN}, bucket_size {BUCKET}, "
          f"prompt {prompt} tokens")
    prefill, decode, cache, allocated, cache_idx = bucketed_decode(port, model, input_ids, attention_mask, float("nan"))
    print(f"prefill: the port allocated {len(allocated)} tensors with torch.empty {allocated[:2]}..., "
          f"filled with NaN here; it wrote slots [0, {prompt})")
    print(f"decode at token_idx {prompt + 1}, cache_idx {cache_idx}: attends slots [0, {cache_idx}), "
          f"slots [{prompt + 1}, {cache_idx}) never written")
    for layer, (key, value) in enumerate(cache):
        nan = [s for s in range(cache_idx) if torch.isnan(key[:, :, s]).any() or torch.isnan(value[:, :, s]).any()]
        print(f"  layer {layer}: slots of [0, {cache_idx}) holding NaN after the decode: {nan}"
              + (f" (slot {prompt}: the decode's K/V, made from the layer below's NaN output)"
                 if prompt in nan else ""))
    bad_prefill = (~torch.isfinite(prefill.float())).sum().item()
    bad = (~torch.isfinite(decode.float())).sum().item()
    print(f"prefill logits: {bad_prefill} of {prefill.numel()} not finite; "
          f"decode logits: {bad} of {decode.numel()} not finite")
    _, control, _, _, _ = bucketed_decode(port, model, input_ids, attention_mask, 0.0)
    bad_control = (~torch.isfinite(control.float())).sum().item()
    print(f"control, the same memory zero-filled: decode logits {bad_control} of {control.numel()} not finite")
    if bad_prefill or bad_control:
        print("cannot run the experiment: logits are NaN/inf without NaN in the never-written slots: not this finding")
        return 2
    if bad and allocated:
        print(f"BUG: the bucketed decode's logits are NaN: the never-written torch.empty slots "
              f"[{prompt + 1}, {cache_idx}) reach attn_weights @ value_states as 0 * NaN")
        return 1
    print("OK: the bucketed decode's logits are finite with NaN in fresh memory"
          + ("" if allocated else " (the port allocates no cache with torch.empty)"))
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
