"""The pytest plugin: devices, targets, dtypes as parameters; the device gate; the report.

- Every case that takes `device` runs once per kind (cpu, cuda, hpu) and carries the marker of
  that kind, so `pytest -m hpu` selects exactly the HPU cases. A kind that is absent skips
  with the reason, unless it is required (`--require-device hpu` or MPT_KV_REQUIRE_DEVICE=hpu):
  then the run is an error before any test runs, and a run in which no case of a required
  kind passed exits non-zero. A misconfigured Gaudi runner cannot pass the gate by running
  nothing.
- `target` runs once per built-in target and per `--target package.module:factory`.
- Known upstream failures (known_failures.json) become strict xfails.
- The terminal summary prints the conformance matrix; `--mpt-kv-report FILE` writes it as JSON
  (`python -m mpt_kv report A.json B.json` merges reports of several environments into one).
- A project configures it in its own ini file (`mpt_kv_targets`, `mpt_kv_only_targets`,
  `mpt_kv_dtypes`, `mpt_kv_known_failures`, `mpt_kv_ceilings_dir`, `mpt_kv_require_ceilings`):
  see `add_project_options` and docs/targets.md.
"""

from __future__ import annotations

import json
import os
import shlex
import time
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
    add_project_options(parser, g)


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
    clear_stale_report(config)
    _memory.clear()
    for extra in _extras.values():
        extra.clear()


def pytest_sessionstart(session):
    for kind in session.config._mpt_kv_required:
        reason = devices.unavailable_reason(kind)
        if reason:
            raise pytest.UsageError(f"--require-device {kind}: {kind} is not available here: {reason}. "
                                    f"This runner cannot gate {kind} changes.")


def target_specs(config) -> list[str]:
    extra = list(dict.fromkeys([*config.getini("mpt_kv_targets"), *config.getoption("target")]))
    only = config.getoption("only_targets") or config.getini("mpt_kv_only_targets")
    return extra if only else [*BUILTIN, *[t for t in extra if t not in BUILTIN]]


def pytest_generate_tests(metafunc):
    config = metafunc.config
    explicit = explicitly_parametrized(metafunc)  # a test's own parametrize of these names wins
    if "device" in metafunc.fixturenames and "device" not in explicit:
        kinds = config.getoption("device") or list(devices.KINDS)
        metafunc.parametrize("device", [pytest.param(k, marks=getattr(pytest.mark, k), id=k) for k in kinds],
                             indirect=True)
    if "target" in metafunc.fixturenames and "target" not in explicit:
        metafunc.parametrize("target", target_specs(config), indirect=True)
    if "dtype" in metafunc.fixturenames and "dtype" not in explicit:
        names = config.getoption("dtype") or config.getini("mpt_kv_dtypes") or ["fp32", "bf16"]
        unknown = [n for n in names if n not in DTYPES]
        if unknown:
            raise pytest.UsageError(f"mpt_kv_dtypes: unknown {unknown}, expected some of {sorted(DTYPES)}")
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
    p = check_params(dict(cs.params) if cs else {})
    prop = item.get_closest_marker("property")
    out = {k: p[k] for k in ("target", "device", "path", "bucket", "check") if k in p}
    if "dtype" in p:
        out["dtype"] = str(p["dtype"]).replace("torch.", "")
    if prop:
        out["property"] = prop.args[0]
    return out


def pytest_collection_modifyitems(config, items):
    entries = known_failure_entries(config)
    for item in items:
        p = _params(item)
        if "property" in p and "target" in p:
            reason = known_failures.match(p["target"], p["property"], p.get("path"), entries, p.get("bucket"))
            if reason:
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"known failure: {reason}"))
            item.user_properties.append(("mpt_kv", p))


def pytest_runtest_logreport(report):
    collect_memory(report)
    collect_extras(report)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        props = dict(report.user_properties)
        if "mpt_kv" in props:
            outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            if hasattr(report, "wasxfail") and report.passed:
                outcome = "XPASS"
            outcome = dict(report.user_properties).get("mpt_kv_outcome", outcome)
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
        write_report(session.config, path)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None:
        return
    tw = terminalreporter
    if not config.getoption("no_mpt_kv_matrix"):
        results = with_versions([r for r in _results if "property" in r])
        lines = matrix_lines(results, absent_devices(results), config._mpt_kv_profile)
        if lines:
            tw.write_sep("=", "mpt-kv conformance")
        for line in lines:
            tw.write_line(line)
        for line in project_lines(_extras, config):
            tw.write_line(line)
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
                     "else the ini option mpt_kv_ceilings_dir, else <rootdir>/mpt_kv_ceilings)")


