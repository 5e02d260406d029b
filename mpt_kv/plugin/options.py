"""The plugin's options: every command-line option, ini option and environment variable it
reads, declared and read here. Each value is checked once, where it enters (pytest_configure,
before any test): a bad one is a usage error naming the option, the value and where it came from.

A project configures mpt-kv in its own ini file (`mpt_kv_targets`, `mpt_kv_only_targets`,
`mpt_kv_dtypes`, `mpt_kv_known_failures`, `mpt_kv_ceilings_dir`, `mpt_kv_require_ceilings`), so
its CI line is just `pytest -m hpu` (docs/targets.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.errors import InvalidArgument

from mpt_kv import devices, versions
from mpt_kv.checks import profiles
from mpt_kv.plugin.state import run_state
from mpt_kv.checks import reach
from mpt_kv.outputs import EMPTY

ENV_REQUIRE = "MPT_KV_REQUIRE_DEVICE"
ENV_KNOWN_FAILURES = "MPT_KV_KNOWN_FAILURES"
ENV_CEILINGS_DIR = "MPT_KV_CEILINGS_DIR"  # also read by mpt_kv.checks.ceilings.baseline_path
ENV_PROFILE = profiles.ENV  # MPT_KV_HYPOTHESIS_PROFILE
DTYPE_NAMES = ("bf16", "fp32")  # the keys of mpt_kv.model.config.DTYPES (not imported here: it imports torch)
# built-in targets and the distributions they wrap (mpt_kv.versions, the package map): absent, their
# cases skip; present but not loading, they fail
BUILTIN_PACKAGES = {name: builtin.requires for name, builtin in versions.BUILTIN.items()}
CEILINGS_FOLDER = "mpt_kv_ceilings"  # default: <rootdir>/mpt_kv_ceilings


def add_options(parser) -> None:
    g = parser.getgroup("mpt-kv", "mpt-kv KV cache conformance")
    g.addoption("--device", action="append", choices=devices.KINDS, default=None,
                help="run cases on this device kind only (repeatable); a kind named here is required: absent, "
                     "the run is an error (default: cpu and every kind available here; the others get no case, and the "
                     "summary says why in one line)")
    g.addoption("--require-device", action="append", choices=devices.KINDS, default=[],
                help=f"fail unless this device is present and at least one of its cases passed (repeatable; "
                     f"also ${ENV_REQUIRE}=hpu,cuda). -m and --device imply it for the kinds they select")
    g.addoption("--allow-missing-device", action="store_true",
                help="local exploration only (refused under CI=true): a device selected by -m or --device may be absent "
                     "(its cases skip, and a run that ran none of them can pass); --require-device still holds")
    g.addoption("--allow-no-cache-check", action="store_true",
                help="local exploration only (refused under CI=true): a run (e.g. -k P0) may pass although a target of it had "
                     "no cache property pass (P1-P3, memory, static-shape, graph-capture, ops-*, family-P1-P3, family-memory, "
                     "family-ops); the report records it")
    g.addoption("--target", action="append", default=[], metavar="SPEC",
                help="add a target: a built-in name or package.module:factory (repeatable); one that cannot be "
                     "imported or built is an error")
    g.addoption("--only-targets", action="store_true",
                help="run only the --target ones, not the built-in reference/transformers/optimum-habana")
    g.addoption("--dtype", action="append", choices=DTYPE_NAMES, default=None,
                help="dtypes to run (repeatable; default fp32 and bf16)")
    g.addoption("--mpt-kv-report", metavar="FILE", default=None, help="write the conformance matrix as JSON")
    g.addoption("--mpt-kv-markdown", metavar="FILE", default=None,
                help="write a short Markdown summary of the run (verdict, what broke with its rerun command, known "
                     "failures and the matrix collapsed) for a CI job summary or a pull-request comment")
    g.addoption("--strict-known-failures", action="store_true",
                help="a known-failures entry that matches no case of this run is an error (CI's tox envs use it)")
    g.addoption("--no-mpt-kv-matrix", action="store_true",
                help="do not print the conformance matrix and memory table (--mpt-kv-report still writes them)")
    g.addoption("--update-ceilings", action="store_true",
                help="rewrite the memory ceilings baseline with what ran (entries that did not run are kept) "
                     "and print the diff; a higher (looser) value also needs --allow-looser-ceilings")
    g.addoption("--allow-looser-ceilings", action="store_true",
                help="with --update-ceilings: accept measurements above their stored ceilings")
    g.addoption("--ceilings-dir", metavar="DIR", default=None,
                help=f"folder of the baseline files ceilings-<device>.json (default: ${ENV_CEILINGS_DIR}, "
                     f"else the ini option mpt_kv_ceilings_dir, else <rootdir>/{CEILINGS_FOLDER}); one named "
                     "explicitly must exist")
    parser.addini("mpt_kv_targets", type="linelist", default=[],
                  help="mpt-kv: targets to run (package.module:factory or built-in names), as --target")
    parser.addini("mpt_kv_only_targets", type="bool", default=False,
                  help="mpt-kv: run only mpt_kv_targets / --target, not the built-in targets (as --only-targets)")
    parser.addini("mpt_kv_dtypes", type="linelist", default=[], help="mpt-kv: dtypes to run (fp32, bf16), as --dtype")
    parser.addini("mpt_kv_strict_known_failures", type="bool", default=False,
                  help="mpt-kv: as --strict-known-failures (a known-failures entry that matches no case is an error)")
    parser.addini("mpt_kv_known_failures", default="",
                  help="mpt-kv: the project's known-failures JSON file (relative to the ini file), "
                       "in addition to mpt-kv's own entries for its built-in targets")
    parser.addini("mpt_kv_ceilings_dir", default="",
                  help=f"mpt-kv: folder of the stored memory ceilings (relative to the ini file; default "
                       f"<rootdir>/{CEILINGS_FOLDER})")
    parser.addini("mpt_kv_reference_model", default="",
                  help="mpt-kv: a JSON file of a real model's values that the reach table prints beside what the "
                       "run reached (relative to the ini file; default mpt-7b's, mpt_kv/data/mpt-7b.json)")
    parser.addini("mpt_kv_require_ceilings", type="linelist", default=[],
                  help="mpt-kv: targets whose memory cases fail without a stored ceiling ('*': all); a target "
                       "that has any entry must have all of them anyway")


def check(config) -> None:
    """Every value read later, checked now: a usage error before any test."""
    check_hypothesis_profile()
    only_targets(config)
    strict_known_failures(config)  # read at the end of the run: a bad ini value would cost every case first
    dtype_names(config)
    check_ceilings_dir(config)
    required_ceilings(config)
    reference_model(config)


def reference_model(config) -> dict:
    """The real model the reach table compares with (ini mpt_kv_reference_model), read once."""

    state = run_state(config)
    if state.reference_model is None:

        ini = config.getini("mpt_kv_reference_model")
        try:
            state.reference_model = reach.load_reference_model(ini_relative(config, ini) if ini else None)
        except ValueError as e:
            raise pytest.UsageError(f"ini option mpt_kv_reference_model: {e}") from None
    return state.reference_model


# --- targets and dtypes --------------------------------------------------------------------------------------------

def strict_known_failures(config) -> bool:
    """--strict-known-failures or the ini option mpt_kv_strict_known_failures (a bool)."""
    try:
        ini = bool(config.getini("mpt_kv_strict_known_failures"))
    except (ValueError, pytest.UsageError) as e:  # pytest's own parse: "invalid truth value 'maybe'"
        raise pytest.UsageError(f"ini option mpt_kv_strict_known_failures: {e}; expected true or false") from None
    return bool(config.getoption("strict_known_failures")) or ini


def only_targets(config) -> bool:
    """--only-targets or the ini option mpt_kv_only_targets (a bool: true/false, yes/no, 1/0), which
    needs a target to run: without one the run would have no target at all (a usage error, not a run
    of empty-parameter skips)."""
    try:  # read even when --only-targets is given: a bad ini value is an error whatever the command line says
        ini = bool(config.getini("mpt_kv_only_targets"))
    except (ValueError, pytest.UsageError) as e:  # pytest's own parse: "invalid truth value 'maybe'"
        raise pytest.UsageError(f"ini option mpt_kv_only_targets: {e}; expected true or false") from None
    if config.getoption("only_targets"):
        source = "--only-targets"
    elif ini:
        source = "ini option mpt_kv_only_targets = true"
    else:
        return False
    if not named_targets(config):
        raise pytest.UsageError(f"{source} but no target is named (no --target, no ini mpt_kv_targets): the run "
                                "would have no target and check nothing; name one with --target SPEC")
    return True


def named_targets(config) -> list[str]:
    """Targets the run names explicitly (--target, ini mpt_kv_targets): one that cannot be
    imported or built is an error."""
    return list(dict.fromkeys([*config.getini("mpt_kv_targets"), *config.getoption("target")]))


def target_specs(config) -> list[str]:
    """This run's targets: the built-in ones (unless only the named ones), then the named ones."""
    extra = named_targets(config)
    return extra if only_targets(config) else [*BUILTIN_PACKAGES, *[t for t in extra if t not in BUILTIN_PACKAGES]]


