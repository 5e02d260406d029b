"""Known upstream failures in a run: the pytest side of the one rule for every conformance case
(`mpt_kv.findings.entries`: the entry format, which entry applies to a case, what it explains). The
MPT targets' entries (mpt_kv/findings/known_failures.json, or the project's own file) and the family
checks' (mpt_kv/findings/family_known_failures.json, loaded with the first family case: the families'
registry imports torch). A case an entry covers is a strict xfail that only the PropertyFailure its
pattern names satisfies; a pass (upstream fixed it) or any other failure fails the case, saying why.
Entries that cover no case of the run are listed (an error with --strict-known-failures).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from mpt_kv.plugin.parametrize import generated_kinds, generated_targets
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin.options import (BUILTIN_PACKAGES, dtype_names, known_failures_file, strict_known_failures,
                                   target_specs)
from mpt_kv.findings import entries as known_entries

KNOWN = pytest.StashKey[object]()  # item -> its mpt_kv.findings.entries.Entry


def configure(config) -> None:
    """Load the file (malformed: a usage error naming the file, the entry and the problem)."""

    try:
        run_state(config).known = known_entries.load(known_failures_file(config))
    except known_entries.KnownFailuresError as e:
        raise pytest.UsageError(str(e)) from None


def family_entries(config) -> list:
    """The family checks' entries, loaded once (their registry imports torch, so not at configure)."""
    state = run_state(config)
    if state.family_known is None:
        state.family_known = known_entries.load_families()
    return state.family_known


def entries(config) -> list:
    """Every entry this run judges: the MPT file's, and the families' where a family case was collected."""
    state = run_state(config)
    return state.known + (family_entries(config) if state.family_cases else [])


def note_case(config, item, params: dict) -> None:
    """At collection (before -m/-k deselect: an entry is judged against every collected case):
    which entries cover this conformance case, and the one that applies to it. A family case's
    entries are the ones its target may take (`mpt_kv.findings.known.entries_for`: what a family
    declaration inherits from its fork_of; none of a built-in implementation's by name for a fork
    passed under that name)."""
    state = run_state(config)
    state.known_cases = True
    state.family_cases |= bool(params.get("implementation"))
    candidates = entries(config)
    if params.get("implementation"):
        from mpt_kv.findings.known import entries_for  # lazy: it imports torch (a family case's target already did)

        try:
            candidates = entries_for(getattr(item, "callspec").params.get("target"), candidates)
        except known_entries.KnownFailuresError as e:  # a fork's fixes= naming nothing it inherits
            raise pytest.UsageError(str(e)) from None
    for e in candidates:
        if e.covers(params["target"], params["property"], params.get("path"), params.get("bucket"), params.get("check"),
                    params.get("dtype"), params.get("device")):
            state.known_covered.add(e.key)
    applying = matching(params, candidates)
    if applying:
        item.stash[KNOWN] = applying


def tell_controller(config) -> None:
    """xdist worker: the controller, which collects nothing, learns what was covered."""
    if hasattr(config, "workeroutput"):
        state = run_state(config)
        config.workeroutput["mpt_kv_known"] = {"covered": sorted(state.known_covered), "cases": state.known_cases,
                                               "family_cases": state.family_cases}


def from_worker(node) -> None:
    known = getattr(node, "workeroutput", {}).get("mpt_kv_known")
    if known:
        state = run_state(node.config)
        state.known_covered |= {tuple(key) for key in known["covered"]}
        state.known_cases |= known["cases"]
        state.family_cases |= known.get("family_cases", False)


def matching(params: dict, entries) -> list:
    """The entries that apply to a conformance case (its parametrization), by the one rule."""
    return known_entries.matching(params["target"], params["property"], params.get("path"), entries,
                                  params.get("bucket"), params.get("check"), params.get("dtype"), params.get("device"))


def expected_to_fail(item) -> bool:
    return item.get_closest_marker("xfail") is not None or item.stash.get(KNOWN, None) is not None


def will_xfail(item, excinfo) -> bool:
    """Whether this failure of a case is the one it is expected to have (its entry explains it, or
    its xfail marker's `raises` takes it): pytest then shows only the reason, never the traceback."""
    applying = item.stash.get(KNOWN, None)
    if applying is not None:
        return known_entries.known_verdict(applying, excinfo.value)[0] == "known"
    marker = item.get_closest_marker("xfail")
    if marker is None or marker.args or marker.kwargs.get("condition") is not None:
        return False  # a conditional xfail: pytest decides
    raises = marker.kwargs.get("raises")
    return raises is None or isinstance(excinfo.value, raises)


@contextlib.contextmanager
def brief_traceback(item, call):
    """An expected failure's traceback is one line (the exception as pytest's xfail line shows it):
    pytest formats every frame of a failure's traceback from its source (an AST parse of each file
    per frame), which took 40% of an optimum-habana conformance run whose 261 known failures each
    raise from deep inside the port; nobody reads those tracebacks. Any other failure keeps it whole."""
    brief = call.when == "call" and call.excinfo is not None and will_xfail(item, call.excinfo)
    if brief:
        item.repr_failure = lambda excinfo, style=None: excinfo.exconly()  # shadows the method, for this call
    try:
        yield
    finally:
        if brief:
            del item.repr_failure


