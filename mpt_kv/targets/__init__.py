"""Targets: the implementations the properties run against, all with the same weights.

A target is a factory `build(cfg, state_dict, device, dtype) -> Runner`. Built-in targets:
`reference`, `transformers`, `optimum-habana`. A user's own is named
`package.module:factory` (pytest `--target`, see README). A target that cannot be imported
raises `TargetUnavailable` with the reason, and its cases are skipped with that reason.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from mpt_kv.model.config import ModelConfig
from mpt_kv.errors import TargetUnavailable
from mpt_kv.model.session import Session

PATHS = ("concat", "static")


class Runner:
    """One loaded model of one target on one device and dtype."""

    name: str
    model: nn.Module
    # what this target cannot do -> why: "static" (the static path), "bucket" (cache_idx
    # buckets). Cases needing it are skipped with that reason, never dropped.
    unsupported: dict[str, str] = {}

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Uncached full forward: (B, T) -> (B, T, V)."""
        raise NotImplementedError

    def session(self, path: str, max_len: int, bucket: int | None = None) -> Session:
        raise NotImplementedError

    def wqkv_modules(self) -> list[nn.Module]:
        """Each layer's fused projection, in layer order: the aliasing check hooks its output."""
        mods = [m for name, m in self.model.named_modules() if name.endswith("Wqkv")]
        if not mods:
            raise TargetUnavailable(f"{self.name}: no module named '*Wqkv' to hook; override wqkv_modules()")
        return mods


Factory = Callable[[ModelConfig, dict, torch.device, torch.dtype], Runner]

BUILTIN = {
    "reference": "mpt_kv.targets.reference:build",
    "transformers": "mpt_kv.targets.hf:build",
    "optimum-habana": "mpt_kv.targets.gaudi:build",
}


def resolve(spec: str) -> Factory:
    """A built-in name or `package.module:factory` -> the factory (TargetUnavailable if not)."""
    path = BUILTIN.get(spec, spec)
    if ":" not in path:
        raise TargetUnavailable(
            f"target {spec!r} is neither built in ({', '.join(BUILTIN)}) nor 'package.module:factory'")
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetUnavailable(f"target {spec!r}: cannot import {module_name} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise TargetUnavailable(f"target {spec!r}: {module_name} has no {attr!r}") from e


def build(spec: str, cfg: ModelConfig, state_dict: dict, device, dtype) -> Runner:
    runner = resolve(spec)(cfg, state_dict, torch.device(device), dtype)
    runner.name = getattr(runner, "name", None) or spec
    return runner
