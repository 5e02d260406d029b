"""MPT: fused `Wqkv`, ALiBi, no GQA in transformers' port."""

from mpt_kv.families.base import Family, GaudiPort
from mpt_kv.targets.gaudi import load_gaudi_mpt_module


def load_gaudi_mpt():
    """optimum-habana's MPT module, as the "optimum-habana" target loads it (mpt_kv/targets/gaudi.py)."""
    return load_gaudi_mpt_module()


FAMILY = Family(
    name="mpt", model_type="mpt", fused="Wqkv",
    tiny={"vocab_size": 128, "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64},
    variants={"alibi": {"attn_config": {"alibi": True}}},
    kv_heads=lambda c: c.n_heads, head_dim=lambda c: c.d_model // c.n_heads, layers=lambda c: c.n_layers,
    # optimum-habana 1.21.2 models/mpt/modeling_mpt.py: legacy [key, value] lists per layer,
    # token_idx writes with index_copy_ (line 86), cache_idx buckets over a cache the prefill
    # allocates kv_cache_len long (lines 100-105: what prepare_inputs_for_generation sets on
    # each attention), no reuse_cache (generate asserts it off for mpt, generation/utils.py:1420)
    gaudi=GaudiPort(module="optimum.habana.transformers.models.mpt.modeling_mpt", causal_lm="GaudiMptForCausalLM",
                    hf_module="transformers.models.mpt.modeling_mpt", load=load_gaudi_mpt,
                    blocks=lambda model: [block.attn for block in model.transformer.blocks],
                    reuse_cache="GaudiMptForCausalLM has no allocate_kv_cache, and optimum-habana's generate "
                                "asserts reuse_cache off for mpt (generation/utils.py:1420-1443)"),
)
