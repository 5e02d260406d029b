"""Standalone reproduction: assisted decoding's crop cuts llm-foundry MPT's transposed key along head_dim, not its positions.

On attn_impl="torch" llm-foundry stores the key transposed, (b, h, d, s) (llmfoundry/models/layers/
attention.py, 0.22.0 line 137; the comment at :141-146 says so). After rejected candidates, transformers'
assisted decoding crops a legacy tuple cache with _crop_past_key_values(model, past_key_values, n)
(4.51 generation/candidate_generator.py:1095-1106), which slices [:, :, :n, :] for every model but
bloom and gptbigcode: the key keeps every position and loses head dimensions past n, the value is cut to n
positions as a slice (its cropped tail stays allocated). The script prefills and decodes a tiny llm-foundry
MPT, crops its cache to 5 positions as assisted decoding does, and reads the shapes and storages. Needs
torch, transformers and llm-foundry's files (no training stack). Exit status: 1 the bug is there, 0 it is
not, 2 the experiment could not run.
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
        "assistant_model=...): after every verification call that rejects a candidate")
FIX = ("llm-foundry: define the crop for its layout (or return a Cache whose crop slices the key's last dimension); "
       "transformers: slice each tensor along the model's sequence dimension, not dimension 2, or refuse a legacy "
       "cache whose layout it does not know")
UPSTREAM = "transformers 4.51.3 generation/candidate_generator.py:1095-1106 (_crop_past_key_values slices [:, :, :n, :]) on llm-foundry 0.22.0's (b, h, d, s) key, llmfoundry/models/layers/attention.py:137"
WHAT = "the crop cuts the transposed key's head_dim and keeps every position; the value's cropped tail stays allocated"
CONFIG = {"vocab_size": 64, "n_layers": 2, "d_model": 64, "n_heads": 4, "max_seq_len": 32}


class CannotRun(Exception):
    pass


# mpt-kv: foundry_loader.part


def versions() -> str:
    from importlib.metadata import version
    return f"llm-foundry {version('llm-foundry')}, torch {torch.__version__}, transformers {transformers.__version__}"


def main() -> int:
    try:
        from transformers.generation.candidate_generator import _crop_past_key_values
    except ImportError:
        try:  # before 4.35 it lived beside _assisted_decoding
            from transformers.generation.utils import _crop_past_key_values
        except ImportError as e:
            raise CannotRun(f"this transformers has no _crop_past_key_values: {e}")
    modeling, configuration = load_foundry()
    model = tiny_mpt(modeling, configuration)
    print(versions())
    head_dim = CONFIG["d_model"] // CONFIG["n_heads"]
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 6))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        past = model(ids, attention_mask=mask, use_cache=True).past_key_values
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        past = model(ids[:, -1:], attention_mask=mask, past_key_values=past, use_cache=True).past_key_values
    n = 5
    k, v = past[0]
    print(f"before the crop: key {tuple(k.shape)} (b, h, d, s), value {tuple(v.shape)} (b, h, s, d): 7 positions")
    cropped = _crop_past_key_values(model, past, n)
    k, v = cropped[0]
    print(f"after _crop_past_key_values(model, past, {n}): key {tuple(k.shape)}, value {tuple(v.shape)}; the value's "
          f"storage {v.untyped_storage().nbytes()} bytes for {v.numel() * v.element_size()} held")
    if k.shape[3] != n or k.shape[2] != head_dim:
        print(f"BUG: the key was cut along head_dim ({k.shape[2]} of {head_dim} kept) and keeps {k.shape[3]} positions "
              f"instead of {n}: the next call attends over positions the value no longer has (or raises)")
        return 1
    print("OK: the key and the value keep the first n positions")
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
