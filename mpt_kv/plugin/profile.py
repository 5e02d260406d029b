"""The run's profile: `full` (every conformance case; the default, the nightly and main-branch job) or
`gate` (the per-pull-request subset computed from the catalogues: mpt_kv/catalogue/gate_profile.py).

    pytest --pyargs mpt_kv.conformance --mpt-kv-profile gate      # or ini: mpt_kv_profile = gate

A gate-profile run keeps the conformance cases whose (check id, dtype) the stored profile names, on
every target and device of the run, and deselects the others (pytest's "deselected" count); a project's
own tests are kept. Fail closed:

- a stored profile that does not match the installed catalogue (stale, missing, malformed, edited) is a
  usage error before any test, and so is a gate-profile run that keeps no conformance case;
- the profile's claim (its cases kill every catalogue variant) holds only where every case of it runs,
  on every target and device the run collected MPT cases for. What the run's own selection leaves out
  (-k, -m, --deselect, --lf, --sw, --dtype, the test files: anything that removes a collected item, read
  from the final selection at pytest_collection_finish) is named with the variants no kept case kills.
  Under CI that is a usage error before any test (under xdist the workers run nothing and the controller
  says it, exit 4); elsewhere the summary says which variants the run leaves unkilled;
- a kept case that never ran (-x or --maxfail stopping the run, an interrupt) is known at the end only:
  the summary then does not claim the profile ran, and under CI the run fails with that reason.
"""

from __future__ import annotations

import pytest

from mpt_kv.plugin import outcomes
from mpt_kv.plugin.gate import in_ci
from mpt_kv.plugin.state import run_state

OPTION_HELP = ("which conformance cases to run: full (every case; the default: nightly and main-branch jobs) or gate "
               "(the per-PR subset that still kills every catalogue variant, computed from the kill matrix's data "
               "and stored in the package: python -m mpt_kv gateprofile; docs/gate.md)")
KEY = pytest.StashKey[dict]()
WORKER_OUTPUT = "mpt_kv_profile"


def add_options(parser) -> None:
    from mpt_kv.catalogue.gate_profile import PROFILES  # no torch: the module imports it only where it runs checks

    parser.getgroup("mpt-kv").addoption("--mpt-kv-profile", choices=PROFILES, default=None, help=OPTION_HELP)
    parser.addini("mpt_kv_profile", default="", help=f"mpt-kv: as --mpt-kv-profile ({', '.join(PROFILES)})")


def name(config) -> str:
    """--mpt-kv-profile, else the ini option mpt_kv_profile, else full; an unknown ini value is a usage error."""
    from mpt_kv.catalogue.gate_profile import PROFILES

    option = config.getoption("mpt_kv_profile", None)
    if option:
        return option
    ini = (config.getini("mpt_kv_profile") or "").strip()
    if ini and ini not in PROFILES:
        raise pytest.UsageError(f"ini option mpt_kv_profile = {ini!r}: expected one of {', '.join(PROFILES)}")
    return ini or "full"


def configure(config) -> None:
    """Before any test: the profile's name checked; for gate, the stored profile loaded and matched with the
    installed catalogue (a usage error naming why, and the command that brings it up to date)."""
    # groups: the (target, device) pairs the run collected MPT conformance cases for, before any selection;
    # kept: the profile's (target, device, check id, dtype) left after the run's whole selection
    state = {"name": name(config), "profile": None, "deselected": 0, "groups": set(), "kept": set(), "refused": False}
    config.stash[KEY] = state
    if state["name"] != "gate":
        return
    from mpt_kv.catalogue import gate_profile

    try:
        profile = gate_profile.load()
    except gate_profile.ProfileError as e:
        raise pytest.UsageError(f"--mpt-kv-profile gate: {e}") from None
    reason = gate_profile.stale_reason(profile)
    if reason:
        raise pytest.UsageError(f"--mpt-kv-profile gate: {reason}")
    if not profile.cases:
        raise pytest.UsageError("--mpt-kv-profile gate: the stored gate profile selects no case: a gate that ran "
                                f"nothing; run `{gate_profile.UPDATE}`")
    state["profile"] = profile


def _key(params: dict):
    """(target, device, check id, dtype name) of a conformance case's fields; None without all four."""
    from mpt_kv.catalogue.gate_profile import DTYPE_NAMES

    key = (params.get("target"), params.get("device"), params.get("check"),
           DTYPE_NAMES.get(params.get("dtype", ""), params.get("dtype")))
    return key if all(key) else None


