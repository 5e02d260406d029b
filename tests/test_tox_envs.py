"""tox.ini: the main job's commands are written once ([conformance]) and run both by `tox` (each
test env's conformance run after its tests, then its own matrix) and by `tox -m conformance` (envs of
their own, one matrix of both at the end): CI runs `tox p -o`, so the README's main-job
command runs there as the same commands."""

import subprocess
import sys
from pathlib import Path

import pytest
from plugin_testing import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def tox_config(envs: str) -> dict[str, dict[str, list[str]]]:
    run = subprocess.run([sys.executable, "-m", "tox", "config", "-e", envs, "-k", "commands", "commands_post"],
                         cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr
    out, env, key = {}, None, None
    for line in run.stdout.splitlines():
        if line.startswith("[testenv:"):
            env = line[len("[testenv:"):-1]
            out[env] = {"commands": [], "commands_post": []}
        elif line.startswith(("commands =", "commands_post =")):
            key, _, rest = line.partition("=")
            key = key.strip()
            out[env][key] = [rest.strip()] if rest.strip() else []
        elif line.startswith("  ") and env and key:
            out[env][key].append(line.strip())
    return out


@pytest.fixture(scope="module")
def envs():
    pytest.importorskip("tox")
    return tox_config("cpu,ohabana,foundry,conformance-cpu,conformance-ohabana,conformance-foundry")


def test_tox_runs_the_main_jobs_commands_as_tox_m_conformance_does(envs):
    for env in ("cpu", "ohabana", "foundry"):
        assert envs[f"conformance-{env}"]["commands"]
        assert set(envs[f"conformance-{env}"]["commands"]) <= set(envs[env]["commands"])
    # the main job ends with one matrix of the three runs
    assert [c for c in envs["conformance-foundry"]["commands_post"] if "mpt_kv report" in c and
            "conformance-cpu.json" in c and "conformance-ohabana.json" in c and "conformance-foundry.json" in c]


@pytest.mark.parametrize("env, other", [("cpu", "ohabana"), ("ohabana", "cpu"), ("foundry", "cpu"), ("cpu", "foundry"),
                                        ("foundry", "ohabana"), ("ohabana", "foundry")])
def test_a_test_env_reads_and_removes_only_its_own_report(envs, env, other):
    """`tox run-parallel` runs the two test envs side by side: an env that removed or read the
    other's report could delete a fresh one or print a stale one."""
    commands = envs[env]["commands"] + envs[env]["commands_post"]
    assert any("mpt_kv report" in c and f"conformance-{env}.json" in c for c in envs[env]["commands_post"])
    assert not [c for c in commands if f"conformance-{other}" in c], commands
    removals = [c for c in commands if "unlink" in c]
    assert removals and all(f"conformance-{env}.json" in c and f"conformance-{other}" not in c for c in removals), removals


def test_the_conformance_suite_runs_once_per_env(envs):
    """The tests' pytest collects tests/ only; the shipped suite is the conformance run's, strict about
    known failures."""
    for env in ("cpu", "ohabana", "foundry"):
        tests = [c for c in envs[env]["commands"] if c.startswith("pytest") and "-m sweep" not in c]
        assert len(tests) == 1 and "tests" in tests[0] and "mpt_kv/conformance" not in tests[0], tests
        runs = [c for c in envs[env]["commands"] if "mpt_kv run" in c]
        assert len(runs) == 1 and "--strict-known-failures" in runs[0], runs
