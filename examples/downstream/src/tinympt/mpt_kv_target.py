"""tinympt as an mpt-kv target: the factory mpt-kv calls with its config, weights, device, dtype."""
from mpt_kv import Capabilities, GaudiStyleRunner

from tinympt import TinyMptConfig, TinyMptForCausalLM


def build(cfg, state_dict, device, dtype):
    model = TinyMptForCausalLM(TinyMptConfig(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len,
                                             cfg.alibi_bias_max, cfg.layer_norm_epsilon))
    model.load_state_dict(state_dict)
    greedy = "tinympt generates greedily: no beam search or assisted decoding (its cache is a plain [key, value] list)"
    no_clip = Capabilities({"clip_qkv": "tinympt has no clip_qkv (none of our checkpoints uses it)",
                            "extend": greedy, "crop": greedy, "reorder": greedy})
    return GaudiStyleRunner(model.to(device, dtype).eval(), device, name="tinympt", capabilities=no_clip)
