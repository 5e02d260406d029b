"""Standalone reproduction: optimum-habana's assisted decoding crops MPT's tuple cache by slicing, so the rejected candidates' K/V stay allocated.

optimum-habana up to 1.19.x, assisted decoding: after the model verifies the candidate tokens,
_assisted_decoding crops the cache with transformers' _crop_past_key_values(self,
outputs.past_key_values, new_cache_size) (optimum/habana/transformers/generation/utils.py:4088 in
1.18.1; 1.11.1 runs transformers' own _assisted_decoding, which calls it). For the tuple cache
GaudiMptForCausalLM returns, that function slices every layer, past_key_values[idx][0][:, :, :max_length, :]
(transformers 4.51.3 generation/candidate_generator.py:1095-1106): a view, so every layer's K and V
keep the whole storage of the verification's torch.cat, rejected candidates included, until the next
torch.cat copies (one step). The script loads optimum-habana's MPT module alone on CPU, replays
adapt_transformers_to_gaudi's MPT lines, makes the calls of an assisted decoding on the concat path
(the prefill, a verification call of 4 tokens, the crop as the installed release's own
generation/utils.py crops, 3 candidates rejected) and compares the bytes the cropped cache's
storages hold with the surviving positions' own bytes. 1.20.0 and later crop with
outputs.past_key_values.crop(new_cur_len - 1) instead, which MPT's tuple cache does not have: no
slice is made there (that AttributeError is another finding's, the beam-reorder one's repro).
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in 1.7.3 to 1.19.1 (1.7.3 runs transformers 4.32's assisted decoding, which crops
the same way), not in 1.20.0 and 1.21.2.
Needs torch, transformers and optimum-habana (pip install --no-deps optimum-habana), no HPU.
Exit status: 1 the bug is there, 0 it is not, 2 the experiment could not run.
(Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import ast
import importlib
import importlib.metadata
import importlib.util
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

CALL = "model.generate(..., assistant_model=...) of optimum-habana's MPT (assisted decoding), static shapes off"
FIX = ("crop the tuple cache by copies, past_key_values[idx][0][:, :, :max_length, :].clone() (or give MPT a Cache "
       "whose crop copies)")
CANDIDATES = 3  # the draft's tokens; the verification call feeds the last token and the 3 candidates
ACCEPTED = 0    # none of them accepted

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


# mpt-kv: port_loader.part


def crop_route(root: Path) -> str:
    """How the installed release's _assisted_decoding crops the cache, from its own
    generation/utils.py: "function" (transformers' _crop_past_key_values(self,
    outputs.past_key_values, new_cache_size), 1.12 to 1.19; a release whose file crops nowhere, as
    1.7.3 or 1.11.1, runs transformers' own assisted decoding, which calls it) or "method"
    (outputs.past_key_values.crop(new_cur_len - 1), 1.20 and later)."""
    source = (root / "transformers" / "generation" / "utils.py").read_text(encoding="utf-8")
    if "_crop_past_key_values(self, outputs.past_key_values" in source:
        return "function"
    return "method" if ".past_key_values.crop(" in source else "function"


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def cached_tensors(cache):
    """Each layer's cached (key, value): the port's tuple of [key, value], or a Cache object's."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [tuple(layer[:2]) for layer in cache]


def main() -> int:
    port, root = setup()
    input_ids, attention_mask = prompts()
    model = gaudi_mpt(port, input_ids, attention_mask)
    route = crop_route(root)
    prompt, verified = input_ids.shape[1], 1 + CANDIDATES
    keep = prompt + 1 + ACCEPTED  # new_cache_size = new_cur_len - 1: the prompt, the pending token, the accepted
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, past_key_values=None, use_cache=True)
    print(f"{type(model).__name__} ({model.dtype}), concat path (static shapes off): prefill of {prompt} tokens")
    if route == "method" and not hasattr(out.past_key_values, "crop"):
        try:
            out.past_key_values.crop(keep)
        except AttributeError as e:
            print(f"this release crops with outputs.past_key_values.crop(new_cur_len - 1), and the port's cache is a "
                  f"{type(out.past_key_values).__name__}: AttributeError: {e}")
        print("OK: no slicing crop runs in this release (the crop itself fails: a different finding, "
              "optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache), so nothing cropped is kept")
        return 0
    # the verification: the pending token and the candidates in one cached call (static shapes off)
    tokens = torch.randint(1, CONFIG["vocab_size"], (input_ids.shape[0], verified))
    mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], verified)], dim=1)
    with torch.no_grad():
        out = model(tokens, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
    print(f"verification of {verified} tokens (the pending one and {CANDIDATES} candidates): the cache holds "
          f"{cached_tensors(out.past_key_values)[0][0].shape[2]} positions; {CANDIDATES - ACCEPTED} candidates "
          f"rejected, so the crop keeps {keep}")
    verified_tensors = [t for kv in cached_tensors(out.past_key_values) for t in kv]
    slack = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in verified_tensors}.values()) \
        - sum(tensor_bytes(t) for t in verified_tensors)
    print(f"  before the crop the cache's storages hold {slack} bytes beyond its K/V")
    if route == "function":
        try:
            from transformers.generation.candidate_generator import _crop_past_key_values
        except ImportError:  # older transformers (4.32, optimum-habana 1.7.3's) keep it in generation/utils.py
            from transformers.generation.utils import _crop_past_key_values

        print("  crop: transformers' _crop_past_key_values(model, past_key_values, new_cache_size), as this release's "
              "assisted decoding")
        cropped = _crop_past_key_values(model, out.past_key_values, keep)
    else:
        print("  crop: past_key_values.crop(new_cur_len - 1), as this release's assisted decoding")
        out.past_key_values.crop(keep)
        cropped = out.past_key_values
    retained = 0
    for layer, kv in enumerate(cached_tensors(cropped)):
        for name, tensor in zip(("key", "value"), kv):
            held, own = tensor.untyped_storage().nbytes(), tensor_bytes(tensor)
            retained += held - own
            print(f"  layer {layer} {name} {tuple(tensor.shape)}: {own} bytes of K/V in a storage of {held} bytes "
                  f"({held - own} beyond the surviving positions)")
    survivors = sum(tensor_bytes(t) for kv in cached_tensors(cropped) for t in kv)
    print(f"after the crop: the surviving positions' K/V {survivors} bytes; "
          f"their storages {survivors + retained} bytes")
    retained -= slack  # what the crop left allocated, beyond what the cache held before it
    if retained > 0:
        print(f"BUG: the crop slices: {retained} bytes of the rejected candidates' K/V stay allocated "
              "(until the next torch.cat copies)")
        return 1
    print("OK: the crop copies the surviving positions: nothing cropped is kept")
    return 0

if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
