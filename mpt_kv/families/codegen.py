"""CodeGen: fused `qkv_proj` split in 4 model-parallel groups, partial rotary."""

from mpt_kv.families.base import Family, GaudiPort

FAMILY = Family(
    name="codegen", model_type="codegen", fused="qkv_proj",
    tiny={"vocab_size": 128, "n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 64, "rotary_dim": 4},
    variants={"mha": {}},
    kv_heads=lambda c: c.n_head, head_dim=lambda c: c.n_embd // c.n_head, layers=lambda c: c.n_layer,
    # optimum-habana 1.21.2 models/codegen/modeling_codegen.py: every forward raises TypeError
    # (GaudiCodeGenAttention returns ((attn_output, present), attn_weights), line 100-102, and
    # gaudi_codegen_block_forward adds that tuple to a tensor, line 136): a known failure
    # (mpt_kv/findings/family_known_failures.json), not a gap of this entry
    gaudi=GaudiPort(module="optimum.habana.transformers.models.codegen.modeling_codegen",
                    causal_lm="GaudiCodeGenForCausalLM", hf_module="transformers.models.codegen.modeling_codegen"),
)