def _params(item) -> dict:
    return dict(item.user_properties).get("mpt_kv") or outcomes.params_of(item)


def _is_mpt_case(params: dict) -> bool:
    """A conformance case of an MPT check (the profile's candidates), not a family check's."""
    from mpt_kv.checks import index

    try:
        return not index.by_name(params["property"]).family
    except KeyError:
        return False


def select(config, items: list) -> None:
    """Keep the gate's conformance cases and every other test; deselect the rest (pytest_collection_modifyitems,
    before -k, -m and the others select: what they remove is read at the end of collection, `check_collected`)."""
    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None:
        return
    from mpt_kv.catalogue.gate_profile import GateCase

    profile = state["profile"]
    kept, dropped = [], []
    for item in items:
        params = _params(item)
        if "property" not in params or "target" not in params:  # not a conformance case (nor a family placeholder)
            kept.append(item)
            continue
        key = _key(params)
        if key is not None and _is_mpt_case(params):
            state["groups"].add(key[:2])
        if key is not None and GateCase(*key[2:]) in profile.cases:
            kept.append(item)
        else:
            dropped.append(item)
    state["deselected"] += len(dropped)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def check_collected(session) -> None:
    """At the end of collection (pytest_collection_finish, tryfirst: before xdist's worker sends its
    collection): the profile's cases left after the run's whole selection. A gate-profile run that kept no
    conformance case is a usage error; under CI so is one whose selection left out a case the profile needs
    (in an xdist worker: it runs nothing, and tells the controller at its end)."""
    config = session.config
    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None:
        return
    from mpt_kv.catalogue.gate_profile import GateCase

    cases = state["profile"].cases
    kept = {key for key in map(_key, map(_params, session.items)) if key and GateCase(*key[2:]) in cases}
    state["kept"] = kept
    worker = hasattr(config, "workerinput")
    if not worker and not any("property" in (dict(i.user_properties).get("mpt_kv") or {}) for i in session.items):
        raise pytest.UsageError(
            f"--mpt-kv-profile gate kept no conformance case ({state['deselected']} deselected): its "
            f"{len(state['profile'].cases)} cases ({', '.join(map(str, state['profile'].cases))}) are not among "
            "this run's (its -k, -m, --dtype, targets or test files): a gate that ran nothing")
    refused = in_ci() and left_out_line(config)
    if refused and not worker:
        raise pytest.UsageError(refused)
    if refused:
        session.items[:] = []  # before xdist sends this worker's collection: no test runs
        state["refused"] = True
    if worker:
        config.workeroutput[WORKER_OUTPUT] = {"groups": sorted(state["groups"]), "kept": sorted(kept),
                                              "refused": state["refused"]}


def from_worker(node) -> None:
    """xdist controller: what a worker's collection kept (every worker collects the same)."""
    out = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT)
    state = node.config.stash.get(KEY, None)
    if out and state:
        state["groups"] |= {tuple(g) for g in out["groups"]}
        state["kept"] |= {tuple(k) for k in out["kept"]}
        state["refused"] |= out["refused"]


# --- what the run's selection and its end leave of the profile ------------------------------------------------------

def _status(config) -> dict | None:
    """Per (target, device) the run collected MPT cases for: the profile's cases it left out before any test
    (`left_out`) and those it kept that produced no report (`not_run`). None outside a gate-profile run."""
    from mpt_kv.catalogue.gate_profile import GateCase

    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None:
        return None
    ran = {key for key in map(_key, run_state(config).results) if key}
    out = {}
    for group in sorted(state["groups"]):
        kept = {GateCase(*k[2:]) for k in state["kept"] if k[:2] == group}
        ran_here = {GateCase(*k[2:]) for k in ran if k[:2] == group}
        out[group] = {"left_out": [c for c in state["profile"].cases if c not in kept],
                      "not_run": [c for c in state["profile"].cases if c in kept and c not in ran_here]}
    return out


def _where(groups) -> str:
    return ", ".join(f"{target}/{device}" for target, device in groups)