def collect_memory(report):
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    for name, value in report.user_properties:
        if name == "mpt_kv_memory":
            outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            outcome = dict(report.user_properties).get("mpt_kv_outcome", outcome)
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
        path = ceilings.baseline_path(kind, ceilings_dir(config))
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
    if _memory and not config.getoption("no_mpt_kv_matrix"):
        from mpt_kv.checks.ceilings import table

        tw.write_sep("=", "mpt-kv memory")
        for line in table(_memory):
            tw.write_line(line)
    diff = getattr(config, "_mpt_kv_ceilings_diff", None)
    if diff is not None:
        tw.write_sep("=", "mpt-kv memory ceilings updated")
        for line in diff:
            tw.write_line(line, red=line.startswith(("NOT", "  !")))


# --- a project's own configuration (its ini file) ----------------------------------------------------------
# A project that installed mpt-kv keeps its data in its own repository and names it in its ini
# file, so its CI line is just `pytest -m hpu` (docs/targets.md).

CEILINGS_FOLDER = "mpt_kv_ceilings"  # default: <rootdir>/mpt_kv_ceilings


def add_project_options(parser, g):
    parser.addini("mpt_kv_targets", type="linelist", default=[],
                  help="mpt-kv: targets to run (package.module:factory or built-in names), as --target")
    parser.addini("mpt_kv_only_targets", type="bool", default=False,
                  help="mpt-kv: run only mpt_kv_targets / --target, not the built-in targets (as --only-targets)")
    parser.addini("mpt_kv_dtypes", type="linelist", default=[], help="mpt-kv: dtypes to run (fp32, bf16), as --dtype")
    parser.addini("mpt_kv_known_failures", default="",
                  help="mpt-kv: the project's known-failures JSON file (relative to the ini file), "
                       "in addition to mpt-kv's own entries for its built-in targets")
    parser.addini("mpt_kv_ceilings_dir", default="",
                  help=f"mpt-kv: folder of the stored memory ceilings (relative to the ini file; default "
                       f"<rootdir>/{CEILINGS_FOLDER})")
    parser.addini("mpt_kv_require_ceilings", type="linelist", default=[],
                  help="mpt-kv: targets whose memory cases fail without a stored ceiling ('*': all); a target "
                       "that has any entry must have all of them anyway")
    g.addoption("--no-mpt-kv-matrix", action="store_true",
                help="do not print the conformance matrix and memory table (--mpt-kv-report still writes them)")


def ini_relative(config, value: str):
    from pathlib import Path

    base = config.inipath.parent if config.inipath else config.rootpath
    return base / Path(value).expanduser()


def ceilings_dir(config):
    """--ceilings-dir, else $MPT_KV_CEILINGS_DIR, else ini mpt_kv_ceilings_dir, else <rootdir>/mpt_kv_ceilings."""
    explicit = config.getoption("ceilings_dir") or os.environ.get("MPT_KV_CEILINGS_DIR")
    if explicit:
        return explicit
    ini = config.getini("mpt_kv_ceilings_dir")
    return ini_relative(config, ini) if ini else config.rootpath / CEILINGS_FOLDER


def known_failures_path(config):
    """The project's known-failures file (ini mpt_kv_known_failures, relative to the ini file),
    else mpt-kv's own (its built-in targets' upstream bugs). One file: a project lists the
    entries that apply to what it runs (copying mpt-kv's where it runs the built-in targets)."""
    ini = config.getini("mpt_kv_known_failures")
    return ini_relative(config, ini) if ini else known_failures.FILE


def known_failure_entries(config) -> list[dict]:
    return known_failures.load(known_failures_path(config))


