"""The device gate: which device kinds a run requires (marker expressions, --device,
--require-device), the checks before any test (a required kind absent, --update-ceilings under
CI, an unwritable report path), and the end-of-run verdict (no case of a required kind passed;
conformance cases collected and none ran). A misconfigured Gaudi runner cannot pass by running
nothing (docs/gate.md).

pytest's marker expressions are evaluated with pytest's own parser, a private API
(`_pytest.mark.expression`): `compile_markexpr` is the one place that touches it.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from mpt_kv import devices
from mpt_kv.plugin import outcomes
from mpt_kv.plugin.options import ENV_REQUIRE

NOT_RUN = ("skipped", "unsupported")  # a conformance case with one of these outcomes checked nothing


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# --- marker expressions ------------------------------------------------------------------------------------------

def compile_markexpr(expr: str):
    """`-m expr` compiled by pytest's own parser: a function `matches(matcher) -> bool`, where
    `matcher(name, **kwargs)` says whether a case has that marker; None if the expression does not
    parse (pytest reports that itself). The only use of pytest's private `_pytest.mark.expression`
    (tests/test_gate.py runs it on the pytest version of every lock)."""
    try:
        from _pytest.mark.expression import Expression

        compiled = Expression.compile(expr)
    except SyntaxError:
        return None
    except Exception as e:  # ImportError, AttributeError, TypeError: the private API moved
        raise pytest.UsageError(_private_api_moved(e)) from None

    def matches(matcher) -> bool:
        try:
            return bool(compiled.evaluate(matcher))
        except TypeError as e:
            raise pytest.UsageError(_private_api_moved(e)) from None

    return matches


def _private_api_moved(error: Exception) -> str:
    return (f"mpt-kv reads -m with pytest's private _pytest.mark.expression (Expression.compile, evaluate), which "
            f"pytest {pytest.__version__} does not provide as mpt-kv expects ({type(error).__name__}: {error}); "
            "install the pytest version of mpt-kv's locks (constraints/*.txt) until mpt-kv supports this one")


def _markexpr_can_select(expr: str, markers: dict[str, bool]) -> bool:
    """Whether the `-m` expression is true for some case whose markers named in `markers` are
    as given (the rest: any), over every assignment of the other names it asks about."""
    matches = compile_markexpr(expr)
    if matches is None:
        return True  # pytest reports the malformed expression itself

    def satisfiable(fixed: dict) -> bool:
        asked = []

        def matcher(name, **kwargs):
            if name in markers:
                return markers[name]
            key = (name, tuple(sorted(kwargs.items())))
            if key not in fixed and key not in asked:
                asked.append(key)
            return fixed.get(key, False)

        if matches(matcher):
            return True
        free = [k for k in asked if k not in fixed]
        return bool(free) and (satisfiable({**fixed, free[0]: True}) or satisfiable({**fixed, free[0]: False}))

    return satisfiable({})


def kinds_required_by_markexpr(expr: str | None) -> list[str]:
    """The device kinds a `-m` expression cannot select a case without: the expression is
    false whenever that kind's marker is absent, whatever the other markers (`hpu`, `hpu and
    not slow`, `(hpu or cuda) and hpu`; not `hpu or cpu`, not `not hpu`)."""
    if not expr or not expr.strip():
        return []
    return [kind for kind in devices.KINDS if not _markexpr_can_select(expr, {kind: False})]


def kinds_selectable_by_markexpr(expr: str | None) -> list[str]:
    """The device kinds whose cases (one device marker each) the `-m` expression can select."""
    if not expr or not expr.strip():
        return list(devices.KINDS)
    return [kind for kind in devices.KINDS
            if _markexpr_can_select(expr, {k: k == kind for k in devices.KINDS})]


# --- what a run requires, checked before any test ------------------------------------------------------------------

def required_devices(config) -> list[str]:
    """The kinds required explicitly: --require-device and $MPT_KV_REQUIRE_DEVICE."""
    env = [k.strip() for k in os.environ.get(ENV_REQUIRE, "").split(",") if k.strip()]
    bad = [k for k in env if k not in devices.KINDS]
    if bad:
        raise pytest.UsageError(f"{ENV_REQUIRE}={os.environ[ENV_REQUIRE]!r}: unknown kind {bad}, expected {devices.KINDS}")
    return sorted(set(config.getoption("require_device") + env))


def device_requirements(config) -> dict[str, str]:
    """kind -> why the run requires it. Explicit (--require-device, $MPT_KV_REQUIRE_DEVICE)
    always; implied by selecting the kind (-m, --device) unless --allow-missing-device."""
    why = {k: f"--require-device {k}" for k in config.getoption("require_device")}
    for k in required_devices(config):
        why.setdefault(k, f"{ENV_REQUIRE}={os.environ.get(ENV_REQUIRE, '')}")
    if not config.getoption("allow_missing_device"):
        expr = config.getoption("markexpr", "") or ""
        for k in kinds_required_by_markexpr(expr):
            why.setdefault(k, f"-m {expr!r} selects {k} cases")
        for k in config.getoption("device") or []:
            why.setdefault(k, f"--device {k}")
    return dict(sorted(why.items()))


def configure(config) -> None:
    """What the gate refuses before collection: --update-ceilings under CI, an unwritable report
    path. Sets config._mpt_kv_required."""
    if config.getoption("update_ceilings") and in_ci():
        raise pytest.UsageError("--update-ceilings is refused under CI: recording a baseline is a local step whose "
                                "diff a reviewer reads; run it locally, review the diff and commit the file")
    report = config.getoption("mpt_kv_report")
    if report:
        from mpt_kv.cli.outputs import file_problem

        problem = file_problem(report)
        if problem:
            raise pytest.UsageError(f"--mpt-kv-report {report}: {problem}")
    config._mpt_kv_required = device_requirements(config)


def is_xdist_controller(config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def device_survey(config) -> dict[str, dict]:
    """{kind: {"reason", "cards"}} for the accelerator kinds the run selects or requires. The
    xdist controller probes them in a subprocess (devices.survey): it never initialises a device
    its workers need. A single process probes here; it is the one that uses the device."""
    if getattr(config, "_mpt_kv_survey", None) is None:
        selectable = kinds_selectable_by_markexpr(config.getoption("markexpr", ""))
        kinds = [k for k in devices.KINDS if k != "cpu" and k in selectable and
                 (k in (config.getoption("device") or devices.KINDS) or k in config._mpt_kv_required)]
        if is_xdist_controller(config):
            config._mpt_kv_survey = devices.survey(kinds)
        else:
            config._mpt_kv_survey = {k: {"reason": devices.unavailable_reason(k), "cards": None} for k in kinds}
    return config._mpt_kv_survey


def kind_reason(config, kind: str) -> str | None:
    if kind == "cpu":
        return None
    survey = device_survey(config)
    return survey[kind]["reason"] if kind in survey else devices.unavailable_reason(kind)


def check_required_devices(config) -> None:
    """A required kind that is absent stops the run before any test, with one line. Decided by
    the controller under xdist: a worker whose card is missing fails its cases instead (the
    device fixture), it must not crash and be restarted on the same card again and again."""
    if hasattr(config, "workerinput"):
        return
    for kind, why in config._mpt_kv_required.items():
        reason = kind_reason(config, kind)
        if reason:
            hint = "" if why.startswith(("--require-device", ENV_REQUIRE)) else \
                " (--allow-missing-device to explore locally without it)"
            raise pytest.UsageError(f"{why}, but {kind} is not available here: {reason}. "
                                    f"This runner cannot gate {kind} changes{hint}.")


# --- the end-of-run verdict -------------------------------------------------------------------------------------

def gate_failures(config) -> list[str]:
    """One line per required kind of which no case passed."""
    out = []
    for kind, why in config._mpt_kv_required.items():
        ran = [r for r in outcomes.results if kind in r["kinds"]]
        passed = [r for r in ran if r["outcome"] in ("passed", "xfail")]
        if not passed:
            out.append(f"{why}: no {kind} case passed ({len(ran)} {kind} cases reported). "
                       f"A gate that ran nothing must not look green.")
    return out


def nothing_ran(results: list[dict], allowed: bool = False) -> str | None:
    """Why a run whose conformance cases (results with a property) all skipped or were
    unsupported is a failure; None if one ran, if there were none (only the suite's own
    tests), or if `allowed` (--allow-missing-device). `python -m mpt_kv report` judges the same."""
    cases = [r for r in results if "property" in r]
    if allowed or not cases or any(r.get("outcome") not in NOT_RUN for r in cases):
        return None
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(Counter(r.get("outcome") for r in cases).items()))
    return (f"{len(cases)} conformance cases were reported and none ran ({counts}): a run that checked nothing "
            "must not look green (pytest -rs says why each was skipped; --allow-missing-device to explore locally)")


def verdict(config) -> list[str]:
    """Every reason the gate fails this run (empty: it does not)."""
    failures = gate_failures(config)
    reason = nothing_ran(outcomes.results, bool(config.getoption("allow_missing_device")))
    return failures + ([reason] if reason else [])


def summary(tw, config) -> None:
    """The end-of-run lines of the gate."""
    for msg in verdict(config):
        tw.write_sep("!", "mpt-kv gate")
        tw.write_line(msg, red=True)
    if config.getoption("allow_missing_device"):
        tw.write_line("--allow-missing-device: devices selected with -m or --device were not required; this run "
                      "gates nothing on a device that is absent", yellow=True)