def _lost(profile, status: dict, part: str) -> tuple[int, str, str]:
    """(how many of the profile's cases are in `part` at most per group, which where, what no case that
    remains kills or meets)."""
    by_cases: dict[tuple, list] = {}
    for group, s in status.items():
        if s[part]:
            by_cases.setdefault(tuple(s[part]), []).append(group)
    where = "; ".join(f"on {_where(groups)}: {', '.join(map(str, cases))}" for cases, groups in by_cases.items())
    unkilled, unmet = set(), []
    for group, s in status.items():
        left = [c for c in profile.cases if c not in s["left_out"] and (part == "left_out" or c not in s["not_run"])]
        unkilled |= set(profile.unkilled(left))
        unmet += [r for r in profile.unmet(left) if r not in unmet]
    if unkilled:
        verb = "is" if len(unkilled) == 1 else "are"
        lost = (f"{len(unkilled)} of the {len(profile.killers)} catalogue variants {verb} killed by no case that "
                f"remains ({', '.join(sorted(unkilled))})")
    else:
        lost = "every variant they kill is killed by a case that remains"
    if unmet:
        lost += f"; of the required coverage no case that remains keeps {', '.join(unmet)}"
    return max(len(cases) for cases in by_cases), where, lost


def left_out_line(config) -> str | None:
    """One line naming what the run's selection left out of the profile, before any test (None: nothing)."""
    status = _status(config)
    if not status or not any(s["left_out"] for s in status.values()):
        return None
    profile = config.stash[KEY]["profile"]
    n, where, lost = _lost(profile, status, "left_out")
    return (f"--mpt-kv-profile gate: this run's selection (-k, -m, --deselect, --lf, --dtype or its test files) leaves "
            f"out {n} of the stored profile's {len(profile.cases)} cases ({where}): {lost}: this run does not gate "
            "them (run the gate profile whole, or the full profile)")


def not_run_line(config) -> str | None:
    """One line naming the profile's kept cases that never ran (-x, --maxfail, an interrupt), at the end."""
    status = _status(config)
    if not status or not any(s["not_run"] for s in status.values()) or config.stash[KEY]["refused"]:
        return None  # refused: the workers ran nothing because of what the selection left out (left_out_line)
    if config.getoption("collectonly", False):
        return None  # nothing was to run (the summary says so)
    profile = config.stash[KEY]["profile"]
    n, where, lost = _lost(profile, status, "not_run")
    return (f"--mpt-kv-profile gate: {n} of the stored profile's {len(profile.cases)} cases that this run kept did not "
            f"run (-x, --maxfail or an interrupt stopped it first) ({where}): {lost}: the gate profile did not run whole")


def verdict(config) -> list[str]:
    """Under CI, every reason the profile fails this run at its end (the controller's, under xdist, also for a
    selection the workers refused); elsewhere none (the summary says it)."""
    if hasattr(config, "workerinput") or not in_ci():
        return []
    return [line for line in (left_out_line(config), not_run_line(config)) if line]


def usage_error(config) -> bool:
    """Under CI, a selection that left out a profile case: the exit status of a usage error (4), also where
    xdist's workers refused it and only the controller's end can say so."""
    return not hasattr(config, "workerinput") and in_ci() and left_out_line(config) is not None


def summary(tw, config) -> None:
    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None or hasattr(config, "workerinput"):
        return
    profile = state["profile"]
    lines = [line for line in (left_out_line(config), not_run_line(config)) if line]
    if not state["groups"]:
        tw.write_line(f"mpt-kv profile gate: no case of the stored profile's {len(profile.cases)} ran: this run "
                      "gates no catalogue variant", red=True)
        return
    if config.getoption("collectonly", False):
        tw.write_line(f"mpt-kv profile gate: --collect-only: the stored profile's cases were collected on "
                      f"{_where(sorted(state['groups']))}, and none ran")
    elif not lines:
        waiting = f"; {len(profile.waiting)} waiting: no check kills them yet" if profile.waiting else ""
        tw.write_line(f"mpt-kv profile gate: all {len(profile.cases)} cases of the stored profile ran on "
                      f"{_where(sorted(state['groups']))}: they kill every catalogue variant ({len(profile.killers)} "
                      f"variants{waiting}); {state['deselected']} conformance cases deselected; the whole run (the "
                      "default profile) is the nightly and main-branch job")
        return
    for line in lines:
        tw.write_line(line.replace("--mpt-kv-profile gate: ", "mpt-kv profile gate: "), red=in_ci(), yellow=not in_ci())
