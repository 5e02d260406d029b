"""ownmpt as an mpt-kv target: its own forward signature and caches, through mpt_kv.CallableRunner."""
from mpt_kv import CallableRunner

from ownmpt import OwnMptConfig, OwnMptForCausalLM


def build(cfg, state_dict, device, dtype):
    model = OwnMptForCausalLM(OwnMptConfig(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len,
                                           cfg.alibi_bias_max, cfg.layer_norm_epsilon, cfg.clip_qkv))
    model.load_state_dict(state_dict)
    model = model.to(device, dtype).eval()
    return CallableRunner(
        model, device, name="ownmpt",
        logits=lambda ids, mask: model(ids, attention_mask=mask)[0],
        new_cache=model.new_cache,  # (path, batch, max_len)
        step=lambda cache, ids, mask, position: model(ids, past=cache, position=position, attention_mask=mask),
        kv=lambda cache: cache.kv(),
        crop=lambda cache, n: cache.crop(n),
        reorder=lambda cache, index: cache.reorder(index),
    )
