"""ChatGLM (ChatGLM2/3): one fused `query_key_value` projection split into q, k and v (the seed bug
class), multi-query groups (`multi_query_group_num` K/V heads shared by the query heads), rotary on
half of each head. The tiny model has 4 query heads in 2 groups (GQA), head dim 8 (`kv_channels`).

transformers ships ChatGLM only as Hub remote code (THUDM/chatglm2-6b, chatglm3-6b, trust_remote_code):
optimum-habana 1.21.2 carries its own copy of those files (models/chatglm/), which is the model here
and its uncached forward the oracle (`Family.remote_code`). Its activations are (seq, batch, hidden),
as the Hub's, but its cache is not the Hub's (seq, batch, groups, head dim): the port permutes K and V
to (batch, groups, seq, head dim), copied out of the fused output, before it caches them
(modeling_chatglm.py:603-605), the layout every check reads."""

from mpt_kv.families.base import Family, GENERATE_FORWARD_KWARGS, GaudiPort, NO_BUCKETS

PORT = "optimum.habana.transformers.models.chatglm"
TINY = {"padded_vocab_size": 128, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "kv_channels": 8,
        "ffn_hidden_size": 64, "seq_length": 64, "original_rope": True}


def kv_heads(c) -> int:
    return c.multi_query_group_num if c.multi_query_attention else c.num_attention_heads


def reuse_kv(model) -> list[tuple]:
    """With reuse_cache the port returns only shapes; its cache is each attention's KVCache."""
    return [(b.self_attention.k_cache.cache, b.self_attention.v_cache.cache) for b in model.transformer.encoder.layers]


FAMILY = Family(
    name="chatglm", model_type="chatglm", fused="query_key_value", tiny=TINY, design="full+mq-groups",
    kv_heads=kv_heads, head_dim=lambda c: c.kv_channels, layers=lambda c: c.num_layers,
    remote_code="THUDM/chatglm2-6b's and chatglm3-6b's modeling_chatglm.py",
    remote_config=f"{PORT}.configuration_chatglm:ChatGLMConfig",
    variants={"mq-groups2": {"multi_query_attention": True, "multi_query_group_num": 2}},
    # optimum-habana 1.21.2 models/chatglm/modeling_chatglm.py: imports habana_frameworks.torch.core at
    # module level (line 27); legacy per-layer (key, value): concat torch.cat, static token_idx
    # index_copy_ (KVCache.update, line 168); reuse_cache: allocate_kv_cache (line 497) and each
    # attention's k_cache/v_cache
    gaudi=GaudiPort(module=f"{PORT}.modeling_chatglm", causal_lm="ChatGLMForConditionalGeneration",
                    hf_module="transformers.models.chatglm.modeling_chatglm", standin=True,
                    forward_kwargs=GENERATE_FORWARD_KWARGS, unsupported=NO_BUCKETS, reuse_cache=None,
                    reuse_kv=reuse_kv),
)
