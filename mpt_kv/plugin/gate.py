"""The device gate: which device kinds a run requires (marker expressions, --device,
--require-device), the checks before any test (a required kind absent, --update-ceilings under
CI, an unwritable report path, conformance tests with no target of the run), and the end-of-run
verdict (no case of a required kind passed; and what a green run must contain, `run_problems`:
a target, some conformance case that ran, per target a cache property checked on a cache path;
`python -m mpt_kv report` applies the same function). A misconfigured Gaudi runner cannot pass by
running nothing (docs/gate.md).

pytest's marker expressions are evaluated with pytest's own parser, a private API
(`_pytest.mark.expression`): `compile_markexpr` is the one place that touches it.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from mpt_kv import devices
from mpt_kv.checks import index
from mpt_kv.outputs import clash_problem, file_problem
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin import outcomes
from mpt_kv.plugin.options import ENV_REQUIRE, OUTPUT_OPTIONS, output_files, read_files

NOT_RUN = ("skipped", "unsupported")  # a conformance case with one of these outcomes checked nothing


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


# --- marker expressions ------------------------------------------------------------------------------------------

def compile_markexpr(expr: str):
    """`-m expr` compiled by pytest's own parser: a function `matches(matcher) -> bool`, where
    `matcher(name, **kwargs)` says whether a case has that marker; None if the expression does not
    parse (pytest reports that itself). The only use of pytest's private `_pytest.mark.expression`
    (tests/test_plugin_gate.py runs it on the pytest version of every lock)."""
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


# The opt-outs for exploring locally, and what each lets a run skip: a gate (CI=true) must not use them.
OPT_OUTS = {"--allow-missing-device": "allow_missing_device", "--allow-no-cache-check": "allow_no_cache_check"}
OPT_OUT_LETS = {
    "--allow-missing-device": "a run whose selected devices are absent, or whose conformance cases all skipped, to "
                              "pass having checked nothing there",
    "--allow-no-cache-check": "a target of which no cache property passed to pass having checked no cache",
}


def refused_under_ci(flag: str) -> str:
    return (f"{flag} is refused under CI (CI={os.environ.get('CI', '')}): it lets {OPT_OUT_LETS[flag]}, and a gate "
            f"must not be able to do that. It is for exploring locally: run without CI=true (e.g. `CI= python -m "
            f"pytest ... {flag}`), and gate with a run that does not need it")


def configure(config) -> None:
    """What the gate refuses before collection: --update-ceilings and the opt-outs (OPT_OUTS) under CI,
    an unwritable report path. Sets the run's required devices (RunState.required)."""
    if config.getoption("update_ceilings") and in_ci():
        raise pytest.UsageError("--update-ceilings is refused under CI: recording a baseline is a local step whose "
                                "diff a reviewer reads; run it locally, review the diff and commit the file")
    for flag, name in OPT_OUTS.items():
        if config.getoption(name) and in_ci():
            raise pytest.UsageError(refused_under_ci(flag))
    written = output_files(config)
    for flag, path in written:
        problem = flag in OUTPUT_OPTIONS and file_problem(path)
        if problem:
            raise pytest.UsageError(f"{flag} {path}: {problem}")
    problem = clash_problem(written, read_files(config))
    if problem:
        raise pytest.UsageError(problem)
    run_state(config).required = device_requirements(config)


def is_xdist_controller(config) -> bool:
    return config.pluginmanager.has_plugin("dsession")


def device_survey(config) -> dict[str, dict]:
    """{kind: {"reason", "cards"}} for the accelerator kinds the run selects or requires. The
    xdist controller probes them in a subprocess (devices.survey): it never initialises a device
    its workers need. A single process probes here; it is the one that uses the device."""
    state = run_state(config)
    if state.survey is None:
        selectable = kinds_selectable_by_markexpr(config.getoption("markexpr", ""))
        kinds = [k for k in devices.KINDS if k != "cpu" and k in selectable and
                 (k in (config.getoption("device") or devices.KINDS) or k in state.required)]
        if is_xdist_controller(config):
            state.survey = devices.survey(kinds)
        else:
            state.survey = {k: {"reason": devices.unavailable_reason(k), "cards": None} for k in kinds}
    return state.survey


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
    for kind, why in run_state(config).required.items():
        reason = kind_reason(config, kind)
        if reason:
            hint = "" if why.startswith(("--require-device", ENV_REQUIRE)) else \
                " (--allow-missing-device to explore locally without it)"
            raise pytest.UsageError(f"{why}, but {kind} is not available here: {reason}. "
                                    f"This runner cannot gate {kind} changes{hint}.")


# --- the end-of-run verdict -------------------------------------------------------------------------------------

