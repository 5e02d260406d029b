"""MiniCPM3: multi-head latent attention as deepseek_v2's (a low-rank query, and one fused
projection, `kv_a_proj_with_mqa`, making each token's compressed latent (kv_lora_rank) and its
shared rotary key part (qk_rope_head_dim) in one output), dense MLPs. The architecture's cache is
that latent and rope part; the tiny latent (4) is smaller than the head dim (8 + 4).

transformers ships MiniCPM3 only as Hub remote code (openbmb/MiniCPM3-4B, trust_remote_code):
optimum-habana 1.21.2 carries its own copy of those files (models/minicpm/), which is the model here
and its uncached forward the oracle (`Family.remote_code`). That copy, as the Hub's, caches the
expanded K (heads x (qk_nope + qk_rope)) and V (heads x hidden_size // heads) after `kv_b_proj`, not
the latent: a known excess kept as data (`stored_width`), the analytic bytes staying the latent's."""

from mpt_kv.families.base import Family, GaudiPort, NO_BUCKETS
from mpt_kv.families.deepseek_v2 import latent_width

PORT = "optimum.habana.transformers.models.minicpm"
TINY = {"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
        "max_position_embeddings": 64}


def expanded_kv(config) -> int:
    """The elements per token per layer the port caches: K of every head (qk_nope + qk_rope) and V
    of every head, whose width the attention takes from hidden_size // heads, not v_head_dim
    (optimum-habana 1.21.2 models/minicpm/modeling_minicpm.py:361 and :476-497)."""
    heads = config.num_attention_heads
    return heads * (config.qk_nope_head_dim + config.qk_rope_head_dim) + heads * (config.hidden_size // heads)


FAMILY = Family(
    name="minicpm", model_type="minicpm3", design="latent", fused="kv_a_proj_with_mqa", tiny=TINY,
    latent_width=latent_width, stored_width=expanded_kv,
    remote_code="openbmb/MiniCPM3-4B's modeling_minicpm.py", remote_config=f"{PORT}.configuration_minicpm:MiniCPM3Config",
    variants={"mla": {"kv_lora_rank": 4, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "q_lora_rank": 16}},
    # optimum-habana 1.21.2 models/minicpm/modeling_minicpm.py: imports habana_frameworks.torch.core and
    # FusedSDPA at module level (lines 27, 31); legacy per-layer (key, value) in and out (a DynamicCache
    # inside, line 1203); static: token_idx index_add_ (lines 878-886); no allocate_kv_cache (no
    # reuse_cache); its forward takes no **kwargs (line 1326). Its SDPA attention (what transformers
    # 4.55 picks: _supports_sdpa, line 1034) calls FusedSDPA with no CPU fallback (lines 31 and 903):
    # off an HPU, the kernel stand-in's
    gaudi=GaudiPort(module=f"{PORT}.modeling_minicpm", causal_lm="MiniCPM3ForCausalLM",
                    hf_module="transformers.models.minicpm3.modeling_minicpm3", standin=True, unsupported=NO_BUCKETS,
                    kernels=("FusedSDPA",)),
)
