"""The device, target and dtype parameters, and their fixtures.

- Every case that takes `device` runs once per kind and carries the marker of that kind, so
  `pytest -m hpu` selects exactly the HPU cases. The kinds (`generated_kinds`): those --device
  names; without it cpu, and each accelerator kind the run asks for (required, or selected by -m
  even under --allow-missing-device), or the xdist worker was given a card of, or that -m can
  select and is available here. A kind that can never run here is not generated at all, and the
  terminal summary says so in one line (`summary`); a generated kind that is absent skips, unless
  the run requires it (gate.py) or the worker was given a card it cannot see (an error).
- `target` runs once per built-in target and per `--target package.module:factory`. Each spec is
  resolved once per process into a `mpt_kv.targets.ResolvedTarget`, which the fixture returns and
  the checks take. A target named explicitly that cannot be imported or built is an error; a
  built-in one whose package is not installed is not generated (the summary line says so). A spec
  that names a family declaration (`mpt_kv.FamilyModel`) is no MPT target: the family checks run it
  (mpt_kv/conformance/test_families.py, `family_declarations`); a test whose `target` has no MPT
  target left gets one placeholder saying so (the gate refuses a run of placeholders alone).
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


_ABSENT_KINDS = pytest.StashKey[dict]()    # config -> {kind: why no case of it is generated}
_ABSENT_TARGETS = pytest.StashKey[dict]()  # config -> {built-in target: why no case of it is generated}


def generate(metafunc) -> None:
    config = metafunc.config
    explicit = explicitly_parametrized(metafunc)
    if "device" in metafunc.fixturenames and "device" not in explicit:
        metafunc.parametrize("device", [pytest.param(k, marks=getattr(pytest.mark, k), id=k)
                                        for k in generated_kinds(config)], indirect=True)
    if "target" in metafunc.fixturenames and "target" not in explicit:
        metafunc.parametrize("target", mpt_target_params(config), indirect=True)
    if "dtype" in metafunc.fixturenames and "dtype" not in explicit:
        from mpt_kv.model.config import DTYPES  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

        metafunc.parametrize("dtype", [pytest.param(DTYPES[n], id=n) for n in dtype_names(config)])


def absent_kinds(config) -> dict[str, str]:
    """{kind: why}: the device kinds no case is generated for in this run, decided once per process.
    A kind is left out only when nothing asks for it: not named by --device, not required, not one a
    -m expression cannot select without (those are generated: gate.py refuses or fails the run, or
    under --allow-missing-device they skip), no card of it given to this xdist worker; and -m cannot
    select it, or it is not available here (gate.kind_reason: under xdist the controller's survey,
    the one that hands out the cards). A kind -m cannot select is never probed."""
    if _ABSENT_KINDS not in config.stash:
        from mpt_kv.plugin.gate import kind_reason, kinds_required_by_markexpr, kinds_selectable_by_markexpr

        absent = {}
        if not config.getoption("device"):
            expr = config.getoption("markexpr", "") or ""
            asked = {*run_state(config).required, *kinds_required_by_markexpr(expr), *devices.assigned_cards()}
            selectable = kinds_selectable_by_markexpr(expr)
            for kind in devices.KINDS:
                if kind == "cpu" or kind in asked:
                    continue
                if kind not in selectable:
                    absent[kind] = f"-m {expr!r} selects none of its cases"
                elif (reason := kind_reason(config, kind)) is not None:
                    absent[kind] = f"not available here: {reason}"
        config.stash[_ABSENT_KINDS] = absent
    return config.stash[_ABSENT_KINDS]


def absent_targets(config) -> dict[str, str]:
    """{spec: why}: the built-in targets no case is generated for, their package not installed here
    (a target the run names is always generated: it fails where it cannot load, never skips)."""
    if _ABSENT_TARGETS not in config.stash:
        named = named_targets(config)
        config.stash[_ABSENT_TARGETS] = {spec: why for spec in target_specs(config)
                                         if spec not in named and (why := missing_package(spec))}
    return config.stash[_ABSENT_TARGETS]


def generated_kinds(config) -> list[str]:
    """The device kinds a case taking `device` is generated for (module doc)."""
    return config.getoption("device") or [k for k in devices.KINDS if k not in absent_kinds(config)]


def generated_targets(config) -> list[str]:
    """This run's targets (options.target_specs) less the built-in ones whose package is not installed here."""
    return [spec for spec in target_specs(config) if spec not in absent_targets(config)]


