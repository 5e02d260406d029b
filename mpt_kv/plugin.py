"""The pytest plugin: devices, targets, dtypes as parameters; the device gate; the report.

- Every case that takes `device` runs once per kind (cpu, cuda, hpu) and carries the marker of
  that kind, so `pytest -m hpu` selects exactly the HPU cases. A kind the run selects is
  required (`-m hpu`, any marker expression that needs hpu, `--device hpu`, `--require-device
  hpu` or MPT_KV_REQUIRE_DEVICE=hpu): absent, the run is an error before any test runs; if no
  case of it passed, the run exits non-zero. A kind that is merely not deselected skips where
  absent. `--allow-missing-device` turns the selection rule off for local exploration. A
  misconfigured Gaudi runner cannot pass the gate by running nothing (docs/gate.md).
- Under pytest-xdist each worker is given one card of each device kind in play before its
  pytest starts (devices.CardPool); more workers than cards is a usage error.
- `target` runs once per built-in target and per `--target package.module:factory`. A target
  named explicitly that cannot be imported or built is an error; a built-in one skips only
  where its package is not installed.
- Known upstream failures (known_failures.json) xfail only the PropertyFailure their pattern
  names; entries that match no case are listed (an error with --strict-known-failures).
- The terminal summary prints the conformance matrix; `--mpt-kv-report FILE` writes it as JSON
  (`python -m mpt_kv report A.json B.json` merges reports of several environments into one).
- A project configures it in its own ini file (`mpt_kv_targets`, `mpt_kv_only_targets`,
  `mpt_kv_dtypes`, `mpt_kv_known_failures`, `mpt_kv_ceilings_dir`, `mpt_kv_require_ceilings`):
  see `add_project_options` and docs/targets.md.

This module imports torch only inside hooks and fixtures: an xdist worker loads it before its
card is pinned, and since PyTorch 2.5 `import torch` initialises device backends.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections import defaultdict

import pytest

from mpt_kv import devices

ENV_REQUIRE = "MPT_KV_REQUIRE_DEVICE"
ENV_KNOWN_FAILURES = "MPT_KV_KNOWN_FAILURES"
DTYPE_NAMES = ("bf16", "fp32")  # the keys of mpt_kv.model.config.DTYPES (not imported here: it imports torch)
# built-in targets and the distributions they wrap: absent, their cases skip; present but not
# loading, they fail
BUILTIN_PACKAGES = {"reference": (), "transformers": ("transformers",), "optimum-habana": ("optimum-habana",)}
KNOWN = pytest.StashKey[object]()  # item -> its known_failures.Entry
_results: list[dict] = []
PROPERTY_NAMES = {"P0": "oracle", "P1": "cached=uncached", "P2": "static=concat", "P3": "no aliasing", "P4": "outputs not reused",
                  "memory": "memory ceilings", "static-shape": "static shapes"}
_memory: list[dict] = []  # measurements of mpt_kv/conformance/test_memory.py (user_properties "mpt_kv_memory")


def pytest_addoption(parser):
    g = parser.getgroup("mpt-kv", "mpt-kv KV cache conformance")
    g.addoption("--device", action="append", choices=devices.KINDS, default=None,
                help="run cases on this device kind only (repeatable); a kind named here is required: absent, "
                     "the run is an error (default: every kind, absent ones skip)")
    g.addoption("--require-device", action="append", choices=devices.KINDS, default=[],
                help=f"fail unless this device is present and at least one of its cases passed (repeatable; "
                     f"also ${ENV_REQUIRE}=hpu,cuda). -m and --device imply it for the kinds they select")
    g.addoption("--allow-missing-device", action="store_true",
                help="local exploration only, never in CI: a device selected by -m or --device may be absent "
                     "(its cases skip, and a run that ran none of them can pass); --require-device still holds")
    g.addoption("--target", action="append", default=[], metavar="SPEC",
                help="add a target: a built-in name or package.module:factory (repeatable); one that cannot be "
                     "imported or built is an error")
    g.addoption("--only-targets", action="store_true",
                help="run only the --target ones, not the built-in reference/transformers/optimum-habana")
    g.addoption("--dtype", action="append", choices=DTYPE_NAMES, default=None,
                help="dtypes to run (repeatable; default fp32 and bf16)")
    g.addoption("--mpt-kv-report", metavar="FILE", default=None, help="write the conformance matrix as JSON")
    g.addoption("--strict-known-failures", action="store_true",
                help="a known-failures entry that matches no case of this run is an error (CI's tox envs use it)")
    add_ceiling_options(g)
    add_project_options(parser, g)


def required_devices(config) -> list[str]:
    """The kinds required explicitly: --require-device and $MPT_KV_REQUIRE_DEVICE."""
    env = [k.strip() for k in os.environ.get(ENV_REQUIRE, "").split(",") if k.strip()]
    bad = [k for k in env if k not in devices.KINDS]
    if bad:
        raise pytest.UsageError(f"{ENV_REQUIRE}={os.environ[ENV_REQUIRE]!r}: unknown kind {bad}, expected {devices.KINDS}")
    return sorted(set(config.getoption("require_device") + env))


def pytest_configure(config):
    for kind in devices.KINDS:
        config.addinivalue_line("markers", f"{kind}: a case on the {kind} device")
    config.addinivalue_line("markers", "property(name): which property (P0-P3) the test checks")
    from mpt_kv.checks.strategies import load_profile

    config._mpt_kv_profile = load_profile()
    config._mpt_kv_required = device_requirements(config)
    configure_gate(config)
    _results.clear()  # one list per process: the controller's (or a worker's) reports
    clear_stale_report(config)
    _memory.clear()
    for extra in _extras.values():
        extra.clear()


def pytest_sessionstart(session):
    check_required_devices(session.config)
    check_named_targets(session.config)


def target_specs(config) -> list[str]:
    from mpt_kv.targets import BUILTIN

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
        from mpt_kv.model.config import DTYPES

        names = config.getoption("dtype") or config.getini("mpt_kv_dtypes") or ["fp32", "bf16"]
        unknown = [n for n in names if n not in DTYPES]
        if unknown:
            raise pytest.UsageError(f"mpt_kv_dtypes: unknown {unknown}, expected some of {sorted(DTYPES)}")
        metafunc.parametrize("dtype", [pytest.param(DTYPES[n], id=n) for n in names])


@pytest.fixture
def device(request) -> "torch.device":  # noqa: F821
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
        why = request.config._mpt_kv_required.get(kind)
        if why:
            pytest.fail(f"{why}: {kind} is not available: {reason}", pytrace=False)
        pytest.skip(f"{kind} unavailable: {reason}")
    return devices.torch_device(kind)


@pytest.fixture
def target(request, device) -> str:
    """The target spec, built once on a tiny config: a built-in one whose package is not
    installed skips with the reason; any other failure to import or build is an error."""
    import torch

    from mpt_kv.model.config import ModelConfig, random_state_dict
    from mpt_kv.targets import build

    spec = request.param
    missing = missing_package(spec)
    if missing and spec not in named_targets(request.config):
        pytest.skip(f"target {spec} unavailable: {missing}")
    cfg = ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=8)
    try:
        build(spec, cfg, random_state_dict(cfg), device, torch.float32)
    except Exception as e:
        named = " (named with --target: an error, not a skip)" if spec in named_targets(request.config) else ""
        pytest.fail(f"target {spec} cannot be built here{named}: {type(e).__name__}: {e}", pytrace=False)
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


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: an entry is judged against every collected case
def pytest_collection_modifyitems(config, items):
    entries = config._mpt_kv_known
    covered = set()
    for item in items:
        kinds = item_kinds(item)
        if kinds:  # travels to the xdist controller with the reports
            item.user_properties.append(("mpt_kv_kinds", kinds))
        p = _params(item)
        if "property" in p and "target" in p:
            config._mpt_kv_known_cases = True
            for e in entries:
                if e.covers(p["target"], p["property"], p.get("path"), p.get("bucket")):
                    covered.add(e.index)
            entry = match_known_failure(p, entries)
            if entry is not None:
                item.stash[KNOWN] = entry
            item.user_properties.append(("mpt_kv", p))
    config._mpt_kv_known_covered |= covered
    if hasattr(config, "workeroutput"):  # xdist: the controller, which collects nothing, learns it here
        config.workeroutput["mpt_kv_known"] = {"covered": sorted(config._mpt_kv_known_covered),
                                               "cases": config._mpt_kv_known_cases}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    entry = item.stash.get(KNOWN, None)
    if entry is not None and report.when == "call":
        known_failure_outcome(report, entry, call.excinfo)
    record_outcome(report, call)  # after the xfail decision: the matrix's word for the phase
    return report


def pytest_runtest_logreport(report):
    collect_memory(report)
    collect_extras(report)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        props = dict(report.user_properties)
        kinds = props.get("mpt_kv_kinds", [])
        if "mpt_kv_known_xfail" in props:
            _known_xfailed[props["mpt_kv_known_xfail"]] += 1
        if "mpt_kv" in props:
            outcome = "xfail" if hasattr(report, "wasxfail") and report.skipped else report.outcome
            if hasattr(report, "wasxfail") and report.passed:
                outcome = "XPASS"
            outcome = dict(report.user_properties).get("mpt_kv_outcome", outcome)
            note = [v for k, v in report.user_properties if k == "mpt_kv_note"]
            _results.append({**props["mpt_kv"], "outcome": outcome, "nodeid": report.nodeid, "notes": note,
                             "kinds": kinds})
        else:  # any other case: its call, or its setup where that failed (a device case that errored counts)
            _results.append({"outcome": report.outcome, "nodeid": report.nodeid, "kinds": kinds})


def gate_failures(config) -> list[str]:
    out = []
    for kind, why in config._mpt_kv_required.items():
        ran = [r for r in _results if kind in r["kinds"]]
        passed = [r for r in ran if r["outcome"] in ("passed", "xfail")]
        if not passed:
            out.append(f"{why}: no {kind} case passed ({len(ran)} {kind} cases reported). "
                       f"A gate that ran nothing must not look green.")
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "workerinput", None) is not None:
        return  # xdist worker: the controller sees every report and decides
    if gate_failures(session.config):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.config.getoption("strict_known_failures") and unmatched_known_failures(session.config):
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
        lines = matrix_lines(results, absent_devices(config, results), config._mpt_kv_profile)
        if lines:
            tw.write_sep("=", "mpt-kv conformance")
        for line in lines:
            tw.write_line(line)
        for line in project_lines(_extras, config):
            tw.write_line(line)
    gate_summary(tw, config)
    memory_summary(tw, config)


# --- the gate: what a run requires, and nothing passes by accident (docs/gate.md) -------------------------------------
# Kept apart from the hooks above so each piece reads (and merges) on its own.

_known_xfailed: defaultdict = defaultdict(int)  # known-failures entry index -> cases it xfailed


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _markexpr_can_select(expr: str, markers: dict[str, bool]) -> bool:
    """Whether the `-m` expression is true for some case whose markers named in `markers` are
    as given (the rest: any). Evaluated with pytest's own expression parser, over every
    assignment of the other names it asks about."""
    from _pytest.mark.expression import Expression

    try:
        compiled = Expression.compile(expr)
    except SyntaxError:
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

        if compiled.evaluate(matcher):
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


def configure_gate(config) -> None:
    """Everything the gate can refuse before collection: --update-ceilings under CI, an
    unwritable report path, a malformed known-failures file."""
    if config.getoption("update_ceilings") and in_ci():
        raise pytest.UsageError("--update-ceilings is refused under CI: recording a baseline is a local step whose "
                                "diff a reviewer reads; run it locally, review the diff and commit the file")
    report = config.getoption("mpt_kv_report")
    if report:
        from mpt_kv.cli.outputs import file_problem

        problem = file_problem(report)
        if problem:
            raise pytest.UsageError(f"--mpt-kv-report {report}: {problem}")
    from mpt_kv.targets import known_failures

    path = known_failures_path(config)
    try:
        config._mpt_kv_known = known_failures.load(path)
    except known_failures.KnownFailuresError as e:
        raise pytest.UsageError(str(e)) from None
    config._mpt_kv_known_covered = set()
    config._mpt_kv_known_cases = False
    _known_xfailed.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """The earliest hook a plugin gets in an xdist worker, before conftest files (which may
    import torch): the card the controller gave this worker is still in place."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            devices.check_pinned()
        except devices.DeviceUnavailable as e:
            raise pytest.UsageError(str(e)) from None


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    """xdist controller, before any worker starts: one card of each kind in play per worker."""
    workers = len(specs)
    cards = {}
    for kind, info in device_survey(config).items():
        if info["reason"] is None:
            if workers > len(info["cards"]):
                raise pytest.UsageError(
                    f"-n {workers}: more xdist workers than {kind} cards ({len(info['cards'])}: "
                    f"{devices.VISIBLE[kind]} {','.join(info['cards'])}); each worker needs a card of its own: "
                    f"run with -n {len(info['cards'])} or fewer, or leave {kind} out (-m 'not {kind}' or --device)")
            cards[kind] = info["cards"]
    config._mpt_kv_cards = devices.CardPool(cards) if cards else None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller, a worker process started but its pytest not yet: set its card in its
    environment (execnet's remote_exec, as xdist itself does for sys.path), so the card is
    pinned before anything in the worker imports torch."""
    pool = getattr(node.config, "_mpt_kv_cards", None)
    if pool is None:
        return
    env = devices.pin_env(pool.take(node.gateway.id))
    node.gateway.remote_exec(f"import os\nos.environ.update({env!r})").waitclose()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """A worker finished or crashed: its cards go back to the pool (xdist starts a replacement
    under a new name, gwN beyond the card count, and it takes them), and what it collected of
    the known failures reaches the controller."""
    pool = getattr(node.config, "_mpt_kv_cards", None)
    if pool is not None:
        pool.give_back(node.gateway.id)
    known = getattr(node, "workeroutput", {}).get("mpt_kv_known")
    if known:
        node.config._mpt_kv_known_covered |= set(known["covered"])
        node.config._mpt_kv_known_cases |= known["cases"]


def item_kinds(item) -> list[str]:
    """The device kinds of a case: its `device` parameter or a device marker; never a keyword
    (a test in a folder or class named `hpu` is not an HPU case)."""
    cs = getattr(item, "callspec", None)
    kinds = {cs.params["device"]} if cs is not None and cs.params.get("device") in devices.KINDS else set()
    kinds |= {m.name for m in item.iter_markers() if m.name in devices.KINDS}
    return sorted(kinds)


def named_targets(config) -> list[str]:
    """Targets the run names explicitly (--target, ini mpt_kv_targets): one that cannot be
    imported or built is an error."""
    return list(dict.fromkeys([*config.getini("mpt_kv_targets"), *config.getoption("target")]))


def missing_package(spec: str) -> str | None:
    """For a built-in target: the reason it cannot run because its package is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in BUILTIN_PACKAGES.get(spec, ()):
        try:
            version(dist)
        except PackageNotFoundError:
            return f"{dist} is not installed"
    return None


def check_named_targets(config) -> None:
    """A named target that cannot even be imported stops the run before any test (decided by
    the controller under xdist)."""
    if hasattr(config, "workerinput"):
        return
    from mpt_kv.errors import TargetUnavailable
    from mpt_kv.targets import resolve

    for spec in named_targets(config):
        problem = missing_package(spec)
        if problem is None:
            try:
                resolve(spec)
            except TargetUnavailable as e:
                problem = str(e)
            except Exception as e:
                problem = f"importing it raised {type(e).__name__}: {e}"
        if problem:
            raise pytest.UsageError(f"--target {spec}: {problem}")


def known_failures_path(config):
    """The known-failures file: $MPT_KV_KNOWN_FAILURES, else the project's (ini
    mpt_kv_known_failures, relative to the ini file), else the packaged one. One file: a project
    lists the entries that apply to what it runs (copying mpt-kv's where it runs built-in targets)."""
    from mpt_kv.targets import known_failures

    ini = config.getini("mpt_kv_known_failures")
    return os.environ.get(ENV_KNOWN_FAILURES) or (ini_relative(config, ini) if ini else known_failures.FILE)


def match_known_failure(params: dict, entries):
    for e in entries:
        if e.covers(params["target"], params["property"], params.get("path"), params.get("bucket")) and e.applies():
            return e
    return None


def known_failure_outcome(report, entry, excinfo) -> None:
    """A case with a known-failure entry: xfail only the PropertyFailure its pattern names.
    A pass (upstream fixed it) or any other failure fails the case, saying why."""
    if report.passed:
        report.outcome = "failed"
        report.longrepr = (f"[XPASS(strict)] known upstream failure {entry.name} did not happen: {entry.reason} "
                           f"-- if upstream fixed it, remove or narrow the entry in {entry.file}")
    elif report.failed and excinfo is not None and entry.explains(excinfo.value):
        report.outcome = "skipped"
        report.wasxfail = f"known upstream failure, {entry.name}: {entry.reason}"
        report.user_properties = [*report.user_properties, ("mpt_kv_known_xfail", entry.index)]
    elif report.failed:
        report.sections.append(("mpt-kv known failure", (
            f"{entry.name} in {entry.file} expects a PropertyFailure whose message matches "
            f"/{entry.pattern.pattern}/; this failure is not that one, so the case fails")))


def unmatched_known_failures(config) -> list:
    """Entries that apply to the installed versions but cover no case this run collected (a
    typo, or a target, property or path that is gone). None judged if no conformance case was
    collected at all (e.g. only the suite's own tests ran)."""
    if not config._mpt_kv_known_cases:
        return []
    return [e for e in config._mpt_kv_known if e.applies() and e.index not in config._mpt_kv_known_covered]


def gate_summary(tw, config) -> None:
    """The end-of-run lines of the gate: devices, cards, known failures."""
    for msg in gate_failures(config):
        tw.write_sep("!", "device gate")
        tw.write_line(msg, red=True)
    if config.getoption("allow_missing_device"):
        tw.write_line("--allow-missing-device: devices selected with -m or --device were not required; this run "
                      "gates nothing on a device that is absent", yellow=True)
    pool = getattr(config, "_mpt_kv_cards", None)
    if pool is not None:
        tw.write_line("xdist cards: " + "; ".join(pool.log))
    entries = config._mpt_kv_known
    unmatched = unmatched_known_failures(config)
    used = [e for e in entries if _known_xfailed.get(e.index)]
    if used or unmatched:
        tw.write_sep("=", "mpt-kv known failures")
        for e in used:
            tw.write_line(f"{e.name}: {_known_xfailed[e.index]} cases xfailed as known")
        strict = config.getoption("strict_known_failures")
        for e in unmatched:
            tw.write_line(f"{e.name} in {e.file} matched no case of this run: a typo, or its target, property or path "
                          f"is gone{' (--strict-known-failures: an error)' if strict else ''}", red=strict)
        rest = len([e for e in entries if not e.applies()])
        if rest:
            tw.write_line(f"{rest} entries do not apply to the installed versions")


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
    for line in missing_ceilings(config):
        tw.write_line(line, red=True)


def missing_ceilings(config) -> list[str]:
    """One line per device and target version whose memory cases found no stored ceilings (a
    new transformers, a new target): how to record them. Never recorded under CI."""
    if config.getoption("update_ceilings"):
        return []
    from mpt_kv.checks import ceilings

    stored, missing = {}, defaultdict(int)
    for m in _memory:
        if m["outcome"] not in ("failed", "error"):  # a missing entry is a BaselineError: "error"
            continue
        if m["device"] not in stored:
            path = ceilings.baseline_path(m["device"], ceilings_dir(config))
            try:
                stored[m["device"]] = (path, ceilings.load_baseline(path, m["device"]))
            except ceilings.BaselineError:
                stored[m["device"]] = (path, {})
        path, entries = stored[m["device"]]
        if ceilings.key_of(m) not in entries:
            version = f" ({m['target_version']})" if m["target_version"] else ""
            missing[(m["device"], f"{m['target']}{version}", str(path))] += 1
    return [f"memory ceilings: none stored for {target} on {kind} ({n} cases failed): record them locally, not "
            f"under CI, with `pytest --pyargs mpt_kv.conformance -k memory --update-ceilings`, review the diff and "
            f"commit {path}" for (kind, target, path), n in missing.items()]


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
                                  stored_ceilings(item.config),
                                  item.get_closest_marker("xfail") is not None or item.stash.get(KNOWN, None) is not None)
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


def absent_devices(config, results: list[dict]) -> dict[str, str]:
    """Device kinds with cases in `results` that are not available here, with the reason (as the
    gate's survey sees them: under xdist, the controller's)."""
    kinds = {r.get("device") for r in results}
    return {k: kind_reason(config, k) for k in devices.KINDS if k in kinds and kind_reason(config, k)}


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
        json.dump({"results": results, "memory": _memory, "absent_devices": absent_devices(config, results),
                   "hypothesis_profile": config._mpt_kv_profile, "environment": environment(),
                   "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "capabilities": _extras["capabilities"], "unrecorded": list(_extras["unrecorded"].values())},
                  f, indent=1, default=str)
