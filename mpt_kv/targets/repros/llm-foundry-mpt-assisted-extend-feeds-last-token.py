"""Standalone reproduction: llm-foundry MPT cannot run assisted decoding: its prepare_inputs_for_generation feeds only the last of the candidate tokens.

With a cache, MPTForCausalLM.prepare_inputs_for_generation keeps input_ids[:, -1] only
(llmfoundry/models/mpt/modeling_mpt.py, 0.22.0 line 1387-1388: "only last token for inputs_ids if past is
defined"). Assisted decoding (generate(..., assistant_model=...) or prompt_lookup_num_tokens=...) verifies
k candidate tokens in one call (transformers 4.51 generation/utils.py _assisted_decoding: prepare_inputs_for
_generation(candidate_input_ids, ...), then outputs.logits[:, -candidate_length - 1:]): the model sees one
token with a mask k positions longer than its cache, and the forward raises (the key padding mask's view,
attention.py:196, or the attention bias check, :181-184). The script asks the model's own
prepare_inputs_for_generation for a 3-token verification call on a filled cache, then runs generate with
prompt_lookup_num_tokens=3. Needs torch, transformers and llm-foundry's files (no training stack). Exit
status: 1 the bug is there, 0 it is not, 2 the experiment could not run.
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
        "prompt_lookup_num_tokens=3) or generate(..., assistant_model=...): the first verification call")
FIX = ("in prepare_inputs_for_generation keep the tokens the cache does not hold yet, "
       "input_ids[:, past_key_values[0][1].shape[2]:] (the value's sequence dimension on attn_impl torch), not "
       "input_ids[:, -1:]")
UPSTREAM = 'llm-foundry 0.22.0 llmfoundry/models/mpt/modeling_mpt.py:1387-1388 (prepare_inputs_for_generation: input_ids[:, -1] once a cache exists); the forward raises at llmfoundry/models/layers/attention.py:196-199 or :181-184'
WHAT = "`the target's extend raised RuntimeError: shape '[...]' is invalid for input of size N` (only the last candidate is fed)"
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
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        past = model(ids, attention_mask=mask, use_cache=True).past_key_values
        candidates = torch.tensor([[3, 4, 1]])
        fed = model.prepare_inputs_for_generation(torch.cat([ids, candidates], 1), past_key_values=past,
                                                  attention_mask=torch.ones(1, 13, dtype=torch.long))["input_ids"]
        print(f"a 3-token verification call on a cache of 10 positions feeds {fed.shape[1]} token(s): {fed.tolist()}")
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3)
            print("generate(..., prompt_lookup_num_tokens=3) ran")
        except Exception as e:
            print(f"generate(..., prompt_lookup_num_tokens=3) raised {type(e).__name__}: {e}")
    if fed.shape[1] != 3:
        print("BUG: the verification call's candidates are dropped: assisted decoding cannot run on this model")
        return 1
    print("OK: the verification call feeds every candidate")
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