def summary(tw, config, results: list[dict]) -> None:
    """One line: which device kinds (in a run with device cases) and which built-in targets (in a run
    whose conformance cases include a built-in one) got no case here, and why."""
    parts = []
    if any(r.get("kinds") for r in results):
        parts += [f"{kind} cases ({why})" for kind, why in absent_kinds(config).items()]
    if any(r.get("target") in BUILTIN_PACKAGES for r in results):  # the run's own targets were generated
        parts += [f"target {spec} ({why})" for spec, why in absent_targets(config).items()]
    if any(r.get("target", "").startswith("transformers[") for r in results):  # transformers' attention axis ran
        from mpt_kv.families.implementations import attention_left_out  # lazy: torch (the family cases imported it)

        parts += [f"{name} family cases ({why})" for name, why in attention_left_out().items()]
    if parts:
        tw.write_line(f"mpt-kv generated no {'; no '.join(parts)}")


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


def require_package(config, spec: str) -> None:
    """A family case's rule (test_families, test_generate) for a built-in implementation whose package is not
    installed: an error where --target names it, else a skip with the reason."""
    missing = missing_package(spec)
    if missing:
        if spec in named_targets(config):
            pytest.fail(f"target {spec} is named with --target but {missing}", pytrace=False)
        pytest.skip(f"target {spec} unavailable: {missing}")


def check_named_targets(config) -> None:
    """A named target that cannot even be imported stops the run before any test (decided by
    the controller under xdist)."""
    if hasattr(config, "workerinput"):
        return

    from mpt_kv.targets import is_family_declaration  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

    for spec in named_targets(config):
        problem = named_target_problem(spec, lambda s: resolved(config, s))
        if problem is None:  # the gate holds a named family target to having a case (gate.family_targets_without_case)
            target = resolved(config, spec)  # cached
            if is_family_declaration(target):
                run_state(config).family_named[target.name] = target.family
        if problem:
            raise pytest.UsageError(f"--target {spec}: {problem}")


def named_target_problem(spec: str, resolve) -> str | None:
    """Why a target named to run cannot run here (None if it can): a built-in one whose package is not
    installed, or a spec that does not load (`resolve(spec)` raises). The rule of every command that
    takes a --target (the plugin, `calibrate`), before any work."""
    problem = missing_package(spec)
    if problem is None:
        try:
            resolve(spec)
        except TargetUnavailable as e:
            problem = str(e)
        except Exception as e:
            problem = f"importing it raised {type(e).__name__}: {e}"
    return problem


def family_declarations(config) -> list:
    """The run's named targets that are family declarations (`mpt_kv.FamilyModel`), resolved once (a spec
    that does not load is not one: check_named_targets stops the run on it)."""
    from mpt_kv.targets import is_family_declaration  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

    out = []
    for spec in named_targets(config):
        if spec in BUILTIN_PACKAGES:
            continue
        try:
            target = resolved(config, spec)
        except Exception:  # noqa: BLE001  not loading: an MPT target's error, said by check_named_targets
            continue
        if is_family_declaration(target):
            out.append(target)
    return out


def mpt_target_params(config) -> list:
    """The `target` parameters of an MPT conformance test: the run's targets less its family declarations
    (their cases are the family checks'); none left while some are: one placeholder that says so."""
    families = {d.name for d in family_declarations(config)}
    specs = [spec for spec in generated_targets(config) if spec not in families]
    if specs or not families:
        return specs
    why = f"no MPT target among this run's targets: {', '.join(sorted(families))} is a family target (its cases are mpt_kv.conformance.test_families')"
    return [pytest.param(None, id="no-mpt-target", marks=[pytest.mark.skip(reason=why), pytest.mark.no_target(why)])]
