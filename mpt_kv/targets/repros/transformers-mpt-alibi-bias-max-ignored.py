"""Standalone reproduction: transformers MPT ignores the config's alibi_bias_max (ALiBi slopes always for 8).

MptModel.forward builds its ALiBi table with build_mpt_alibi_tensor(num_heads, max_seq_len, device)
and never passes attn_config.alibi_bias_max, so the default 8 is used whatever the config says
(5.24 models/mpt/modeling_mpt.py:320; 4.55.4 :377). The script builds two tiny MPTs with the same
weights, one with alibi_bias_max=16 and one with 8: their logits must differ (the slopes
2^(-alibi_bias_max * i / n_heads) differ for every head), and are equal where the value is ignored.
Needs only torch and transformers. Exit status: 1 the bug is there, 0 it is not, 2 the experiment
could not run. (Kept in mpt-kv: python -m mpt_kv findings --repro DIR writes it)
"""

import sys
import traceback

try:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, MptConfig
except ImportError as e:  # fail closed: an experiment that did not run must not read as "fixed"
    print(f"cannot run the experiment: {e}")
    sys.exit(2)

CALL = ("any forward of an MPT whose config sets attn_config['alibi_bias_max'] to other than 8 - "
        "model.generate(...), cached or not")
FIX = ("pass alibi_bias_max=self.config.attn_config.alibi_bias_max to build_mpt_alibi_tensor in "
       "MptModel.forward")
# A tiny MPT: the bug does not depend on the size, only on the code path
CONFIG = {"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}


def model_with(alibi_bias_max: int):
    torch.manual_seed(0)
    config = MptConfig(**CONFIG, attn_config={"alibi": True, "alibi_bias_max": alibi_bias_max})
    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    except TypeError:  # before transformers 4.36 there is no attn_implementation: eager is the only one
        return AutoModelForCausalLM.from_config(config).eval()


def main() -> int:
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    wide, default = model_with(16), model_with(8)
    default.load_state_dict(wide.state_dict())  # the same weights: only the config's value differs
    assert wide.config.attn_config.alibi_bias_max == 16 and default.config.attn_config.alibi_bias_max == 8
    # a batch of 2 prompts of 6 tokens, the first left-padded by 2, as generate sees them
    input_ids = torch.randint(1, CONFIG["vocab_size"], (2, 6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0
    with torch.no_grad():
        logits = [m(input_ids, attention_mask=attention_mask, use_cache=False).logits for m in (wide, default)]
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
    except Exception:  # fail closed: a crash is not the bug this script looks for
        traceback.print_exc()
        print("cannot run the experiment (see the error above)")
        status = 2
    sys.exit(status)
