"""What a finding costs at a real config: bytes pinned beyond the K/V cache.

Real configs are data, kept in the repo (no hub download): `mpt_kv/data/families/<name>.json`,
one public checkpoint each, with the config.json fields the analytic size needs, the checkpoint
and where the values come from. MPT-7B's is the suite's own `mpt_kv/data/mpt-7b.json` (not
duplicated). A config object is built offline from the fields: `AutoConfig.for_model(model_type,
**fields)`.

A view finding (a known failure with "views") caches tensors that view the fused q/k/v
projection's output; while they are cached, that whole output stays alive. Per caching layer and
token the fused output holds (num_attention_heads + 2 kv_heads) x head_dim elements (MQA/GQA
aware: the family's `kv_heads`/`head_dim`); the cached tensors that view it hold kv_heads x
head_dim each ("key", "value") or twice that ("key_value", GPT-BigCode's fused K/V). The rest is
pinned beyond the cache:

    pinned = (fused width - viewed width) x element size x batch x tokens x layers

Only what the K/V size and the fused width need (hidden size, heads, K/V heads, layers, the
MQA/ALiBi/new-architecture switches) and the context length are kept; vocabulary, rotary and MoE
fields are left out. The formula is checked against the measurement: family-P3's failure message on the tiny config
names the bytes pinned per storage (tests/test_findings.py, under transformers 4.55).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mpt_kv import package_data
from mpt_kv.families import FAMILIES
from mpt_kv.families.base import Family
from mpt_kv.findings.raw import target_of

REAL_CONFIGS = package_data.REAL_CONFIGS
# MPT-7B's config is the seed PR's data file (mpt_kv/data/mpt-7b.json, flat "values"): the fields
# of config.json it holds, by MptConfig's names
MPT_7B = package_data.MPT_7B_CONFIG
MPT_7B_FIELDS = ("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size")
# the names config.json files give the context length, in the order looked up
CONTEXT_FIELDS = ("n_positions", "max_position_embeddings", "max_seq_len")
VIEWS = ("key", "value", "key_value")


@dataclass(frozen=True)
class RealConfig:
    """One public checkpoint's config, as kept in the repo."""

    name: str          # the data file's stem: what a finding's "cost_config" names
    checkpoint: str    # the hub name of the checkpoint
    family: str        # the registry family (mpt_kv.families.FAMILIES)
    model_type: str
    source: str        # where the values were read
    fields: dict       # config.json fields, by transformers' names
    torch_dtype: str | None

    def build(self):
        """The transformers config object, offline."""
        from transformers import AutoConfig
        from transformers.utils import logging

        # transformers' defaults for the fields left out can warn (Starcoder2Config: bos_token_id
        # 50256 outside its default vocab_size 49152); none of them enters the sizes
        level = logging.get_verbosity()
        logging.set_verbosity_error()
        try:
            return AutoConfig.for_model(self.model_type, **self.fields)
        finally:
            logging.set_verbosity(level)

    def context(self) -> int | None:
        """The context length its config.json gives, if it gives one."""
        for name in CONTEXT_FIELDS:
            if name in self.fields:
                return self.fields[name]
        return None


def _from_file(path: Path) -> RealConfig:
    raw = json.loads(path.read_text())
    required = ("name", "checkpoint", "family", "model_type", "source", "config")
    missing = [k for k in required if k not in raw]
    if missing or raw["name"] != path.stem:
        raise ValueError(f"real config {path}: needs the fields {required} and 'name' equal to the file name "
                         f"{path.stem!r}; missing {missing}, name {raw.get('name')!r}")
    if raw["family"] not in FAMILIES:
        raise ValueError(f"real config {path}: unknown family {raw['family']!r}: families {sorted(FAMILIES)}")
    return RealConfig(raw["name"], raw["checkpoint"], raw["family"], raw["model_type"], raw["source"], raw["config"],
                      raw.get("torch_dtype"))


def _mpt_7b() -> RealConfig:
    raw = json.loads(MPT_7B.read_text())
    return RealConfig("mpt-7b", "mosaicml/mpt-7b", "mpt", "mpt", raw["source"],
                      {k: raw["values"][k] for k in MPT_7B_FIELDS}, raw["values"].get("dtype"))


def real_configs() -> dict[str, RealConfig]:
    """Every real config kept in the repo, by name."""
    configs = {c.name: c for c in map(_from_file, sorted(REAL_CONFIGS.glob("*.json")))}
    configs["mpt-7b"] = _mpt_7b()
    return configs


def real_config(name: str) -> RealConfig:
    configs = real_configs()
    if name not in configs:
        raise ValueError(f"no real config {name!r} in {REAL_CONFIGS} (or mpt-7b): configs {sorted(configs)}")
    return configs[name]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stored_kv_heads(family: Family, config) -> int:
    """The K/V heads the cached tensors hold (the family's stored_kv_heads where it declares them)."""
    return family.stored_kv_heads(config) if family.stored_kv_heads is not None else family.kv_heads(config)