def dtype_names(config) -> list[str]:
    names = config.getoption("dtype") or config.getini("mpt_kv_dtypes") or ["fp32", "bf16"]
    unknown = [n for n in names if n not in DTYPE_NAMES]
    if unknown:
        raise pytest.UsageError(f"mpt_kv_dtypes: unknown {unknown}, expected some of {sorted(DTYPE_NAMES)}")
    return names


def check_hypothesis_profile() -> None:
    """$MPT_KV_HYPOTHESIS_PROFILE must name a registered hypothesis profile (mpt-kv registers
    dev, ci and thorough; a conftest may register more)."""
    name = os.environ.get(ENV_PROFILE)
    if not name:
        return
    try:  # mpt_kv.checks.profiles registered mpt-kv's own
        settings.get_profile(name)
    except InvalidArgument:
        raise pytest.UsageError(f"${ENV_PROFILE}={name!r}: no such hypothesis profile; mpt-kv's profiles are dev "
                                "(the default), ci (CI=true: derandomized) and thorough") from None


# --- files and folders of the project ---------------------------------------------------------------------------

def known_failures_file(config) -> Path:
    """The known-failures file: $MPT_KV_KNOWN_FAILURES, else the project's (ini
    mpt_kv_known_failures, relative to the ini file), else the packaged one. One file: a project
    lists the entries that apply to what it runs (copying mpt-kv's where it runs built-in targets)."""
    from mpt_kv.findings import entries  # the known-failures format's module: not needed by every option

    ini = config.getini("mpt_kv_known_failures")
    return os.environ.get(ENV_KNOWN_FAILURES) or (ini_relative(config, ini) if ini else entries.FILE)