def apply(item, report, call) -> None:
    """A case with known-failure entries, after its call, by `entries.known_verdict`: xfail only when each of
    its independent failures is a PropertyFailure an entry's pattern names and each entry's failure happened. A
    pass, an entry whose failure did not happen (upstream fixed it) or any other failure fails the case, saying why."""
    applying = item.stash.get(KNOWN, None)
    if applying is None or report.when != "call":
        return
    from mpt_kv.findings.known import known_text, xpass_text  # lazy: it imports torch (the case ran: torch is imported)

    excinfo = call.excinfo
    if not (report.passed or report.failed) or (report.failed and excinfo is None):
        return
    verdict, named = known_entries.known_verdict(applying, None if report.passed else excinfo.value)
    if verdict == "pass":
        report.outcome = "failed"
        report.longrepr = "[XPASS(strict)] " + xpass_text(applying)
    elif verdict == "stale":
        report.outcome = "failed"
        report.longrepr = ("[XPASS(strict)] the case failed, but not as these entries say (its other failures are "
                           "known): " + xpass_text(named))
    elif verdict == "known":
        used = named
        report.outcome = "skipped"
        report.wasxfail = known_text(used)
        upstream = "; ".join(e.upstream for e in used if e.upstream)
        report.user_properties = [*report.user_properties, ("mpt_kv_known_xfail", [e.key for e in used]),
                                  *([("mpt_kv_upstream", upstream)] if upstream else [])]
    else:
        report.sections.append(("mpt-kv known failure", "; ".join(
            f"{e.name} in {e.file} expects a PropertyFailure whose message matches /{e.pattern.pattern}/"
            for e in applying) + "; this failure (or one of its independent failures) is not such a one, so the "
            "case fails"))


def count(state, report) -> None:
    """On the controller: a case an entry xfailed."""
    if report.when == "call":
        for key in dict(report.user_properties).get("mpt_kv_known_xfail") or ():
            state.xfailed[tuple(key)] += 1


def unmatched(config) -> list:
    """Entries that apply to the installed versions but cover no case this run collected (a
    typo, or a target, property or path that is gone). None judged if no conformance case was
    collected at all (e.g. only the suite's own tests ran). An entry about a built-in target this
    run does not run (--only-targets: mpt-kv's own entries for its transformers target) is not
    unmatched: it has no case here to match (`elsewhere`)."""
    state = run_state(config)
    if not state.known_cases:
        return []
    return [e for e in entries(config) if e.applies() and e.key not in state.known_covered
            and not elsewhere(config, e)]


# a case's dtype as an entry names it (its report's), from the names --dtype takes
DTYPE_OF_NAME = {"fp32": "float32", "bf16": "bfloat16"}


def elsewhere(config, entry) -> bool:
    """The entry is about a built-in target (or implementation) that is not a target of this run, or
    whose package is not installed here, or about a dtype or device kind the run does not generate
    (--dtype, --device, a device absent here): no case of it is generated. A target that is neither
    built in nor run stays unmatched: it may be a typo of the project's own target."""
    if entry.dtype is not None and entry.dtype not in {DTYPE_OF_NAME[n] for n in dtype_names(config)}:
        return True
    if entry.device is not None and entry.device not in generated_kinds(config):
        return True
    return entry.implementation in BUILTIN_PACKAGES and entry.implementation not in generated_targets(config)


def strict_failure(config) -> bool:
    return bool(strict_known_failures(config) and unmatched(config))


def summary(tw, config) -> None:
    state, every = run_state(config), entries(config)
    missing = unmatched(config)
    used = [e for e in every if state.xfailed.get(e.key)]
    away = [e for e in every if state.known_cases and e.applies()
            and e.key not in state.known_covered and elsewhere(config, e)]
    inherited = {key: n for key, n in state.xfailed.items() if len(key) == 3}  # inherited copies: not in `every`
    if not (used or missing or away or inherited):
        return
    tw.write_sep("=", "mpt-kv known failures")
    for e in used:
        tw.write_line(f"{e.name}: {state.xfailed[e.key]} cases xfailed as known")
    for (file, index, target), n in sorted(inherited.items()):
        tw.write_line(f"entry {index} of {Path(file).name}, inherited by {target.rsplit('/', 2)[0]}: {n} cases xfailed as known")
    strict = strict_known_failures(config)
    targets = target_specs(config)
    for e in missing:
        why = (f"a typo, or its property, path or check is gone (its target {e.target!r} runs)"
               if e.implementation in targets else
               f"its target {e.target!r} is no target of this run ({', '.join(targets)}): a typo, or the target is gone")
        tw.write_line(f"{e.name} in {e.file} matched no case of this run: {why}"
                      f"{' (--strict-known-failures: an error)' if strict else ''}", red=strict)
    if away:
        run_dtypes, kinds = {DTYPE_OF_NAME[n] for n in dtype_names(config)}, generated_kinds(config)
        what = sorted({e.dtype if e.dtype and e.dtype not in run_dtypes else
                       e.device if e.device and e.device not in kinds else e.implementation for e in away})
        tw.write_line(f"{len(away)} entries are about built-in targets this run does not run, or dtypes or "
                      f"devices it leaves out ({', '.join(what)})")
    rest = len([e for e in every if not e.applies()])
    if rest:
        tw.write_line(f"{rest} entries do not apply to the installed versions")
