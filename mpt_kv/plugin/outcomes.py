"""What each case's reports say, collected in this process: the matrix's word for a finished
phase (passed, failed, error, unsupported, xfail, XPASS), each conformance case's fields
(target, device, dtype, property, path, check), and what checks recorded on the case (memory
measurements, notes, declared capabilities, ceilings not stored, reach).

Under xdist every record travels from the workers to the controller as report
user_properties; the controller's run state (mpt_kv.plugin.state.RunState: results, memory,
extras) is the run's, which the gate, the report and the ceilings read.
"""

from __future__ import annotations

from _pytest.mark.structures import NOTSET

import sys

import pytest

from mpt_kv import devices
from mpt_kv.errors import PropertyFailure, Unsupported

# --- at collection ------------------------------------------------------------------------------------------------

def item_kinds(item) -> list[str]:
    """The device kinds of a case: its `device` parameter or a device marker; never a keyword
    (a test in a folder or class named `hpu` is not an HPU case)."""
    cs = getattr(item, "callspec", None)
    kinds = {cs.params["device"]} if cs is not None and cs.params.get("device") in devices.KINDS else set()
    kinds |= {m.name for m in item.iter_markers() if m.name in devices.KINDS}
    return sorted(kinds)


def label(item) -> dict | None:
    """Put a case's device kinds and, for a conformance case (a property marker and a target),
    its fields on its user_properties (they travel to the xdist controller with its reports).
    Returns those fields, or None for any other test."""
    kinds = item_kinds(item)
    if kinds:
        item.user_properties.append(("mpt_kv_kinds", kinds))
    p = params_of(item)
    if "property" in p and "target" in p and item.get_closest_marker("no_target") is None:  # a placeholder is no case
        item.user_properties.append(("mpt_kv", p))
        return p
    reason = no_target_reason(item)
    if reason:
        item.user_properties.append(("mpt_kv_no_target", reason))
    return None


def no_target_reason(item) -> str | None:
    """For the placeholder of a conformance test that has no target of this run (its `no_target`
    marker, e.g. the families' case when no implementation is a target): why. The gate refuses a run
    made of such placeholders alone (gate.no_target). A run with no target at all (--only-targets
    without one) never gets here: options.only_targets refuses it."""
    marker = item.get_closest_marker("no_target")
    if marker is None:
        return None
    return marker.args[0] if marker.args else "no target of this run applies"


def record_of(item) -> dict:
    """What a labelled item will report, before it runs (gate.check_collected)."""
    props = dict(item.user_properties)
    if "mpt_kv" in props:
        return {**props["mpt_kv"], "nodeid": item.nodeid}
    return {"no_target": props.get("mpt_kv_no_target"), "nodeid": item.nodeid}


def params_of(item) -> dict:
    cs = getattr(item, "callspec", None)
    params = dict(cs.params) if cs else {}
    if any(v is NOTSET for v in params.values()):
        # pytest's placeholder of an empty parametrization (e.g. the families' cases of a run whose
        # targets are a user's alone): no case at all, so nothing of a conformance case either
        return {}
    p = check_params(params)
    prop = item.get_closest_marker("property")
    # `implementation`: a family case's (mpt_kv.conformance.test_families) run target, which the gate judges
    out = {k: p[k] for k in ("target", "device", "path", "bucket", "check", "implementation") if k in p}
    if "dtype" in p:
        out["dtype"] = str(p["dtype"]).replace("torch.", "")
    if prop:
        out["property"] = prop.args[0]
    return out


def check_params(params: dict) -> dict:
    """A registry check's property, path and bucket, and a target factory's name, as report fields."""
    check = params.get("check")
    if check is not None and hasattr(check, "property") and hasattr(check, "id"):
        params = {**params, "check": check.id, "path": check.path, "bucket": check.bucket}
        if check.path is None:
            del params["path"]
    target = params.get("target")
    if target is not None and not isinstance(target, str):
        from mpt_kv.targets import target_name  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

        params["target"] = target_name(target)
        if hasattr(target, "implementation_name"):  # a FamilyTarget: the gate judges its implementation's ports
            params["implementation"] = target.implementation_name
            if "device" in params:  # cpu+standin where HPU kernels ran as mpt-kv's stand-ins (the matrix's row)
                from mpt_kv.families.habana_standin import device_label

                params["device"] = device_label(target, params["device"], params.get("path"))
    return params


# --- while a case runs ----------------------------------------------------------------------------------------------