# --- the files a run writes, and the project's files it reads (no output may replace one) -------------------------

OUTPUT_OPTIONS = {"--mpt-kv-report": "mpt_kv_report", "--mpt-kv-markdown": "mpt_kv_markdown"}


def output_files(config) -> list[tuple[str, str]]:
    """(option, path) of every file this run writes, as given: mpt-kv's (OUTPUT_OPTIONS; '' too: a usage
    error, never "not given") and pytest's own --junitxml (the same path as one of ours would lose one)."""
    given = [(flag, config.getoption(name)) for flag, name in OUTPUT_OPTIONS.items()]
    given.append(("--junitxml", config.getoption("xmlpath", None)))
    return [(flag, path) for flag, path in given if path is not None]


def read_files(config) -> list[tuple[str, Path]]:
    """(what, path) of the project's files this run reads: the ini file, the known-failures file, the
    reference model's values and the stored memory ceilings (--update-ceilings rewrites those itself)."""
    reads = [("the ini file", config.inipath), ("the known-failures file", known_failures_file(config))]
    ini = config.getini("mpt_kv_reference_model")
    if ini:
        reads.append(("ini option mpt_kv_reference_model's file", ini_relative(config, ini)))
    folder = ceilings_dir(config)
    if folder.is_dir():
        reads += [("a stored ceilings file", path) for path in sorted(folder.glob("ceilings-*.json"))]
    return [(what, path) for what, path in reads if path is not None]


def ini_relative(config, value: str) -> Path:
    base = config.inipath.parent if config.inipath else config.rootpath
    return base / Path(value).expanduser()


def ceilings_dir_and_source(config) -> tuple[Path, str | None]:
    """(the stored ceilings folder, where it was named; None for the default <rootdir>/mpt_kv_ceilings).
    --ceilings-dir, else $MPT_KV_CEILINGS_DIR, else ini mpt_kv_ceilings_dir (relative to the ini file)."""
    option = config.getoption("ceilings_dir")
    if option:
        return Path(option), f"--ceilings-dir {option}"
    env = os.environ.get(ENV_CEILINGS_DIR)
    if env:
        return Path(env), f"${ENV_CEILINGS_DIR}={env}"
    ini = config.getini("mpt_kv_ceilings_dir")
    if ini:
        return ini_relative(config, ini), f"ini option mpt_kv_ceilings_dir = {ini}"
    return config.rootpath / CEILINGS_FOLDER, None