def stored_ceilings(config):
    """The project's StoredCeilings for the memory checks (mpt_kv.checks.registry), made once."""
    if not hasattr(config, "_mpt_kv_stored_ceilings"):
        from pathlib import Path

        from mpt_kv.checks.registry import StoredCeilings

        config._mpt_kv_stored_ceilings = StoredCeilings(Path(ceilings_dir(config)),
                                                        tuple(config.getini("mpt_kv_require_ceilings")),
                                                        bool(config.getoption("update_ceilings")))
    return config._mpt_kv_stored_ceilings


def explicitly_parametrized(metafunc) -> set[str]:
    """Argnames the test parametrizes itself (`parametrize_with_checks([build])` gives `target`)."""
    names = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        names.update(a.strip() for a in argnames.split(",")) if isinstance(argnames, str) else names.update(argnames)
    return names


def check_params(params: dict) -> dict:
    """A registry check's property, path and bucket, and a target factory's name, as report fields."""
    check = params.get("check")
    if check is not None and hasattr(check, "property") and hasattr(check, "id"):
        params = {**params, "check": check.id, "path": check.path, "bucket": check.bucket}
        if check.path is None:
            del params["path"]
    if "target" in params and not isinstance(params["target"], str):
        from mpt_kv.targets import target_name

        params["target"] = target_name(params["target"])
    return params


# --- outcomes: a property failure, an error, an unsupported feature -----------------------------------------

def outcome_of(excinfo) -> str:
    """'failed' only for PropertyFailure (also a group of them); 'unsupported' for Unsupported;
    any other exception is the target's or the adapter's 'error' (a TypeError from a forward
    without a keyword, an AttributeError, a corrupt ceilings file)."""
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.errors import Unsupported

    exc = excinfo.value
    if isinstance(exc, Unsupported):
        return "unsupported"
    if isinstance(exc, pytest.skip.Exception):
        return "skipped"
    leaves = [exc]
    while any(isinstance(e, BaseExceptionGroup) for e in leaves):
        leaves = [x for e in leaves for x in (e.exceptions if isinstance(e, BaseExceptionGroup) else [e])]
    return "failed" if all(isinstance(e, PropertyFailure) for e in leaves) else "error"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    record_outcome(report, call)
    return report


