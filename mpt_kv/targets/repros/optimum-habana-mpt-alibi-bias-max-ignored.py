"""Standalone reproduction: optimum-habana's Gaudi MPT ignores the config's alibi_bias_max (ALiBi slopes always for 8).

GaudiMptModel.forward builds its ALiBi table with self.build_mpt_alibi_tensor(self.num_heads,
self.config.max_seq_len, device=...) and never passes attn_config.alibi_bias_max, so the default 8
is used whatever the config says (optimum-habana 1.21.2 optimum/habana/transformers/models/mpt/
modeling_mpt.py:285, as transformers' MptModel.forward, 4.55.4 line 377). The script loads
optimum-habana's MPT module alone on CPU, replays what adapt_transformers_to_gaudi does for MPT,
and builds two GaudiMptForCausalLM with the same weights, one with alibi_bias_max=16 and one with
8: their logits must differ (the slopes 2^(-alibi_bias_max * i / n_heads) differ for every head),
and are equal where the value is ignored.
Measured with this script on 1.7.3, 1.11.1, 1.12.1, 1.13.2 and the newest patch of each minor 1.14
to 1.21: the bug in every one.
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

CALL = ("any forward of optimum-habana's MPT (GaudiMptForCausalLM) whose config sets "
        "attn_config['alibi_bias_max'] to other than 8 - model.generate(...) on Gaudi, any path, cached or not")
FIX = ("pass alibi_bias_max=self.config.attn_config.alibi_bias_max to build_mpt_alibi_tensor in "
       "GaudiMptModel.forward")

PORT_MODULE = "optimum.habana.transformers.models.mpt.modeling_mpt"
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


# mpt-kv: port_loader.part


def main() -> int:
    port, _ = setup()
    input_ids, attention_mask = prompts()
    wide = gaudi_mpt(port, input_ids, attention_mask, alibi_bias_max=16)
    default = gaudi_mpt(port, input_ids, attention_mask, alibi_bias_max=8)
    default.load_state_dict(wide.state_dict())  # the same weights: only the config's value differs
    default.to(wide.dtype)
    assert wide.config.attn_config.alibi_bias_max == 16 and default.config.attn_config.alibi_bias_max == 8
    print(f"two {type(wide).__name__} ({wide.dtype}), the same weights, alibi_bias_max 16 and 8")
    with torch.no_grad():
        logits = [m(input_ids, attention_mask=attention_mask, use_cache=False).logits.float() for m in (wide, default)]
    real = attention_mask.bool()
    difference = (logits[0] - logits[1])[real].abs().max().item()
    print(f"max |logits(alibi_bias_max=16) - logits(alibi_bias_max=8)| at the real tokens: {difference:.3e}")
    if difference == 0.0:
        print("BUG: alibi_bias_max=16 gives the logits of alibi_bias_max=8: the config's value is ignored")
        return 1
    print("OK: alibi_bias_max changes the ALiBi slopes")
    return 0


if __name__ == "__main__":
    try:
        status = main()
    except Exception:  # fail closed: a missing package or another error is not a verdict
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
