"""mpt-kv: a conformance and regression suite for the KV cache of MPT-style attention.

The public API (docs/targets.md), importable from here:

    parametrize_with_checks   a pytest mark: every check on your target(s), in your own test file
    CHECKS                    check id -> Check, a plain function check(target, device, dtype)
    Runner, Capabilities      what a target's factory returns, and what it declares unsupported
    GaudiStyleRunner, TransformersRunner, ReferenceRunner
                              ready-made runners (mpt_kv.targets.wrappers)
    CallableRunner            a runner from callables, for a model with its own forward signature
    FamilyModel               a model of another decoder family (mistral, llama, ...) as a target
    FamilyTarget              one variant of a family on one implementation: the family checks' target
    KnownFailures             the known-failure rule for checks called by hand (`known_failures=`)
    load_gaudi_mpt_module     optimum-habana's MPT module, loaded on CPU too (mpt_kv.targets.gaudi)
    ModelConfig, Case         the model shape a factory receives; one drawn input
    Session, PagedLayout, BlockGrowth, QuantizedKV
                              one generation; how a paged, block-grown or quantized cache describes itself
    PropertyFailure, Unsupported, TargetUnavailable, InputError, KnownFailure, UnexpectedPass

Names load on first use, so `import mpt_kv` (and the pytest plugin) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "parametrize_with_checks": "mpt_kv.checks.registry",
    "CHECKS": "mpt_kv.checks.registry",
    "Check": "mpt_kv.checks.registry",
    "StoredCeilings": "mpt_kv.checks.registry",
    "Runner": "mpt_kv.targets",
    "Capabilities": "mpt_kv.targets",
    "FEATURES": "mpt_kv.targets",
    "GaudiStyleRunner": "mpt_kv.targets.wrappers",
    "TransformersRunner": "mpt_kv.targets.wrappers",
    "ReferenceRunner": "mpt_kv.targets.wrappers",
    "load_gaudi_mpt_module": "mpt_kv.targets.gaudi",
    "gaudi_classes": "mpt_kv.targets.gaudi",
    "ModelConfig": "mpt_kv.model.config",
    "Case": "mpt_kv.checks.properties",
    "Session": "mpt_kv.model.session",
    "PagedLayout": "mpt_kv.targets.layouts",
    "BlockGrowth": "mpt_kv.targets.layouts",
    "QuantizedKV": "mpt_kv.targets.layouts",
    "PropertyFailure": "mpt_kv.checks.compare",
    "Unsupported": "mpt_kv.errors",
    "TargetUnavailable": "mpt_kv.errors",
    "InputError": "mpt_kv.errors",
    "CallableRunner": "mpt_kv.targets.callables",
    "FamilyModel": "mpt_kv.families.own",
    "FamilyTarget": "mpt_kv.targets",
    "KnownFailures": "mpt_kv.findings.known",
    "KnownFailure": "mpt_kv.errors",
    "UnexpectedPass": "mpt_kv.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpt_kv' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
