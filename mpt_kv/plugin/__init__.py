"""The pytest plugin (the `pytest11` entry point `mpt_kv.plugin`): its hooks, in the order a run
meets them. Each hands its work to the module that owns that job:

  options         every command-line and ini option; each value checked once, where it enters
  parametrize     the device, target and dtype parameters and their fixtures (a target resolved once)
  gate            which devices a run requires, the checks before any test, the end-of-run verdict
  cards           xdist: one card of each device kind per worker, pinned before its pytest starts
  known_failures  known upstream failures: a strict xfail of only the PropertyFailure an entry names
  outcomes        what each case's reports say, collected in this process (results, memory, extras)
  ceilings        the stored memory ceilings, --update-ceilings, the memory table and its advice
  report          the conformance matrix and the JSON report (--mpt-kv-report)
  markdown        the run's Markdown summary (--mpt-kv-markdown)
  state           the session's state: what each module learns as the run goes (RunState)

docs/gate.md says what the gate guarantees; docs/targets.md how a project configures it. The
package imports torch only inside hooks and fixtures: an xdist worker loads it before its card is
pinned, and since PyTorch 2.5 `import torch` initialises device backends.
"""

from __future__ import annotations

import pytest

from mpt_kv import devices
from mpt_kv.checks import profiles
from mpt_kv.plugin import cards, ceilings, gate, known_failures, options, outcomes, parametrize, report, state
from mpt_kv.plugin import profile as run_profile
from mpt_kv.plugin import markdown as markdown_summary
from mpt_kv.plugin.parametrize import missing_package  # noqa: F401  (mpt_kv.cli.bench)

# --- start: options, the earliest check in an xdist worker, configuration -------------------------------------------

def pytest_addoption(parser):
    options.add_options(parser)
    run_profile.add_options(parser)  # --mpt-kv-profile, ini mpt_kv_profile


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    """The earliest hook a plugin gets in an xdist worker, before conftest files (which may
    import torch): the card the controller gave this worker is still in place."""
    cards.check_pinned_in_worker()
    options.keep_rootdir(early_config, parser, args)  # before any conftest or node id: --ceilings-dir DIR is no path


def pytest_configure(config):
    for kind in devices.KINDS:
        config.addinivalue_line("markers", f"{kind}: a case on the {kind} device")
    config.addinivalue_line("markers", "property(name): which property (P0-P3) the test checks")
    config.addinivalue_line("markers", "no_target(reason): the placeholder of a conformance test with no target "
                                       "of this run (a run of such placeholders alone is a usage error)")
    options.check(config)
    run = state.start(config)  # this session's state (one per process): what every module below records
    profiles.load_profile()
    config.pluginmanager.register(Collector(run), "mpt_kv_collector")
    gate.configure(config)
    run_profile.configure(config)  # gate: the stored profile matches the installed catalogue, or a usage error
    known_failures.configure(config)
    report.clear_stale_report(config)


class Collector:
    """Every report as it arrives (on the xdist controller: from every worker), into the session's
    state: pytest_runtest_logreport gets no config, so the state's collector is a plugin object."""

    def __init__(self, run):
        self.run = run

    def pytest_runtest_logreport(self, report):
        outcomes.collect(self.run, report)
        known_failures.count(self.run, report)


def pytest_sessionstart(session):
    gate.check_required_devices(session.config)
    parametrize.check_named_targets(session.config)


# --- xdist: cards for the workers (controller) ------------------------------------------------------------------

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config, specs):
    cards.set_up_pool(config, specs)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    cards.pin_worker(node)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    cards.give_back(node)
    known_failures.from_worker(node)
    run_profile.from_worker(node)  # what a worker's collection kept of the gate profile


# --- collection: parameters, fixtures, known failures -------------------------------------------------------------

def pytest_generate_tests(metafunc):
    parametrize.generate(metafunc)


@pytest.fixture
def device(request) -> "torch.device":  # noqa: F821
    return parametrize.device_for(request)


@pytest.fixture
def target(request, device):
    """The target (a mpt_kv.targets.ResolvedTarget), resolved and built once on a tiny config."""
    return parametrize.target_for(request, device)


@pytest.hookimpl(tryfirst=True)  # before -m/-k deselect: an entry is judged against every collected case
def pytest_collection_modifyitems(config, items):
    for item in items:
        params = outcomes.label(item)
        if params is not None:
            known_failures.note_case(config, item, params)
    known_failures.tell_controller(config)
    run_profile.select(config, items)  # --mpt-kv-profile gate: only its cases (after the known failures saw them all)


@pytest.hookimpl(tryfirst=True)  # in an xdist worker, before xdist sends its collection to the controller
def pytest_collection_finish(session):
    gate.check_collected(session)  # a run whose conformance tests have no target: a usage error before any test
    run_profile.check_collected(session)  # gate profile: no case kept, or under CI one its selection dropped: usage error


# --- each case: its checks' records, its known failure, its outcome ---------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    context = outcomes.run_context(item, ceilings.stored_ceilings, known_failures.expected_to_fail(item))
    if context is None:
        return (yield)
    from mpt_kv.checks.running import running  # lazy: it imports torch, and the plugin loads before an xdist worker's card is pinned

    with running(context):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    with known_failures.brief_traceback(item, call):
        rep = yield
    known_failures.apply(item, rep, call)
    outcomes.record_outcome(rep, call)  # after the xfail decision: the matrix's word for the phase
    return rep


# --- the end: verdict, ceilings, report (written last), summary ---------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if getattr(config, "workerinput", None) is not None:
        return  # xdist worker: the controller sees every report and decides
    run = state.run_state(config)
    verdict = gate.verdict(config) + run_profile.verdict(config)  # the profile's: under CI, cases it did not run
    failed = bool(verdict)
    failed |= known_failures.strict_failure(config)
    failed |= ceilings.update_ceilings(config)
    path = config.getoption("mpt_kv_report")
    if path:
        run.report_problem = report.write_report(config, path, run.results, run.memory, run.extras)
        failed |= run.report_problem is not None
    markdown = config.getoption("mpt_kv_markdown")
    if markdown:
        run.markdown_problem = markdown_summary.write(config, markdown, run.results, verdict)
        failed |= run.markdown_problem is not None
    if failed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if run_profile.usage_error(config):  # xdist: the workers refused the selection; only the controller's end says it
        session.exitstatus = pytest.ExitCode.USAGE_ERROR


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "workerinput", None) is not None:
        return
    tw, run = terminalreporter, state.run_state(config)
    report.summary(tw, config, run.results, run.extras)
    parametrize.summary(tw, config, run.results)
    gate.summary(tw, config)
    run_profile.summary(tw, config)
    cards.summary(tw, config)
    known_failures.summary(tw, config)
    ceilings.summary(tw, config)
    for problem in (run.report_problem, run.markdown_problem):
        if problem:
            tw.write_line(problem, red=True)
    hint = report.short_traceback_hint(tw, config)
    if hint:
        tw.write_line(hint, yellow=True)
