"""Known upstream failures (mpt_kv/targets/known_failures.json, or the project's own file): a
case an entry covers is a strict xfail that only the PropertyFailure its pattern names
satisfies; a pass (upstream fixed it) or any other failure fails the case, saying why. Entries
that cover no case of the run are listed (an error with --strict-known-failures).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from mpt_kv.plugin.options import (BUILTIN_PACKAGES, ENV_KNOWN_FAILURES, ini_relative, strict_known_failures,
                                   target_specs)

KNOWN = pytest.StashKey[object]()  # item -> its known_failures.Entry
_xfailed: defaultdict = defaultdict(int)  # entry index -> cases it xfailed


def path(config):
    """The known-failures file: $MPT_KV_KNOWN_FAILURES, else the project's (ini
    mpt_kv_known_failures, relative to the ini file), else the packaged one. One file: a project
    lists the entries that apply to what it runs (copying mpt-kv's where it runs built-in targets)."""
    from mpt_kv.targets import known_failures

    ini = config.getini("mpt_kv_known_failures")
    return os.environ.get(ENV_KNOWN_FAILURES) or (ini_relative(config, ini) if ini else known_failures.FILE)


def configure(config) -> None:
    """Load the file (malformed: a usage error naming the file, the entry and the problem)."""
    from mpt_kv.targets import known_failures

    try:
        config._mpt_kv_known = known_failures.load(path(config))
    except known_failures.KnownFailuresError as e:
        raise pytest.UsageError(str(e)) from None
    config._mpt_kv_known_covered = set()
    config._mpt_kv_known_cases = False
    _xfailed.clear()


def note_case(config, item, params: dict) -> None:
    """At collection (before -m/-k deselect: an entry is judged against every collected case):
    which entries cover this conformance case, and the one that applies to it."""
    config._mpt_kv_known_cases = True
    for e in config._mpt_kv_known:
        if e.covers(params["target"], params["property"], params.get("path"), params.get("bucket"), params.get("check")):
            config._mpt_kv_known_covered.add(e.index)
    entry = match(params, config._mpt_kv_known)
    if entry is not None:
        item.stash[KNOWN] = entry


def tell_controller(config) -> None:
    """xdist worker: the controller, which collects nothing, learns what was covered."""
    if hasattr(config, "workeroutput"):
        config.workeroutput["mpt_kv_known"] = {"covered": sorted(config._mpt_kv_known_covered),
                                               "cases": config._mpt_kv_known_cases}


def from_worker(node) -> None:
    known = getattr(node, "workeroutput", {}).get("mpt_kv_known")
    if known:
        node.config._mpt_kv_known_covered |= set(known["covered"])
        node.config._mpt_kv_known_cases |= known["cases"]


def match(params: dict, entries):
    for e in entries:
        if e.covers(params["target"], params["property"], params.get("path"), params.get("bucket"), params.get("check")) and e.applies():
            return e
    return None


def expected_to_fail(item) -> bool:
    return item.get_closest_marker("xfail") is not None or item.stash.get(KNOWN, None) is not None


def words_for(entry) -> tuple[str, str]:
    """How a case's entry is named: mpt-kv's own file records upstream's failures; a project's own
    file records the project's (its own bug kept on purpose, or an upstream one it depends on)."""
    from mpt_kv.targets.known_failures import FILE

    if Path(entry.file).resolve() == FILE.resolve():
        return "known upstream failure", "upstream fixed it"
    return f"known failure of this project ({Path(entry.file).name})", "it is fixed"


def apply(item, report, call) -> None:
    """A case with a known-failure entry, after its call: xfail only the PropertyFailure its
    pattern names. A pass (upstream fixed it) or any other failure fails the case, saying why."""
    entry = item.stash.get(KNOWN, None)
    if entry is None or report.when != "call":
        return
    excinfo = call.excinfo
    kind, fixed = words_for(entry)
    if report.passed:
        report.outcome = "failed"
        report.longrepr = (f"[XPASS(strict)] {kind} {entry.name} did not happen: {entry.reason} "
                           f"-- if {fixed}, remove or narrow the entry in {entry.file}")
    elif report.failed and excinfo is not None and entry.explains(excinfo.value):
        report.outcome = "skipped"
        report.wasxfail = f"{kind}, {entry.name}: {entry.reason}"
        report.user_properties = [*report.user_properties, ("mpt_kv_known_xfail", entry.index)]
    elif report.failed:
        report.sections.append(("mpt-kv known failure", (
            f"{entry.name} in {entry.file} expects a PropertyFailure whose message matches "
            f"/{entry.pattern.pattern}/; this failure is not that one, so the case fails")))


def count(report) -> None:
    """On the controller: a case an entry xfailed."""
    if report.when == "call":
        index = dict(report.user_properties).get("mpt_kv_known_xfail")
        if index is not None:
            _xfailed[index] += 1


def unmatched(config) -> list:
    """Entries that apply to the installed versions but cover no case this run collected (a
    typo, or a target, property or path that is gone). None judged if no conformance case was
    collected at all (e.g. only the suite's own tests ran). An entry about a built-in target this
    run does not run (--only-targets: mpt-kv's own entries for its transformers target) is not
    unmatched: it has no case here to match (`elsewhere`)."""
    if not config._mpt_kv_known_cases:
        return []
    return [e for e in config._mpt_kv_known if e.applies() and e.index not in config._mpt_kv_known_covered
            and not elsewhere(config, e)]


def elsewhere(config, entry) -> bool:
    """The entry is about a built-in target that is not a target of this run, or whose package is
    not installed here (no case of it is generated). A target that is neither built in nor run stays
    unmatched: it may be a typo of the project's own target."""
    from mpt_kv.plugin.parametrize import generated_targets

    return entry.target in BUILTIN_PACKAGES and entry.target not in generated_targets(config)


def strict_failure(config) -> bool:
    return bool(strict_known_failures(config) and unmatched(config))


def summary(tw, config) -> None:
    entries = config._mpt_kv_known
    missing = unmatched(config)
    used = [e for e in entries if _xfailed.get(e.index)]
    away = [e for e in entries if config._mpt_kv_known_cases and e.applies()
            and e.index not in config._mpt_kv_known_covered and elsewhere(config, e)]
    if not (used or missing or away):
        return
    tw.write_sep("=", "mpt-kv known failures")
    for e in used:
        tw.write_line(f"{e.name}: {_xfailed[e.index]} cases xfailed as known")
    strict = strict_known_failures(config)
    targets = target_specs(config)
    for e in missing:
        why = (f"a typo, or its property, path or check is gone (its target {e.target!r} runs)"
               if e.target in targets else
               f"its target {e.target!r} is no target of this run ({', '.join(targets)}): a typo, or the target is gone")
        tw.write_line(f"{e.name} in {e.file} matched no case of this run: {why}"
                      f"{' (--strict-known-failures: an error)' if strict else ''}", red=strict)
    if away:
        tw.write_line(f"{len(away)} entries are about built-in targets this run does not run "
                      f"({', '.join(sorted({e.target for e in away}))})")
    rest = len([e for e in entries if not e.applies()])
    if rest:
        tw.write_line(f"{rest} entries do not apply to the installed versions")
