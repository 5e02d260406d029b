from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from plugin_testing import HANG_S

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """The test models are tiny: on a 2-core machine a second intra-op thread only contends
    (measured 2-10x slower under load), and one thread makes CPU timings steadier."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --- mpt-kv as a user installs it: a wheel in a fresh virtual environment, built once per run -------------------------

# what a subprocess of the end-to-end tests must not inherit from this run: its sys.path, its pytest
# options, its xdist worker identity, mpt-kv's own variables
NOT_INHERITED = ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID")


def clean_env(**more: str) -> dict[str, str]:
    """This process's environment without what would make a subprocess see this run (NOT_INHERITED,
    MPT_KV_*, PYTEST_PLUGINS), plus `more`."""
    env = {k: v for k, v in os.environ.items()
           if k not in NOT_INHERITED and not k.startswith(("MPT_KV_", "PYTEST_PLUGINS"))}
    return {**env, **more}


@dataclass(frozen=True)
class WheelVenv:
    sdist: Path    # mpt_kv-<version>.tar.gz, built by `python -m build` from a clean copy of this checkout
    wheel: Path    # mpt_kv-<version>-py3-none-any.whl, built by the same command from that sdist
    python: Path   # the venv's python: mpt-kv from the wheel, everything else from this environment
    purelib: Path  # the venv's site-packages, where the wheel's mpt_kv is
    build_log: Path  # what `python -m build` printed ("* Building wheel from sdist")
    build_seconds: float  # what it took (tests/test_release.py prints it)

    @staticmethod
    def env(**more: str) -> dict[str, str]:
        """The environment to run the venv's python in (clean_env)."""
        return clean_env(**more)


def _sh(*cmd, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=HANG_S, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def readme_install_commands() -> list[str]:
    """The README's "Into another project" commands, in order: the build in a clone (`python -m pip
    install build && python -m build`), the wheel's install, the index's install (not yet published)."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("**Into another project.**")
    section = text[start:text.index("\n## ", start)]
    return [line.strip() for block in re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)
            for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.fixture(scope="session")
def readme_install() -> list[str]:
    """readme_install_commands(), for the test that checks them (tests/test_readme_commands.py)."""
    return readme_install_commands()


def _tracked_files() -> list[str]:
    """The checkout's files as a fresh clone of it would have them once committed: tracked, or new and
    not ignored (their working-tree content)."""
    try:
        listed = _sh("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).stdout.split("\0")
    except (OSError, RuntimeError) as e:
        raise RuntimeError(f"the wheel is built from a clean copy of the tracked files, listed by git ls-files: {e}")
    return [name for name in listed if name and (REPO / name).is_file()]


def _build_wheel_venv(root: Path) -> dict:
    import time

    # a clean copy, as a fresh clone has it: building in the checkout would leave build/ and dist/ there
    source = root / "mpt-kv"
    for name in _tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    # the README's build command, run as it says, in the clone's folder: the sdist, then the wheel from it
    build = readme_install_commands()[0].split("&&")[-1].split()
    if build[:3] != ["python", "-m", "build"]:
        raise RuntimeError(f"the README's build command is {build}: expected `python -m build`")
    t0 = time.monotonic()
    done = _sh(sys.executable, *build[1:], cwd=source)
    seconds = time.monotonic() - t0
    (root / "build.log").write_text(done.stdout + done.stderr)
    (sdist,) = (source / "dist").glob("mpt_kv-*.tar.gz")
    (wheel,) = (source / "dist").glob("mpt_kv-*.whl")
    # made without pip; it reuses this environment's packages (torch, pytest, hypothesis, transformers)
    # through a .pth file after its own, so nothing is downloaded and torch is not reinstalled (as on a
    # Gaudi image: the README's install command with --no-deps)
    venv = root / "venv"
    _sh(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _sh(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel)
    purelib = Path(_sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "reuse-parent-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = _sh(python, "-c", "import mpt_kv.plugin as p; print(p.__file__)", cwd=root, env=clean_env()).stdout.strip()
    if not where.startswith(str(purelib)):
        raise RuntimeError(f"mpt_kv imports from {where}, not from the installed wheel in {purelib}")
    return {"sdist": str(sdist), "wheel": str(wheel), "python": str(python), "purelib": str(purelib),
            "build_log": str(root / "build.log"), "build_seconds": round(seconds, 1)}


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> WheelVenv:
    """mpt-kv's sdist and wheel built by the README's command (`python -m build`, docs/releasing.md's
    too) from a clean copy of this checkout, the wheel installed into a fresh virtual environment, once
    per test run: under pytest-xdist the first worker that asks builds it in the
    run's shared temporary folder under a file lock, the others wait and reuse it (a failed build is
    reported to each, not retried). Read-only for the tests: copy the projects they run elsewhere."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one folder per run either way
    root = shared / "mpt-kv-wheel-venv"
    built, failed = root / "built.json", root / "failed.txt"
    with FileLock(str(shared / "mpt-kv-wheel-venv.lock")):
        if not built.is_file() and not failed.is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            try:
                built.write_text(json.dumps(_build_wheel_venv(root)))
            except Exception as e:
                failed.write_text(f"{type(e).__name__}: {e}")
    if failed.is_file():
        pytest.fail(f"building mpt-kv's wheel and its venv failed: {failed.read_text()}", pytrace=False)
    return WheelVenv(**{k: v if k == "build_seconds" else Path(v) for k, v in json.loads(built.read_text()).items()})


