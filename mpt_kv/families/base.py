"""What a family is: a decoder architecture of transformers with a KV cache, described by the
little the checks need to build it tiny and read its cache (one `Family` per module here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

# Every tiny config: 2 layers, vocab 128, hidden 32-64 (the families' own names for these are
# mapped by each config's attribute_map; families whose config spells them otherwise say so).
TINY = {"vocab_size": 128, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4}


@dataclass(frozen=True)
class Family:
    """A decoder architecture.

    name: the registry key; model_type: transformers' model_type (`AutoConfig.for_model`);
    variants: variant name -> config kwargs over TINY (MQA/GQA variants where the architecture has
    them); fused: the attribute name of its fused q/k/v (or k/v) projection module, None where
    q, k and v are separate; kv_heads(config): cached key/value heads per layer (MQA/GQA aware);
    head_dim(config): their head dim; layers(config): layers that cache; stored_kv_heads(config):
    the K/V heads transformers' implementation actually caches where that is more than kv_heads
    (a known excess over the analytic size, kept as data with its upstream line), else None."""

    name: str
    model_type: str
    variants: dict[str, dict]
    fused: str | None = None
    kv_heads: Callable = field(default=lambda c: getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim: Callable = field(default=lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    layers: Callable = field(default=lambda c: c.num_hidden_layers)
    tiny: dict = field(default_factory=lambda: dict(TINY))
    stored_kv_heads: Callable | None = None

    def config(self, variant: str):
        """The tiny config of one variant, built without the hub."""
        if variant not in self.variants:
            raise ValueError(f"family {self.name} has no variant {variant!r}: variants {sorted(self.variants)}")
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **{**self.tiny, **self.variants[variant]})

    def kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """Analytic cached bytes per token per sequence: K and V of every layer."""
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers(config) * self.kv_heads(config) * self.head_dim(config) * size

    def stored_kv_bytes_per_token(self, config, dtype: torch.dtype) -> int:
        """The bytes per token per sequence transformers' cache holds (the analytic size unless
        the family declares stored_kv_heads)."""
        if self.stored_kv_heads is None:
            return self.kv_bytes_per_token(config, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers(config) * self.stored_kv_heads(config) * self.head_dim(config) * size

    def fused_modules(self, model) -> list[tuple[str, torch.nn.Module]]:
        """(qualified name, module) of every fused projection in the model, in order."""
        if self.fused is None:
            return []
        return [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == self.fused]
