"""Model shape and the weights every target shares.

The reference and every target are built from one `ModelConfig` and load one state_dict in
transformers' `MptForCausalLM` format, so any disagreement is the cache code, not the weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 32          # ALiBi is built this far: total length (prompt + new) is capped here
    clip_qkv: float | None = None  # clamp mixed_qkv to [-clip_qkv, clip_qkv] before the split
    alibi_bias_max: int = 8
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"ModelConfig.clip_qkv={self.clip_qkv} must be > 0 or None")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_hf(self):
        """The equivalent transformers `MptConfig` (use_cache on: its default is False)."""
        from transformers import MptConfig

        return MptConfig(
            d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
            vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, expansion_ratio=4,
            layer_norm_epsilon=self.layer_norm_epsilon, use_cache=True,
            attn_config={"clip_qkv": self.clip_qkv, "alibi_bias_max": self.alibi_bias_max,
                         "alibi": True, "softmax_scale": None},
        )

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


def random_state_dict(cfg: ModelConfig, seed: int = 0, std: float = 0.3) -> dict[str, torch.Tensor]:
    """Seeded random weights in `MptForCausalLM` key format (fp32, CPU).

    std 0.3 rather than the usual 0.02: with tiny weights every logit is near zero and a
    broken cache can hide inside the tolerance (FACTS.md: 2e-7 vs 6e-6 errors). Above d_model
    32 the projections' std shrinks as 1/sqrt(d_model) (fan-in), so every width keeps the gain of
    d_model 32: with 0.3 at d_model 256 and 4 layers the activations saturate and the model turns
    chaotic, its cached and uncached fp32 paths 3e-4 of the logit scale apart and bf16 63% from
    fp32, where fan-in scaling measured 1e-6 and 2% (docs/calibration.md)."""
    g = torch.Generator().manual_seed(seed)
    D, V = cfg.d_model, cfg.vocab_size
    std = std * min(1.0, (32 / D) ** 0.5)

    def w(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    sd = {"transformer.wte.weight": w(V, D, scale=1.0)}
    for i in range(cfg.n_layers):
        p = f"transformer.blocks.{i}."
        sd[p + "norm_1.weight"] = 1 + w(D, scale=0.1)
        sd[p + "attn.Wqkv.weight"] = w(3 * D, D)
        sd[p + "attn.out_proj.weight"] = w(D, D)
        sd[p + "norm_2.weight"] = 1 + w(D, scale=0.1)
        sd[p + "ffn.up_proj.weight"] = w(4 * D, D)
        sd[p + "ffn.down_proj.weight"] = w(D, 4 * D, scale=std / 2)
    sd["transformer.norm_f.weight"] = 1 + w(D, scale=0.1)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied, as in MPT
    return sd