# outcomes that make a run red by themselves (pytest reports each): a gate line about such a run says
# what failed, not that the run checked nothing
RED = ("failed", "error", "XPASS")


def what_failed(records: list[dict]) -> str:
    """`P3 failed 1 on concat; ops-P3 error 1 on static` for conformance cases, else the first node ids."""
    cases = [r for r in records if "property" in r]
    if cases:
        return _what_ran(cases)
    ids = [r.get("nodeid", "?") for r in records]
    return ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")


def gate_failures(config) -> list[str]:
    """One line per required kind of which no case passed: that the gate ran nothing, only where that
    is the verdict; where cases of the kind failed, which (they make the run red on their own)."""
    out = []
    state = run_state(config)
    for kind, why in state.required.items():
        ran = [r for r in state.results if kind in r["kinds"]]
        passed = [r for r in ran if r["outcome"] in ("passed", "xfail")]
        red = [r for r in ran if r["outcome"] in RED]
        if passed:
            continue
        if red:
            out.append(f"{why}: no {kind} case passed: {len(red)} of the {len(ran)} {kind} cases failed "
                       f"({what_failed(red)}); their failures above say what is wrong.")
        else:
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


# --- what a green run must contain --------------------------------------------------------------------------------

# The index of properties (mpt_kv.checks.index), split: the ones that check a cache (its logits, K/V
# storage, shapes, memory or operations on a cache path), and the ones that do not: P0 and family-P0
# run the model uncached; P4 and family-P4 check the returned outputs, not the cache. A property in
# neither (a project's own) never counts as a cache check: fail closed.
CACHE_PROPERTIES = index.CACHE
NOT_CACHE_PROPERTIES = index.NOT_CACHE
# A cache case checked its target when it passed on a cache that exists (its record's `cache`: the run
# layer's evidence, mpt_kv.checks.evidence.cache_evidence: after a prefill the cache's storages hold the
# analytic K/V and a second read returns the same ones), or when it was a known failure (xfail): a
# strict xfail of only the PropertyFailure an entry names, so the cache ran and the check found that
# very finding (a port whose every cache check is a shipped upstream bug is checked, and fails the day
# it changes). A pass without that evidence checked values a target may recompute without any cache.
CHECKED = ("passed", "xfail")


def checked_cache(r: dict) -> bool:
    """Whether a result checked its target's cache: a cache property on a cache path, a known failure,
    or a pass whose record shows the cache exists. The one rule every check's pass goes through."""
    if not is_cache_check(r) or r.get("outcome") not in CHECKED:
        return False
    return r.get("outcome") == "xfail" or bool((r.get("cache") or {}).get("shown"))


def gate_target(r: dict) -> str:
    """The run's target a result belongs to: its target; for a family case (mpt_kv.conformance.
    test_families, which records its `implementation`) the implementation's ports together, since a
    family it has no port of is unsupported by design."""
    return f"{r['implementation']} (families)" if r.get("implementation") else r.get("target", "?")


def is_cache_check(r: dict) -> bool:
    return r.get("property") in CACHE_PROPERTIES and r.get("path") not in (None, "", "-")


def no_target(records: list[dict]) -> str | None:
    """Why a run (or the collection of one) with conformance tests but no target of the run they
    apply to is a usage error: records with `no_target` (a placeholder case, mpt_kv.plugin.outcomes.
    label) and no conformance case at all. None otherwise."""
    placeholders = [r for r in records if r.get("no_target")]
    if not placeholders or any("property" in r for r in records):
        return None
    first = placeholders[0]
    return (f"no target of this run applies to the conformance tests it selected ({len(placeholders)} placeholder "
            f"cases, e.g. {first.get('nodeid', '?')}: {first['no_target']}): a run with no target checks nothing; "
            "name one with --target (or ini mpt_kv_targets)")


def unchecked_targets(results: list[dict], allow_missing_device: bool = False) -> list[str]:
    """One line per target that ran (some case not skipped: a built-in target whose package is not
    installed, or whose device is absent, did not run here) and of which no cache case was checked
    (CHECKED) on a cache path: what it checked and what it did not. With --allow-missing-device a
    target none of whose cases ran (all skipped or unsupported) is let through, as nothing_ran lets
    such a run through; one that ran something but no cache check is not."""
    waived = NOT_RUN if allow_missing_device else ("skipped",)
    by_target: dict[str, list[dict]] = {}
    for r in results:
        if "property" in r:
            by_target.setdefault(gate_target(r), []).append(r)
    out = []
    for target, cases in by_target.items():
        if all(r.get("outcome") in waived for r in cases) or any(checked_cache(r) for r in cases):
            continue
        unshown = [r for r in cases if is_cache_check(r) and r.get("outcome") == "passed"]
        if unshown:  # values right, and nothing shows a cache was kept: it checked no cache
            why = (unshown[0].get("cache") or {}).get("why") or "the record carries no evidence that a cache exists"
            out.append(f"target {target}: its cache properties passed ({_what_ran(unshown)}) but show no cache: "
                       f"{why}. A run that checked no cache of a target must not look green")
            continue
        red = [r for r in cases if is_cache_check(r) and r.get("outcome") in RED]
        if red:  # the cache was checked and found broken (or crashed): say that, not "checked no cache"
            out.append(f"target {target}: no cache property passed: {what_failed(red)}; their failures above "
                       "say what is wrong")
            continue
        out.append(f"target {target}: no cache property passed ({_what_ran(cases)}): a run that checked no "
                   "cache of a target must not look green (pytest -rs says why; --allow-no-cache-check to "
                   "explore locally)")
    return out