def run_context(item, stored_ceilings, expected_to_fail: bool):
    """For a test parametrized with registry checks: the RunContext its checks record into (their
    measurements, notes and capabilities go on the case's user_properties). None for any other
    test: a check called by hand elsewhere stays a plain function (analytic memory only)."""
    registry = sys.modules.get("mpt_kv.checks.registry")  # not imported: no check in this session
    params = getattr(getattr(item, "callspec", None), "params", {})
    if registry is None or not isinstance(params.get("check"), registry.Check):
        return None
    from mpt_kv.checks.running import RunContext  # (torch: imported by the registry already)

    return RunContext(lambda name, value: item.user_properties.append((name, value)),
                      stored_ceilings(item.config), expected_to_fail)


def outcome_of(excinfo) -> str:
    """'failed' only for PropertyFailure (also a group of them); 'unsupported' for Unsupported;
    any other exception is the target's or the adapter's 'error' (a TypeError from a forward
    without a keyword, an AttributeError, a corrupt ceilings file)."""

    if sys.version_info >= (3, 11):
        from builtins import BaseExceptionGroup
    else:  # hypothesis's own dependency on 3.10
        from exceptiongroup import BaseExceptionGroup

    exc = excinfo.value
    if isinstance(exc, Unsupported):
        return "unsupported"
    if isinstance(exc, pytest.skip.Exception):
        return "skipped"
    leaves = [exc]
    while any(isinstance(e, BaseExceptionGroup) for e in leaves):
        leaves = [x for e in leaves for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])]
    return "failed" if all(isinstance(e, PropertyFailure) for e in leaves) else "error"


def record_outcome(report, call) -> None:
    """The matrix's word for a finished phase (after any xfail handling), on the report."""
    if report.when == "setup" and report.failed:
        report.user_properties.append(("mpt_kv_outcome", "error"))
    elif call.excinfo is not None and report.when == "call" and not hasattr(report, "wasxfail"):
        report.user_properties.append(("mpt_kv_outcome", outcome_of(call.excinfo)))
    elif report.when == "call" and isinstance(report.longrepr, str) and report.longrepr.startswith("[XPASS(strict)]"):
        report.user_properties.append(("mpt_kv_outcome", "XPASS"))


# --- the reports, as they arrive (on the xdist controller: from every worker) ---------------------------------------

def _word(report) -> str:
    outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    if hasattr(report, "wasxfail") and report.passed:
        outcome = "XPASS"
    return dict(report.user_properties).get("mpt_kv_outcome", outcome)


MESSAGE_CHARS = 2000  # of a case's failure message kept in the JSON report (the markdown summary cuts further)


def message_of(report) -> str | None:
    """What a case that did not pass says, in one string: its exception's message (failed, error),
    its known failure's reason (xfail), or its skip reason; None for a pass."""
    if report.passed and not hasattr(report, "wasxfail"):
        return None
    if hasattr(report, "wasxfail"):
        text = report.wasxfail
    else:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else (report.longrepr[-1] if isinstance(report.longrepr, tuple)
                                                        else str(report.longrepr or ""))
    text = str(text).strip()
    return text[:MESSAGE_CHARS] or None


def collect(state, report) -> None:
    """A case's call report, or its setup report where that did not pass (a device case whose
    setup errored counts as a case of that device), into the run's state."""
    results, memory, extras = state.results, state.memory, state.extras
    if not (report.when == "call" or (report.when == "setup" and report.outcome != "passed")):
        return
    props = dict(report.user_properties)
    kinds = props.get("mpt_kv_kinds", [])
    if "mpt_kv" in props:
        notes = [v for k, v in report.user_properties if k == "mpt_kv_note"]
        record = {**props["mpt_kv"], "outcome": _word(report), "nodeid": report.nodeid, "notes": notes,
                  "kinds": kinds, "seconds": round(report.duration, 3)}
        message = message_of(report)
        if "mpt_kv_upstream" in props:  # a known failure's upstream file and line, for the lines under the matrix
            record["upstream"] = props["mpt_kv_upstream"]
        if "mpt_kv_cache" in props:  # what showed a cache exists (gate: a cache case counts only with it)
            record["cache"] = props["mpt_kv_cache"]
        results.append({**record, "message": message} if message else record)
    else:  # any other case: its call, or its setup where that failed (a placeholder says it has no target)
        results.append({"outcome": report.outcome, "nodeid": report.nodeid, "kinds": kinds,
                        **({"no_target": props["mpt_kv_no_target"]} if "mpt_kv_no_target" in props else {})})
    for name, value in report.user_properties:
        if name == "mpt_kv_memory":
            memory.append({**value, "outcome": _word(report), "nodeid": report.nodeid})
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == "mpt_kv_capabilities":
            extras["capabilities"][value["target"]] = value["unsupported"]
        elif name == "mpt_kv_unrecorded":
            key = f"{value['target']}|{value['device']}|{value['file']}"
            extras["unrecorded"].setdefault(key, {**value, "cases": 0})["cases"] += 1
        elif name == "mpt_kv_reach":
            extras["reach"].append(value)
