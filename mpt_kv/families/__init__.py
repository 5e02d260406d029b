"""The family registry: decoder architectures of transformers with a KV cache, checked with the
same properties as MPT (family-P1, family-P3 in `mpt_kv.checks.family`).

One module per family (as transformers' `models/<family>/`), each with one `FAMILY`; adding a
family is one small module and one line below (docs/families.md).
"""

from __future__ import annotations

from mpt_kv.families import (bloom, codegen, dbrx, falcon, gpt2, gpt_bigcode, gpt_neox, gptj, llama, mistral, mpt,
                             persimmon, phi, phi3, qwen2, stablelm, starcoder2)
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
)})


def variants() -> list[tuple[str, str]]:
    """Every (family, variant) in the registry, in registry order."""
    return [(name, v) for name, f in FAMILIES.items() for v in f.variants]


__all__ = ["FAMILIES", "Family", "TINY", "variants"]
