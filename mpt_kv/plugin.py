"""The pytest plugin: devices, targets, dtypes as parameters; the device gate; the report.

- Every case that takes `device` runs once per kind (cpu, cuda, hpu) and carries the marker of
  that kind, so `pytest -m hpu` selects exactly the HPU cases. A kind that is absent skips
  with the reason, unless it is required (`--require-device hpu` or MPT_KV_REQUIRE_DEVICE=hpu):
  then the run is an error before any test runs, and a run in which no case of a required
  kind passed exits non-zero. A misconfigured Gaudi runner cannot pass the gate by running
  nothing.
- `target` runs once per built-in target and per `--target package.module:factory`.
- Known upstream failures (known_failures.json) become strict xfails.
- The terminal summary prints the conformance matrix; `--mpt-kv-report FILE` writes it as JSON.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

from mpt_kv import devices
from mpt_kv.targets import known_failures
from mpt_kv.model.config import DTYPES
from mpt_kv.errors import TargetUnavailable
from mpt_kv.targets import BUILTIN

ENV_REQUIRE = "MPT_KV_REQUIRE_DEVICE"
_results: list[dict] = []
PROPERTY_NAMES = {"P0": "oracle", "P1": "cached=uncached", "P2": "static=concat", "P3": "no aliasing",
                  "memory": "memory ceilings", "static-shape": "static shapes"}
_memory: list[dict] = []  # measurements of mpt_kv/conformance/test_memory.py (user_properties "mpt_kv_memory")


def pytest_addoption(parser):
    g = parser.getgroup("mpt-kv", "mpt-kv KV cache conformance")
    g.addoption("--device", action="append", choices=devices.KINDS, default=None,
                help="run cases on this device kind only (repeatable; default: every kind, absent ones skip)")
    g.addoption("--require-device", action="append", choices=devices.KINDS, default=[],
                help=f"fail unless this device is present and at least one of its cases passed (repeatable; "
                     f"also ${ENV_REQUIRE}=hpu,cuda)")
    g.addoption("--target", action="append", default=[], metavar="SPEC",
                help="add a target: a built-in name or package.module:factory (repeatable)")
    g.addoption("--only-targets", action="store_true",
                help="run only the --target ones, not the built-in reference/transformers/optimum-habana")
    g.addoption("--dtype", action="append", choices=sorted(DTYPES), default=None,
                help="dtypes to run (repeatable; default fp32 and bf16)")
    g.addoption("--mpt-kv-report", metavar="FILE", default=None, help="write the conformance matrix as JSON")
    add_ceiling_options(g)


def required_devices(config) -> list[str]:
    env = [k.strip() for k in os.environ.get(ENV_REQUIRE, "").split(",") if k.strip()]
    bad = [k for k in env if k not in devices.KINDS]
    if bad:
        raise pytest.UsageError(f"{ENV_REQUIRE}={os.environ[ENV_REQUIRE]!r}: unknown kind {bad}, expected {devices.KINDS}")
    return sorted(set(config.getoption("require_device") + env))


def pytest_configure(config):
    devices.pin_worker_to_card()
    for kind in devices.KINDS:
        config.addinivalue_line("markers", f"{kind}: a case on the {kind} device")
    config.addinivalue_line("markers", "property(name): which property (P0-P3) the test checks")
    from mpt_kv.checks.strategies import load_profile

    config._mpt_kv_profile = load_profile()
    config._mpt_kv_required = required_devices(config)
    _results.clear()  # one list per process: the controller's (or a worker's) reports
    _memory.clear()


def pytest_sessionstart(session):
    for kind in session.config._mpt_kv_required:
        reason = devices.unavailable_reason(kind)
        if reason:
            raise pytest.UsageError(f"--require-device {kind}: {kind} is not available here: {reason}. "
                                    f"This runner cannot gate {kind} changes.")


def target_specs(config) -> list[str]:
    extra = config.getoption("target")
    return extra if config.getoption("only_targets") else [*BUILTIN, *[t for t in extra if t not in BUILTIN]]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "device" in metafunc.fixturenames:
        kinds = config.getoption("device") or list(devices.KINDS)
        metafunc.parametrize("device", [pytest.param(k, marks=getattr(pytest.mark, k), id=k) for k in kinds],
                             indirect=True)
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", target_specs(config), indirect=True)
    if "dtype" in metafunc.fixturenames:
        names = config.getoption("dtype") or ["fp32", "bf16"]
        metafunc.parametrize("dtype", [pytest.param(DTYPES[n], id=n) for n in names])


@pytest.fixture
def device(request) -> torch.device:
    kind = request.param
    reason = devices.unavailable_reason(kind)
    if reason:
        if kind in request.config._mpt_kv_required:
            pytest.fail(f"--require-device {kind}: {reason}")
        pytest.skip(f"{kind} unavailable: {reason}")
    return devices.torch_device(kind)


@pytest.fixture
def target(request, device) -> str:
    """The target spec; skips (with the reason) where it cannot be built on this machine."""
    from mpt_kv.model.config import ModelConfig, random_state_dict
    from mpt_kv.targets import build

    spec = request.param
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
    try:
        build(spec, cfg, random_state_dict(cfg), device, torch.float32)
    except TargetUnavailable as e:
        pytest.skip(f"target {spec} unavailable: {e}")
    return spec


def _params(item) -> dict:
    cs = getattr(item, "callspec", None)
    p = dict(cs.params) if cs else {}
    prop = item.get_closest_marker("property")
    out = {k: p[k] for k in ("target", "device", "path", "bucket") if k in p}
    if "dtype" in p:
        out["dtype"] = str(p["dtype"]).replace("torch.", "")
    if prop:
        out["property"] = prop.args[0]
    return out


def pytest_collection_modifyitems(config, items):
    entries = known_failures.load()
    for item in items:
        p = _params(item)
        if "property" in p and "target" in p:
            reason = known_failures.match(p["target"], p["property"], p.get("path"), entries, p.get("bucket"))
            if reason:
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"known upstream failure: {reason}"))
            item.user_properties.append(("mpt_kv", p))


def pytest_runtest_logreport(report):
    collect_memory(report)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        props = dict(report.user_properties)
        if "mpt_kv" in props:
            outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            if hasattr(report, "wasxfail") and report.passed:
                outcome = "XPASS"
            note = [v for k, v in report.user_properties if k == "mpt_kv_note"]
            _results.append({**props["mpt_kv"], "outcome": outcome, "nodeid": report.nodeid, "notes": note,
                             "kinds": [k for k in devices.KINDS if report.keywords.get(k)]})
        elif report.when == "call":
            _results.append({"outcome": report.outcome, "nodeid": report.nodeid,
                             "kinds": [k for k in devices.KINDS if report.keywords.get(k)]})


def gate_failures(config) -> list[str]:
    out = []
    for kind in config._mpt_kv_required:
        ran = [r for r in _results if kind in r["kinds"]]
        passed = [r for r in ran if r["outcome"] in ("passed", "xfail")]
        if not passed:
            out.append(f"--require-device {kind}: no {kind} case passed ({len(ran)} {kind} cases reported). "
                       f"A gate that ran nothing must not look green.")
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "workerinput", None) is not None:
        return  # xdist worker: the controller sees every report and decides
    if gate_failures(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if update_ceilings(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    path = session.config.getoption("mpt_kv_report")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"results": [r for r in _results if "property" in r],
                       "hypothesis_profile": session.config._mpt_kv_profile}, f, indent=1)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None:
        return
    rows = defaultdict(dict)
    notes = []
    for r in _results:
        if "property" not in r:
            continue
        key = (r.get("target", "?"), r.get("device", "?"), r.get("dtype", "-"),
               r.get("path", "-") + ("" if r.get("bucket") is None else f"+bucket{r['bucket']}"))
        prev = rows[key].get(r["property"])
        rows[key][r["property"]] = r["outcome"] if prev in (None, r["outcome"]) else f"{prev}/{r['outcome']}"
        notes += r.get("notes", [])
    tw = terminalreporter
    # a device that is absent here gets one line, not a row of "skipped" per target and path
    absent = sorted({k[1] for k in rows if k[1] in devices.KINDS and devices.unavailable_reason(k[1])})
    skipped = {kind: sum(len(v) for k, v in rows.items() if k[1] == kind) for kind in absent}
    rows = {k: v for k, v in rows.items() if k[1] not in absent}
    if rows or absent:
        tw.write_sep("=", "mpt-kv conformance")
    for kind in absent:
        tw.write_line(f"{kind}: {skipped[kind]} cases skipped, not available here: {devices.unavailable_reason(kind)}")
    if rows:
        w = max(len("target"), *(len(k[0]) for k in rows))
        head = f"{'target':<{w}} {'device':<6} {'dtype':<8} {'path':<15} " + " ".join(f"{p:<8}" for p in PROPERTY_NAMES)
        tw.write_line(head)
        for key in sorted(rows):
            cells = " ".join(f"{rows[key].get(p, '-'):<8}" for p in PROPERTY_NAMES)
            tw.write_line(f"{key[0]:<{w}} {key[1]:<6} {key[2]:<8} {key[3]:<15} {cells}")
        tw.write_line("  " + "; ".join(f"{k} {v}" for k, v in PROPERTY_NAMES.items())
                      + f"; hypothesis profile {config._mpt_kv_profile}. Skip reasons: pytest -rs")
        for n in notes[:20]:
            tw.write_line(f"  note: {n}")
    for msg in gate_failures(config):
        tw.write_sep("!", "device gate")
        tw.write_line(msg, red=True)
    memory_summary(tw, config)


# --- memory ceilings (mpt_kv/checks/ceilings.py, mpt_kv/conformance/test_memory.py) ---------------------------------
# Tests record each measurement as user_properties ("mpt_kv_memory", dict): they travel from
# xdist workers to the controller with the reports, so only the controller prints the table and
# writes the baseline file (one writer: a safe merge, whatever -n).

def add_ceiling_options(g):
    g.addoption("--update-ceilings", action="store_true",
                help="rewrite the memory ceilings baseline with what ran (entries that did not run are kept) "
                     "and print the diff; a higher (looser) value also needs --allow-looser-ceilings")
    g.addoption("--allow-looser-ceilings", action="store_true",
                help="with --update-ceilings: accept measurements above their stored ceilings")
    g.addoption("--ceilings-dir", metavar="DIR", default=None,
                help="folder of the baseline files ceilings-<device>.json (default: $MPT_KV_CEILINGS_DIR, "
                     "else mpt_kv/baselines)")


def collect_memory(report):
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    for name, value in report.user_properties:
        if name == "mpt_kv_memory":
            outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            _memory.append({**value, "outcome": outcome, "nodeid": report.nodeid})


def update_ceilings(config) -> bool:
    """--update-ceilings, on the controller: merge the measurements into each device's baseline.
    Returns True if the run must fail (a loosening refused, or a corrupt file)."""
    if not config.getoption("update_ceilings") or getattr(config, "workerinput", None) is not None:
        return False
    from mpt_kv.checks import ceilings

    config._mpt_kv_ceilings_diff = lines = []
    failed = False
    for kind in sorted({m["device"] for m in _memory}):
        path = ceilings.baseline_path(kind, config.getoption("ceilings_dir"))
        measured = [m for m in _memory if m["device"] == kind]
        try:
            written, refused = ceilings.update_baseline(path, kind, measured, config.getoption("allow_looser_ceilings"))
        except ceilings.BaselineError as e:
            lines.append(f"NOT written: {e}")
            failed = True
            continue
        lines.append(f"{path}: {len(measured)} measurements, {len(written)} values written "
                     f"({sum(c.kind == 'new' for c in written)} new, {sum(c.kind == 'tighter' for c in written)} "
                     f"tighter, {sum(c.kind == 'looser' for c in written)} looser)")
        lines += ceilings.diff_lines(written)
        if refused:
            failed = True
            lines.append(f"NOT written: {len({c.key for c in refused})} entries would loosen their ceilings "
                         "(rerun with --allow-looser-ceilings to accept):")
            lines += ceilings.diff_lines(refused)
    if not _memory:
        lines.append("--update-ceilings: no memory measurement ran, nothing written")
    return failed


def memory_summary(tw, config):
    if getattr(config, "workerinput", None) is not None:
        return
    if _memory:
        from mpt_kv.checks.ceilings import table

        tw.write_sep("=", "mpt-kv memory")
        for line in table(_memory):
            tw.write_line(line)
    diff = getattr(config, "_mpt_kv_ceilings_diff", None)
    if diff is not None:
        tw.write_sep("=", "mpt-kv memory ceilings updated")
        for line in diff:
            tw.write_line(line, red=line.startswith(("NOT", "  !")))
