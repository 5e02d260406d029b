"""owngqa as an mpt-kv family target: a Mistral-style model (GQA, a sliding window) through CallableRunner."""
import mpt_kv

from owngqa import OwnGqaConfig, OwnGqaForCausalLM


def build_model(config, state_dict, device, dtype):  # config: transformers' MistralConfig of the checks' tiny model
    model = OwnGqaForCausalLM(OwnGqaConfig(
        config.vocab_size, config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        config.num_hidden_layers, config.intermediate_size, config.sliding_window,
        config.rope_parameters["rope_theta"], config.rms_norm_eps, config.max_position_embeddings))
    model.load_state_dict(state_dict)
    model = model.to(device, dtype).eval()
    return mpt_kv.CallableRunner(
        model, device, cfg=config, name="owngqa",
        logits=lambda ids, mask: model(ids, attention_mask=mask)[0],
        new_cache=model.new_cache,  # (path, batch, max_len)
        step=lambda cache, ids, mask, position: model(ids, cache=cache, position=position, attention_mask=mask),
        kv=lambda cache: cache.kv(),
        crop=lambda cache, n: cache.crop(n),
        reorder=lambda cache, index: cache.reorder(index),
    )


build = mpt_kv.FamilyModel("mistral", build_model)