def _what_ran(cases: list[dict]) -> str:
    """`P0 passed 7; P1, P2, P3, memory unsupported 75 on concat, static`: per outcome, which
    properties, how many cases and on which paths."""
    order = {p: i for i, p in enumerate(index.NAMES)}  # the matrix's column order
    groups: dict[str, list[dict]] = {}
    for r in cases:
        groups.setdefault(r.get("outcome", "?"), []).append(r)
    parts = []
    for outcome, rs in sorted(groups.items(), key=lambda kv: (kv[0] != "passed", kv[0])):
        props = sorted({r["property"] for r in rs}, key=lambda p: (order.get(p, len(order)), p))
        paths = sorted({r["path"] for r in rs if r.get("path") not in (None, "", "-")})
        parts.append(f"{', '.join(props)} {outcome} {len(rs)}" + (f" on {', '.join(paths)}" if paths else ""))
    return "; ".join(parts)


def run_problems(results: list[dict], allow_missing_device: bool = False,
                 allow_no_cache_check: bool = False) -> list[str]:
    """What a green run must contain, over its result records (the RunState's results, or a
    JSON report's: `python -m mpt_kv report` applies this same function): a target its conformance
    tests apply to; some conformance case that ran (unless --allow-missing-device); and per target
    that ran, a cache property checked on a cache path (unless --allow-no-cache-check). Empty: green."""
    reason = no_target(results) or nothing_ran(results, allow_missing_device)
    if reason:
        return [reason]
    return [] if allow_no_cache_check else unchecked_targets(results, allow_missing_device)


def verdict(config) -> list[str]:
    """Every reason the gate fails this run (empty: it does not)."""
    return gate_failures(config) + run_problems(run_state(config).results, bool(config.getoption("allow_missing_device")),
                                                bool(config.getoption("allow_no_cache_check"))) + \
        family_targets_without_case(config, run_state(config).results)


def family_targets_without_case(config, records: list[dict]) -> list[str]:
    """One line per family target the run names (`mpt_kv.FamilyModel` by --target or ini) of which no
    case is among `records`: its cases are the family checks', which a selection of the MPT modules (or
    a -k) leaves out, and a run beside another target would pass having checked nothing of it."""
    ran = {r.get("implementation") for r in records if "property" in r}
    return [f"target {name} is a family target ({family}) named with --target (or ini mpt_kv_targets), but no case "
            "of it is in this run: its cases are mpt_kv.conformance.test_families' (run `--pyargs mpt_kv.conformance`, "
            f"or parametrize_with_checks([{name.split(':')[-1]}]) in your tests), or the run's selection (-k, -m, "
            "--mpt-kv-profile) left none of them; a named target checked by nothing must not look green"
            for name, family in run_state(config).family_named.items() if name not in ran]


def check_collected(session) -> None:
    """Decided before any test where the items are here (not on an xdist controller, which
    collects nothing, nor in a worker: the controller's end-of-run verdict says it then)."""
    if hasattr(session.config, "workerinput") or not session.items:
        return
    records = [outcomes.record_of(item) for item in session.items]
    reason = no_target(records) or next(iter(family_targets_without_case(session.config, records)), None)
    if reason:
        raise pytest.UsageError(reason)


def summary(tw, config) -> None:
    """The end-of-run lines of the gate."""
    for msg in verdict(config):
        tw.write_sep("!", "mpt-kv gate")
        tw.write_line(msg, red=True)
    if config.getoption("allow_missing_device"):
        tw.write_line("--allow-missing-device: devices selected with -m or --device were not required; this run "
                      "gates nothing on a device that is absent", yellow=True)
    if config.getoption("allow_no_cache_check"):
        tw.write_line("--allow-no-cache-check: a target of which no cache property passed did not fail this run; "
                      "it gates no cache", yellow=True)