def fused_width(family: Family, config) -> int:
    """Elements per token of the fused projection's output: the query heads and the K and V heads,
    each head_dim wide (MQA/GQA aware), or a latent family's latent (kv_lora_rank + qk_rope_head_dim:
    deepseek's kv_a_proj_with_mqa). Checked against each tiny model's fused module."""
    if family.fused is None:
        raise ValueError(f"family {family.name} has no fused q/k/v projection")
    if family.latent_width is not None:  # multi-head latent attention: the latent and the rope key part
        return family.latent_width(config)
    return (config.num_attention_heads + 2 * family.kv_heads(config)) * family.head_dim(config)


def viewed_width(family: Family, config, views: list[str]) -> int:
    """Elements per token of the cached tensors that view the fused output."""
    bad = [v for v in views if v not in VIEWS]
    if not views or bad:
        raise ValueError(f"views {views!r}: expected a non-empty list of {VIEWS}")
    per_tensor = stored_kv_heads(family, config) * family.head_dim(config)
    return sum(2 * per_tensor if v == "key_value" else per_tensor for v in views)


def pinned_bytes_per_layer(family: Family, config, views: list[str], batch: int, tokens: int,
                           dtype: torch.dtype) -> int:
    """Bytes one caching layer pins beyond its cached tensors after a prefill of batch x tokens:
    its fused output's bytes minus the bytes of the cached tensors that view it."""
    for what, n in (("batch", batch), ("tokens", tokens)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be a positive integer, got {n!r}")
    width = fused_width(family, config) - viewed_width(family, config, views)
    return width * element_size(dtype) * batch * tokens


def pinned_bytes(family: Family, config, views: list[str], batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes pinned beyond the cache, all caching layers."""
    return pinned_bytes_per_layer(family, config, views, batch, tokens, dtype) * family.layers(config)


def kv_bytes(family: Family, config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """The analytic K/V cache (the family's kv_bytes_per_token) for batch x tokens."""
    return family.kv_bytes_per_token(config, dtype) * batch * tokens


def sizes_per_token(real: RealConfig, dtype: torch.dtype) -> tuple[int, int | None]:
    """(analytic K/V bytes per token, all layers; the fused projection's output bytes per token
    and layer, None where q, k and v are separate) at a real config."""
    family, config = FAMILIES[real.family], real.build()
    fused = fused_width(family, config) * element_size(dtype) if family.fused else None
    return family.kv_bytes_per_token(config, dtype), fused


def variant_mismatches(family: Family, variant: str, config) -> list[str]:
    """Where a real config is not of the finding's variant: the variant's boolean switches
    (multi_query, alibi, new_decoder_architecture, ...) pick the code path that caches the views,
    so a real config must have the same values."""
    return [f"{k}={getattr(config, k, None)!r} (variant {variant}: {v!r})"
            for k, v in family.variants[variant].items() if isinstance(v, bool) and getattr(config, k, None) != v]


@dataclass(frozen=True)
class Cost:
    """A finding's cost at a real config, or why there is none (pinned None)."""

    config: RealConfig | None
    pinned: dict | None       # (batch, tokens) -> bytes; tokens None: the config's context length
    kv: dict | None           # (batch, tokens) -> analytic K/V bytes
    why_none: str = ""


def finding_cost(entry: dict, points: list[tuple[int, int | None]], dtype: torch.dtype) -> Cost:
    """Bytes pinned at each (batch, tokens) point, tokens None meaning the real config's context
    length (a point whose config gives none is None). An entry without "views" (a crash, or an
    implementation's finding of another kind) or without "cost_config" has no cost: why_none says why."""
    views = entry.get("views")
    if not views:
        return Cost(None, None, None, "no cached view of a fused output: nothing pinned")
    if "cost_config" not in entry:
        return Cost(None, None, None, "no real config of this variant in mpt_kv/data/families")
    real = real_config(entry["cost_config"])
    _, family_name, variant = target_of(entry)
    family = FAMILIES[family_name]
    if real.family != family.name:
        raise ValueError(f"finding {family_name}/{variant}: cost_config {real.name!r} is a {real.family} config")
    config = real.build()
    mismatch = variant_mismatches(family, variant, config)
    if mismatch:
        raise ValueError(f"finding {family_name}/{variant}: cost_config {real.name!r} is not of that "
                         f"variant: {'; '.join(mismatch)}")
    pinned, kv = {}, {}
    for batch, tokens in points:
        n = real.context() if tokens is None else tokens
        pinned[(batch, tokens)] = None if n is None else pinned_bytes(family, config, views, batch, n, dtype)
        kv[(batch, tokens)] = None if n is None else kv_bytes(family, config, batch, n, dtype)
    return Cost(real, pinned, kv)
