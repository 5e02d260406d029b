"""The run's profile: `full` (every conformance case; the default, the nightly and main-branch job) or
`gate` (the per-pull-request subset computed from the catalogues: mpt_kv/catalogue/gate_profile.py).

    pytest --pyargs mpt_kv.conformance --mpt-kv-profile gate      # or ini: mpt_kv_profile = gate

A gate-profile run keeps the conformance cases whose (check id, dtype) the stored profile names, on
every target and device of the run, and deselects the others (pytest's "deselected" count); a project's
own tests are kept. Fail closed: a stored profile that does not match the installed catalogue (stale,
missing, malformed) is a usage error before any test, and so is a gate-profile run that keeps no
conformance case (with -k or -m, say). A profile case this run did not collect (--dtype fp32 leaves out
a bf16 one) is named in the summary: the variants only it kills are not gated by this run.
"""

from __future__ import annotations

import pytest

from mpt_kv.plugin import outcomes

OPTION_HELP = ("which conformance cases to run: full (every case; the default: nightly and main-branch jobs) or gate "
               "(the per-PR subset that still kills every catalogue variant, computed from the kill matrix's data "
               "and stored in the package: python -m mpt_kv gateprofile; docs/gate.md)")
KEY = pytest.StashKey[dict]()


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
    state = {"name": name(config), "profile": None, "kept": 0, "deselected": 0, "collected": set()}
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


def _case_of(params: dict):
    from mpt_kv.catalogue.gate_profile import DTYPE_NAMES, GateCase

    check, dtype = params.get("check"), DTYPE_NAMES.get(params.get("dtype", ""), params.get("dtype"))
    return GateCase(check, dtype) if check and dtype else None


def select(config, items: list) -> None:
    """Keep the gate's conformance cases and every other test; deselect the rest (pytest_collection_modifyitems)."""
    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None:
        return
    profile = state["profile"]
    kept, dropped = [], []
    for item in items:
        params = dict(item.user_properties).get("mpt_kv") or outcomes.params_of(item)
        if "property" not in params or "target" not in params:  # not a conformance case (a family placeholder is kept too)
            kept.append(item)
            continue
        case = _case_of(params)
        if case is not None and case in profile.cases:
            kept.append(item)
            state["collected"].add(case)
        else:
            dropped.append(item)
    state["kept"] += len(kept)
    state["deselected"] += len(dropped)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def check_collected(session) -> None:
    """A gate-profile run that kept no conformance case is a usage error (pytest_collection_finish; not on an
    xdist controller, which collects nothing, nor in a worker: a run of no case fails at its end anyway)."""
    state = session.config.stash.get(KEY, None)
    if not state or state["profile"] is None or hasattr(session.config, "workerinput"):
        return
    if not any("property" in (dict(i.user_properties).get("mpt_kv") or {}) for i in session.items):
        raise pytest.UsageError(
            f"--mpt-kv-profile gate kept no conformance case ({state['deselected']} deselected): its "
            f"{len(state['profile'].cases)} cases ({', '.join(map(str, state['profile'].cases))}) are not among "
            "this run's (its -k, -m, --dtype, targets or test files): a gate that ran nothing")


def summary(tw, config) -> None:
    state = config.stash.get(KEY, None)
    if not state or state["profile"] is None:
        return
    profile = state["profile"]
    tw.write_line(f"mpt-kv profile gate: {len(profile.cases)} cases of the stored profile kill every catalogue "
                  f"variant ({len(profile.killers)} variants); {state['deselected']} conformance cases deselected; "
                  "the whole run (the default profile) is the nightly and main-branch job")
    if hasattr(config, "workerinput") or not state["kept"]:
        return
    missing = [c for c in profile.cases if c not in state["collected"]]
    if missing:
        alone = sorted(v for v, c in profile.killers.items() if c in missing)
        tw.write_line(f"mpt-kv profile gate: this run did not collect {', '.join(map(str, missing))} (its options "
                      f"left them out): the variants they kill ({', '.join(alone) or 'none alone'}) are not gated by "
                      "this run", yellow=True)
