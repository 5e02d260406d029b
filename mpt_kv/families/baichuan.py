"""Baichuan (Baichuan2): one fused `W_pack` projection split into q, k, v (the seed bug class);
ALiBi (13B: its config has no max_position_embeddings), MHA. (The 7B layout, rotary, is not run off
an HPU: the port's CPU RoPE branch ignores position_ids, modeling_baichuan.py:243-249, and every
forward raises a shape error there.)

transformers ships Baichuan only as Hub remote code (baichuan-inc/Baichuan2-*, trust_remote_code):
optimum-habana 1.21.2 carries its own copy of those files (models/baichuan/), which is the model
here and its uncached forward the oracle (`Family.remote_code`)."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS, self_attn_kv_caches

PORT = "optimum.habana.transformers.models.baichuan"
TINY = {"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
        "model_max_length": 64}

FAMILY = Family(
    name="baichuan", model_type="baichuan", fused="W_pack", tiny=TINY,
    remote_code="baichuan-inc/Baichuan2-7B/13B's modeling_baichuan.py", remote_config=f"{PORT}.configuration_baichuan:BaichuanConfig",
    variants={"alibi": {}},
    # optimum-habana 1.21.2 models/baichuan/modeling_baichuan.py: imports habana_frameworks.torch.core
    # at module level; legacy per-layer (key, value); reuse_cache: allocate_kv_cache (line 340)
    gaudi=GaudiPort(module=f"{PORT}.modeling_baichuan", causal_lm="BaichuanForCausalLM",
                    hf_module="transformers.models.baichuan.modeling_baichuan", standin=True,
                    forward_kwargs=GENERATE_FORWARD_KWARGS, unsupported=NO_BUCKETS, reuse_cache=None,
                    reuse_kv=lambda m: [(b.self_attn.k_cache.cache, b.self_attn.v_cache.cache) for b in m.model.layers]),
)