def keep_rootdir(config, parser, args) -> None:
    """Put pytest's rootdir (and ini file) back where they would be without mpt-kv's option values.

    pytest finds its rootdir before a plugin's options are known: in `--ceilings-dir DIR` it reads
    DIR as a test path, so the rootdir (and the ini file searched from it) became DIR's, and every node
    id moved (`FAILED ../../tmp/DIR::test_memory_ceilings[...]`, the project's ini options lost).
    Called from the plugin's earliest hook, before any conftest or collection: it redoes pytest's own
    `determine_setup` over the arguments as parsed now and, where the rootdir differs, restores it. The
    only use of pytest's private setup state (`_rootpath`, `_inipath`, `_inicfg`, `_inicache`);
    tests/test_plugin_options.py runs it on the locked pytest."""
    import copy

    try:
        from _pytest.config.findpaths import determine_setup

        ns = parser.parse_known_args(list(args), namespace=copy.copy(config.option))
        if not getattr(ns, "ceilings_dir", None):
            return
        rootpath, inipath, inicfg, ignored = determine_setup(
            inifile=ns.inifilename, override_ini=ns.override_ini, args=ns.file_or_dir,
            rootdir_cmd_arg=ns.rootdir or None, invocation_dir=config.invocation_params.dir)
        if rootpath == config.rootpath:
            return
        old = (str(config.inipath.parent) if config.inipath else str(config.rootpath))
        config._rootpath, config._inipath, config._inicfg = rootpath, inipath, inicfg
        config._ignored_config_files = ignored
        config._inicache.clear()
        parser.extra_info["rootdir"], parser.extra_info["inifile"] = str(rootpath), str(inipath)
        if config.known_args_namespace.confcutdir == old:  # derived from the wrong rootdir: derive it again
            config.known_args_namespace.confcutdir = str(inipath.parent if inipath else rootpath)
    except (ImportError, AttributeError, TypeError) as e:
        raise pytest.UsageError(f"--ceilings-dir: mpt-kv keeps pytest's rootdir with pytest's private setup API, which "
                                f"pytest {pytest.__version__} does not provide as expected ({type(e).__name__}: {e}); "
                                "write --ceilings-dir=DIR (pytest then does not read DIR as a test path), or install "
                                "the pytest of mpt-kv's locks") from None


def ceilings_dir(config) -> Path:
    return ceilings_dir_and_source(config)[0]


def check_ceilings_dir(config) -> None:
    """A folder named explicitly must be a folder: one that does not exist would leave every memory
    case on the analytic checks alone, silently. The default folder may be absent (a project that
    never recorded), and so may a named one that --update-ceilings is about to create."""
    if str(config.getoption("ceilings_dir")).strip() == "":  # '' is no folder (not "not given", not the current one)
        raise pytest.UsageError(f"--ceilings-dir '': {EMPTY}")
    path, source = ceilings_dir_and_source(config)
    if source is None or path.is_dir():
        return
    if path.exists():
        raise pytest.UsageError(f"{source}: {path} is not a folder; name the folder that holds ceilings-<device>.json")
    if not config.getoption("update_ceilings"):
        raise pytest.UsageError(f"{source}: the folder {path} does not exist, so no stored memory ceiling would be "
                                "compared; name the folder that holds ceilings-<device>.json (record into a new one "
                                "with --update-ceilings)")


def required_ceilings(config) -> tuple[str, ...]:
    """ini mpt_kv_require_ceilings: '*', or target names. A name that is neither built in, nor a
    target of this run, nor a factory spec (package.module:factory, as a project's own
    parametrize_with_checks names its factories) is a typo that would require nothing."""
    names = tuple(config.getini("mpt_kv_require_ceilings"))
    known = list(dict.fromkeys([*BUILTIN_PACKAGES, *target_specs(config)]))
    unknown = [n for n in names if n != "*" and n not in known and ":" not in n]
    if unknown:
        raise pytest.UsageError(f"ini option mpt_kv_require_ceilings: {', '.join(map(repr, unknown))} is not a target: "
                                f"expected '*', a target of this run or a built-in one ({', '.join(known)}), or "
                                "package.module:factory")
    return names