# --- tests that need optimum-habana: deselected where it is not installed, in one line -------------------------------

OPTIMUM_HABANA_TESTS = pytest.StashKey[int]()  # config -> how many tests marked optimum_habana were deselected


def optimum_habana_installed() -> bool:
    """By its distribution, not find_spec: the port loader puts bare parent packages (no __spec__) into
    sys.modules, where find_spec("optimum.habana") raises ValueError (an INTERNALERROR at collection)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("optimum-habana")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    """A test marked `optimum_habana` where optimum-habana is not installed is deselected, not skipped
    one by one (the ohabana env runs it); the summary says how many, in one line. The real release
    sweep (marked sweep) goes first: one long subprocess, mostly waiting on pip, that the other xdist
    worker's tests overlap (last, it would add its whole minute to the run)."""
    items.sort(key=lambda item: item.get_closest_marker("sweep") is None)  # stable: the rest keep their order
    import importlib.util

    if importlib.util.find_spec("llmfoundry") is None:  # tox -e foundry runs them (tests/test_foundry.py)
        foundry = [item for item in items if item.get_closest_marker("llm_foundry")]
        if foundry:
            items[:] = [item for item in items if not item.get_closest_marker("llm_foundry")]
            config.hook.pytest_deselected(items=foundry)
    if optimum_habana_installed():
        return
    dropped = [item for item in items if item.get_closest_marker("optimum_habana")]
    if dropped:
        items[:] = [item for item in items if not item.get_closest_marker("optimum_habana")]
        config.hook.pytest_deselected(items=dropped)
    config.stash[OPTIMUM_HABANA_TESTS] = len(dropped)
    if hasattr(config, "workeroutput"):
        config.workeroutput["optimum_habana_tests"] = len(dropped)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist: every worker collects every test; the controller takes their count."""
    n = getattr(node, "workeroutput", {}).get("optimum_habana_tests")
    if n is not None:
        node.config.stash[OPTIMUM_HABANA_TESTS] = max(n, node.config.stash.get(OPTIMUM_HABANA_TESTS, 0))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    n = config.stash.get(OPTIMUM_HABANA_TESTS, 0)
    if n and not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"tests/: {n} tests need optimum-habana, which is not installed here: deselected "
                                    "(tox -e ohabana runs them)")


# --- a simulated GPU in this process ---------------------------------------------------------------------------------

FAKE_CUDA = REPO / "tests" / "fakes" / "cuda"


@pytest.fixture
def fake_cuda():
    """tests/fakes/cuda installed in this process for one test: torch.cuda on this CPU build of torch
    (allocator statistics, CUDA graphs that record and replay aten ops), every cuda device argument
    mapped onto cpu. Yields the fake module (its ALLOCATOR, SYNCS). mpt-kv's cached device probe is
    cleared before and after, so `cuda` is available inside the test only."""
    from mpt_kv import devices

    if str(FAKE_CUDA) not in sys.path:
        sys.path.insert(0, str(FAKE_CUDA))
    import fake_cuda as fake

    fake.install()
    fake.SYNCS.clear()
    devices._probe.cache_clear()
    try:
        yield fake
    finally:
        fake.uninstall()
        devices._probe.cache_clear()
