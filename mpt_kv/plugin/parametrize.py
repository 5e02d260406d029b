"""The device, target and dtype parameters, and their fixtures.

- Every case that takes `device` runs once per kind (cpu, cuda, hpu) and carries the marker of
  that kind, so `pytest -m hpu` selects exactly the HPU cases; an absent kind skips, unless the
  run requires it (gate.py) or the worker was given a card it cannot see (an error).
- `target` runs once per built-in target and per `--target package.module:factory`. Each spec is
  resolved once per process into a `mpt_kv.targets.ResolvedTarget`, which the fixture returns and
  the checks take. A target named explicitly that cannot be imported or built is an error; a
  built-in one skips only where its package is not installed.
- `dtype`: fp32 and bf16, or --dtype / ini mpt_kv_dtypes.
A test's own parametrize of one of these names wins (`parametrize_with_checks([build])`).
"""

from __future__ import annotations

import os

import pytest

from mpt_kv import devices, versions
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin.options import BUILTIN_PACKAGES, dtype_names, named_targets, target_specs
from mpt_kv.errors import TargetUnavailable


def generate(metafunc) -> None:
    config = metafunc.config
    explicit = explicitly_parametrized(metafunc)
    if "device" in metafunc.fixturenames and "device" not in explicit:
        kinds = config.getoption("device") or list(devices.KINDS)
        metafunc.parametrize("device", [pytest.param(k, marks=getattr(pytest.mark, k), id=k) for k in kinds],
                             indirect=True)
    if "target" in metafunc.fixturenames and "target" not in explicit:
        metafunc.parametrize("target", target_specs(config), indirect=True)
    if "dtype" in metafunc.fixturenames and "dtype" not in explicit:
        from mpt_kv.model.config import DTYPES  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

        metafunc.parametrize("dtype", [pytest.param(DTYPES[n], id=n) for n in dtype_names(config)])


def explicitly_parametrized(metafunc) -> set[str]:
    """Argnames the test parametrizes itself (`parametrize_with_checks([build])` gives `target`)."""
    names = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        names.update(a.strip() for a in argnames.split(",")) if isinstance(argnames, str) else names.update(argnames)
    return names


def device_for(request) -> "torch.device":  # noqa: F821
    kind = request.param
    card = devices.assigned_cards().get(kind, "")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if card is None:
        pytest.fail(f"xdist worker {worker} was given no {kind} card (more workers than cards?)", pytrace=False)
    reason = devices.unavailable_reason(kind)
    if reason:
        if card:  # the controller counted this card; a worker that cannot see it must not pass quietly
            pytest.fail(f"xdist worker {worker} was given {kind} card {card} ({devices.VISIBLE[kind]}={card}) but "
                        f"{kind} is not available in it: {reason}", pytrace=False)
        why = run_state(request.config).required.get(kind)
        if why:
            pytest.fail(f"{why}: {kind} is not available: {reason}", pytrace=False)
        pytest.skip(f"{kind} unavailable: {reason}")
    return devices.torch_device(kind)


def resolved(config, spec: str):
    """The ResolvedTarget of a spec, resolved once per process (TargetUnavailable if it does not load)."""
    from mpt_kv.targets import resolve_target  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

    cache = run_state(config).resolved
    if spec not in cache:
        cache[spec] = resolve_target(spec)
    return cache[spec]


def target_for(request, device):
    """The target, resolved and built once on a tiny config (the probe its checks read its
    capabilities from): a built-in one whose package is not installed skips with the reason; any
    other failure to import or build is an error."""
    import torch

    spec = request.param
    named = spec in named_targets(request.config)
    missing = missing_package(spec)
    if missing and not named:
        pytest.skip(f"target {spec} unavailable: {missing}")
    try:
        target = resolved(request.config, spec)
        target.capabilities(device, torch.float32)
    except Exception as e:
        from mpt_kv.targets import factory_error  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

        why = " (named with --target: an error, not a skip)" if named else ""
        e = factory_error(e)
        pytest.fail(f"target {spec} cannot be built here{why}: {type(e).__name__}: {e}", pytrace=False)
    return target


def missing_package(spec: str) -> str | None:
    """For a built-in target: the reason it cannot run because its package is not installed."""
    return versions.missing(spec) if spec in BUILTIN_PACKAGES else None


def check_named_targets(config) -> None:
    """A named target that cannot even be imported stops the run before any test (decided by
    the controller under xdist)."""
    if hasattr(config, "workerinput"):
        return

    for spec in named_targets(config):
        problem = missing_package(spec)
        if problem is None:
            try:
                resolved(config, spec)
            except TargetUnavailable as e:
                problem = str(e)
            except Exception as e:
                problem = f"importing it raised {type(e).__name__}: {e}"
        if problem:
            raise pytest.UsageError(f"--target {spec}: {problem}")
