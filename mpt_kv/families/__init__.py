"""The family registry: decoder architectures of transformers with a KV cache, checked with the
same properties as MPT (family-P1, family-P3 in `mpt_kv.checks.family`).

One module per family (as transformers' `models/<family>/`), each with one `FAMILY`; adding a
family is one small module and one line below (docs/families.md).
"""

from __future__ import annotations

from mpt_kv.families import (baichuan, bloom, chatglm, codegen, cohere, dbrx, decilm, deepseek_v2, deepseek_v3, falcon, gemma, gemma2,
                             gemma3,
                             gpt2, gpt_bigcode, gpt_neo, gpt_neox, gpt_oss, gptj, llama, minicpm, mistral, mixtral, mpt, opt,
                             persimmon, phi, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe, stablelm, starcoder2, xglm)
from mpt_kv.errors import Registry
from mpt_kv.families.base import TINY, Family

# FAMILIES["nosuch"] is an UnknownName (a KeyError) naming the known families
FAMILIES: dict[str, Family] = Registry("family", {f.name: f for f in (
    mpt.FAMILY,
    falcon.FAMILY,
    gpt_bigcode.FAMILY,
    bloom.FAMILY,
    gpt2.FAMILY,
    gpt_neox.FAMILY,
    codegen.FAMILY,
    persimmon.FAMILY,
    phi.FAMILY,
    phi3.FAMILY,
    llama.FAMILY,
    qwen2.FAMILY,
    mistral.FAMILY,
    starcoder2.FAMILY,
    gptj.FAMILY,
    stablelm.FAMILY,
    dbrx.FAMILY,
    # the Gaudi zoo (optimum-habana 1.21.2's text decoders): windows, hybrids, latents, experts
    gemma.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    mixtral.FAMILY,
    deepseek_v2.FAMILY,
    deepseek_v3.FAMILY,
    cohere.FAMILY,
    gpt_neo.FAMILY,
    gpt_oss.FAMILY,
    opt.FAMILY,
    xglm.FAMILY,
    # remote code: optimum-habana's own copy is the model and the oracle
    baichuan.FAMILY,
    decilm.FAMILY,
    chatglm.FAMILY,
    minicpm.FAMILY,
)})


def variants() -> list[tuple[str, str]]:
    """Every (family, variant) in the registry, in registry order."""
    return [(name, v) for name, f in FAMILIES.items() for v in f.variants]


__all__ = ["FAMILIES", "Family", "TINY", "variants"]