def record_outcome(report, call) -> None:
    """The matrix's word for a finished phase (after any xfail handling), on the report."""
    if report.when == "setup" and report.failed:
        report.user_properties.append(("mpt_kv_outcome", "error"))
    elif call.excinfo is not None and report.when == "call" and not hasattr(report, "wasxfail"):
        report.user_properties.append(("mpt_kv_outcome", outcome_of(call.excinfo)))
    elif report.when == "call" and isinstance(report.longrepr, str) and report.longrepr.startswith("[XPASS(strict)]"):
        report.user_properties.append(("mpt_kv_outcome", "XPASS"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """While a test parametrized with registry checks (parametrize_with_checks) runs, its checks
    record their measurements and notes on it, and compare memory with the project's stored
    ceilings. A check called by hand elsewhere stays a plain function (analytic memory only)."""
    import sys

    registry = sys.modules.get("mpt_kv.checks.registry")  # not imported: no check in this session
    params = getattr(getattr(item, "callspec", None), "params", {})
    if registry is None or not isinstance(params.get("check"), registry.Check):
        return (yield)
    context = registry.RunContext(lambda name, value: item.user_properties.append((name, value)),
                                  stored_ceilings(item.config), item.get_closest_marker("xfail") is not None)
    with registry.running(context):
        return (yield)


# --- the report ---------------------------------------------------------------------------------------------

_extras: dict[str, dict] = {"capabilities": {}, "unrecorded": {}}  # per target / per (target, device, file)


def collect_extras(report):
    if report.when != "call":
        return
    for name, value in report.user_properties:
        if name == "mpt_kv_capabilities":
            _extras["capabilities"][value["target"]] = value["unsupported"]
        elif name == "mpt_kv_unrecorded":
            key = f"{value['target']}|{value['device']}|{value['file']}"
            _extras["unrecorded"].setdefault(key, {**value, "cases": 0})["cases"] += 1


def project_lines(extras: dict, config=None) -> list[str]:
    """What targets declared unsupported, and which memory cases had no stored ceiling (one line each)."""
    lines = []
    for target, unsupported in sorted(extras.get("capabilities", {}).items()):
        what = "; ".join(f"{f} ({why})" + (": not drawn, its other cases run" if f == "clip_qkv" else "")
                         for f, why in sorted(unsupported.items()))
        lines.append(f"  {target} declares unsupported: {what}")
    for u in extras.get("unrecorded", {}).values():
        args = shlex.join(config.invocation_params.args) if config is not None else "..."
        lines.append(f"  memory: {u['target']} on {u['device']} has no stored ceilings in {u['file']} ({u['cases']} "
                     f"cases checked against the analytic model only); record them: pytest {args} --update-ceilings, "
                     "then commit the file")
    return lines


def path_cell(r: dict) -> str:
    return r.get("path", "-") + ("" if r.get("bucket") is None else f"+bucket{r['bucket']}")


def target_label(r: dict) -> str:
    """'transformers 5.24', 'optimum-habana 1.21 (transformers 4.55)', 'reference', 'pkg.mod:build'."""
    target, versions = r.get("target", "?"), r.get("target_version", "")
    if not versions:
        return target
    first, _, rest = versions.partition(", ")
    if first.split(" ")[0] == target:
        return first + (f" ({rest})" if rest else "")
    return f"{target} ({versions})"


def absent_devices(results: list[dict]) -> dict[str, str]:
    kinds = {r.get("device") for r in results}
    return {k: devices.unavailable_reason(k) for k in devices.KINDS if k in kinds and devices.unavailable_reason(k)}


def matrix_lines(results: list[dict], absent: dict[str, str], profile: str | None) -> list[str]:
    """The conformance matrix: one row per target (with its version), device, dtype and cache path;
    one column per property. A device absent here gets one line, not a row per target."""
    rows, notes = defaultdict(dict), []
    for r in results:
        if r.get("device") in absent:
            continue
        key = (target_label(r), r.get("device", "?"), r.get("dtype", "-"), path_cell(r))
        prev = rows[key].get(r["property"])
        rows[key][r["property"]] = r["outcome"] if prev in (None, r["outcome"]) else f"{prev}/{r['outcome']}"
        notes += r.get("notes", [])
    lines = []
    for kind, reason in absent.items():
        n = sum(1 for r in results if r.get("device") == kind)
        lines.append(f"{kind}: {n} cases skipped, not available here: {reason}")
    if rows:
        heads = ["target", "device", "dtype", "path", *PROPERTY_NAMES]
        order = sorted(rows, key=lambda k: (k[0] != "reference", k))  # the oracle first
        table = [[*key, *(rows[key].get(p, "-") for p in PROPERTY_NAMES)] for key in order]
        widths = [max(len(str(row[i])) for row in [heads, *table]) for i in range(len(heads))]
        for row in [heads, *table]:
            lines.append(" ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip())
        lines.append("  " + "; ".join(f"{k} {v}" for k, v in PROPERTY_NAMES.items())
                     + (f"; hypothesis profile {profile}" if profile else "")
                     + ". failed: a property does not hold; error: the target or its adapter raised something else; "
                       "unsupported: the target declares it does not implement what the case needs. Reasons: pytest -rs")
        for n in list(dict.fromkeys(notes))[:20]:
            lines.append(f"  note: {n}")
    return lines


def environment() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "optimum-habana", "mpt-kv"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def with_versions(results: list[dict]) -> list[dict]:
    """Each result with its target's implementing package versions (built-in targets)."""
    from mpt_kv.checks.ceilings import target_version

    versions = {t: target_version(t) for t in {r.get("target", "") for r in results}}
    return [{**r, "target_version": versions[r.get("target", "")]} if versions[r.get("target", "")] else r
            for r in results]


def clear_stale_report(config) -> None:
    """A report left by an earlier run must not stand in for this one if it stops early."""
    path = config.getoption("mpt_kv_report")
    if path and getattr(config, "workerinput", None) is None and os.path.exists(path):
        os.remove(path)


def write_report(config, path) -> None:
    """The run as JSON: results, memory measurements, absent devices, capabilities, environment.
    `python -m mpt_kv report` prints and merges such files."""
    results = with_versions([r for r in _results if "property" in r])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"results": results, "memory": _memory, "absent_devices": absent_devices(results),
                   "hypothesis_profile": config._mpt_kv_profile, "environment": environment(),
                   "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "capabilities": _extras["capabilities"], "unrecorded": list(_extras["unrecorded"].values())},
                  f, indent=1, default=str)
