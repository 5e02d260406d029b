"""The downstream example (examples/downstream) run as its own CI would run it: mpt-kv built as a
wheel, installed into a fresh virtual environment, the project run from a directory outside this
repository with only documented API.

The wheel and the venv are built once per test run and shared (tests/conftest.py::wheel_venv): the
venv is made without pip and reuses this environment's packages (torch, pytest, hypothesis) through
a .pth file, so nothing is downloaded and torch is not reinstalled (as on a Gaudi image). mpt-kv
itself is the wheel's copy: the runs show the plugin and the checks executing from the venv's
site-packages, never from this checkout.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from mpt_kv.checks import index
from plugin_testing import HANG_S

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "downstream"
TARGET = "tinympt.mpt_kv_target:build"

pytestmark = [
    pytest.mark.slow,  # the run's wheel build (~6 s, shared) and five pytest runs of the examples
    # tox runs the suite in two envs; the example uses neither transformers nor optimum-habana,
    # so the optimum-habana env would only repeat it
    pytest.mark.skipif(importlib.util.find_spec("optimum") is not None,
                       reason="the downstream example runs in the default env (tox -e cpu); here it would repeat it"),
]


def workflow_wheel() -> str:
    """The wheel path the example's Gaudi workflow installs (its `pip install --no-deps ci/wheels/...` line)."""
    text = (EXAMPLE / ".github" / "workflows" / "mpt-kv-gaudi.yml").read_text()
    found = re.findall(r"pip install --no-deps (ci/wheels/mpt_kv-\S+\.whl)", text)
    assert len(found) == 1, f"the workflow installs mpt-kv from {found or 'nowhere'}: expected one ci/wheels/ wheel"
    return found[0]


@pytest.fixture(scope="module")
def installed(wheel_venv, tmp_path_factory):
    """(venv python, the example copied outside the repo, its environment, the venv's site-packages).
    The wheel and the venv are the run's one (tests/conftest.py::wheel_venv)."""
    root = tmp_path_factory.mktemp("downstream")
    project = shutil.copytree(EXAMPLE, root / "tinympt")
    # as its Gaudi workflow does: the wheel built from mpt-kv, committed under ci/wheels/, installed by
    # the path the workflow names (so a version bump that leaves the workflow behind fails here)
    (project / "ci" / "wheels").mkdir(parents=True, exist_ok=True)
    shutil.copy(wheel_venv.wheel, project / "ci" / "wheels")
    named = project / workflow_wheel()
    assert named.is_file(), f"the workflow installs {workflow_wheel()}, but the wheel built is {wheel_venv.wheel.name}"
    # the ci profile (derandomized, fewer examples): these runs are about the project, not the profiles
    env = wheel_venv.env(MPT_KV_HYPOTHESIS_PROFILE="ci")
    return wheel_venv.python, project, env, wheel_venv.purelib


def pytest_in(installed, *args) -> subprocess.CompletedProcess:
    python, project, env, _ = installed
    return subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args], cwd=project,
                          env=env, capture_output=True, text=True, timeout=HANG_S)


def row(out: str, path: str) -> list[str]:
    """The conformance matrix row of the example's target, float32, `path`: its cells under the
    gate's seven columns (P0-P4, memory, static-shape; the operations' columns follow, see `ops_row`)."""
    return full_row(out, path)[:7]


def graph_capture(out: str, path: str) -> str:
    """The same row's cell under graph-capture, the index's column after the gate's seven (where the run has it)."""
    return full_row(out, path)[7]


OPS = [p for p in index.PROPERTIES if p.column == "ops"]  # every ops property of the index: one column each


def ops_row(out: str, path: str) -> list[str]:
    """The same row's cells under the ops columns (ops-P1 ... ops-retained, where the run has them)."""
    return full_row(out, path)[8:8 + len(OPS)]


def generate_cell(out: str, path: str) -> list[str]:
    """The same row's cell under generate, the column after the operations' (where the run has it)."""
    return full_row(out, path)[8 + len(OPS):]


def full_row(out: str, path: str) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if cells[:4] == [TARGET, "cpu", "float32", path]:
            return cells[4:]
    raise AssertionError(f"no matrix row for {TARGET} cpu float32 {path}:\n{out}")


def test_the_projects_own_tests_pass_from_the_installed_wheel(installed):
    """Its CI line (`pytest -m hpu` on Gaudi; `-m cpu` here): the checks run through
    parametrize_with_checks, its known failures xfail, its recorded ceilings hold, the cases
    its adapter cannot run say why."""
    done = pytest_in(installed, "-m", "cpu", "--dtype", "fp32")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    _, _, _, purelib = installed
    assert f"{purelib.name}/mpt_kv/checks/running.py" in out, out  # the skip comes from the wheel's copy (the run layer)
    # columns: P0 P1 P2 P3 P4 memory static-shape
    assert row(out, "-")[0] == "passed", out
    assert row(out, "concat") == ["-", "passed", "-", "xfail", "passed", "xfail", "-"], out
    assert row(out, "static") == ["-"] + ["passed"] * 6, out
    assert row(out, "static+bucket4") == ["-"] + ["unsupported"] * 4 + ["-", "unsupported"], out
    assert (graph_capture(out, "static"), graph_capture(out, "concat")) == ("passed", "-"), out
    assert ops_row(out, "static") == ["unsupported"] * len(OPS), out  # declared: tinympt generates greedily
    assert generate_cell(out, "static") == ["unsupported"], out  # TinyMptForCausalLM has no generate
    assert "TinyMptForCausalLM.forward has no cache_idx parameter" in out, out
    assert "clip_qkv (tinympt has no clip_qkv" in out and "not drawn, its other cases run" in out, out


def test_the_shipped_suite_runs_on_the_targets_of_the_projects_ini(installed):
    """`pytest --pyargs mpt_kv.conformance -m cpu` in the project: P0-P4, static-shape and memory
    (one check of each, no edge case or graphs; the test above runs all of them) on the target its
    ini file names."""
    done = pytest_in(installed, "--pyargs", "mpt_kv.conformance", "-m", "cpu", "--dtype", "fp32", "-k",
                     "(P0 or P1/static or P2/static or P3/static or P4/static or static-shape/static or "
                     "memory/static/B4) and not bucket and not graphs and not P0/ and not max-seq and not long-gen and not head-dim "
                     "and not batch-8 and not alibi-bias and not ops-")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "7 passed" in out and "reference" not in out.split("mpt-kv conformance")[1], out
    assert row(out, "-")[0] == "passed" and row(out, "static") == ["-"] + ["passed"] * 6, out


def test_without_its_known_failures_file_the_bug_fails_the_run(installed):
    """The xfails above come from the project's own file, read by the installed plugin."""
    done = pytest_in(installed, "-m", "cpu", "--dtype", "fp32", "-k", "P3/concat", "-o", "mpt_kv_known_failures=")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "P3 cache aliasing after step prefill" in out and "mixed_qkv" in out, out
    assert row(out, "concat")[3] == "failed", out


# --- examples/own_signature: a model with its own forward signature, through mpt_kv.CallableRunner --------

OWN = REPO / "examples" / "own_signature"
OWN_TARGET = "ownmpt.mpt_kv_target:build"


def own_recipe() -> list[list[str]]:
    """The pytest commands of the example's CPU workflow as written there; its tox env runs the same."""
    workflow, tox = (OWN / ".github" / "workflows" / "cpu.yml").read_text(), (OWN / "tox.ini").read_text()
    cmds = [line.split("run: ", 1)[1] for line in workflow.splitlines() if line.strip().startswith("- run: python -m pytest")]
    assert len(cmds) == 2, f"the CPU workflow runs {cmds}: expected the conformance suite and the project's own tests"
    missing = [c for c in cmds if c not in tox]
    assert not missing, f"tox.ini [testenv:cpu] does not run {missing}: the two recipes differ"
    return [c.split() for c in cmds]


def own_run(installed, cmd: list[str], **env) -> subprocess.CompletedProcess:
    """One recipe command in a copy of the example outside the repo, with the wheel's mpt-kv, under CI=true."""
    python, project, base, _ = installed
    where = project.parent / "ownmpt"
    if not where.exists():
        shutil.copytree(OWN, where)
    return subprocess.run([str(python), *cmd[1:], "-p", "no:cacheprovider"], cwd=where, capture_output=True,
                          text=True, timeout=HANG_S, env={**base, "CI": "true", **env})


def own_row(out: str, dtype: str, path: str) -> dict[str, str]:
    """The conformance matrix row of the example's target: {column (P0, ..., ops-memory): cell}."""
    columns = None
    for line in out.splitlines():
        cells = line.split()
        if cells[:4] == ["target", "device", "dtype", "path"]:
            columns = cells[4:]
        elif columns and cells[:4] == [OWN_TARGET, "cpu", dtype, path]:
            return dict(zip(columns, cells[4:]))
    raise AssertionError(f"no matrix row for {OWN_TARGET} cpu {dtype} {path}:\n{out}")


def test_own_signature_recipe_passes_through_callable_runner(installed):
    """Its CI recipe, both commands: every check runs on the CallableRunner adapter and passes (buckets,
    which CallableRunner has not, are unsupported with the reason); then its own unmarked tests."""
    conformance, own = own_recipe()
    done = own_run(installed, conformance)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert f"{installed[3].name}/mpt_kv/" in out and "reference" not in out.split("mpt-kv conformance")[1], out
    for dtype in ("float32", "bfloat16"):
        concat, static = own_row(out, dtype, "concat"), own_row(out, dtype, "static")
        assert all(concat[p] == "passed" for p in ("P1", "P3", "P4", "memory", "ops-P1", "ops-P3", "ops-memory")), out
        assert all(static[p] == "passed" for p in ("P1", "P2", "P3", "P4", "memory", "ops-P1", "ops-P2", "ops-P3")), out
    assert own_row(out, "float32", "static")["static-shape"] == "passed", out
    assert "CallableRunner has no cache_idx buckets" in out, out
    done = own_run(installed, own)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr
    reports = installed[1].parent / "ownmpt" / "reports"
    assert (reports / "conformance-cpu.xml").is_file()
    # what the workflow appends to its job summary: the verdict first
    assert (reports / "mpt-kv-summary.md").read_text().startswith("## mpt-kv: passed"), out


def test_own_signature_recipe_fails_with_kv_views_of_wqkv(installed):
    """The seed bug planted (OWNMPT_KV_VIEWS=1: the concat prefill keeps K/V as views of Wqkv's
    output): the same recipe fails, P3 and memory naming the views; the static path still passes."""
    conformance, _ = own_recipe()
    done = own_run(installed, conformance + ["--dtype", "fp32"], OWNMPT_KV_VIEWS="1")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    row = own_row(out, "float32", "concat")
    assert row["P3"] == "failed" and row["memory"] == "failed", out
    assert "are views of layer 0's mixed_qkv" in out and "it is that layer's Wqkv output, views of it" in out, out
    static = own_row(out, "float32", "static")
    assert all(static[p] == "passed" for p in ("P1", "P2", "P3", "memory", "static-shape")), out
    summary = (installed[1].parent / "ownmpt" / "reports" / "mpt-kv-summary.md").read_text()
    assert summary.startswith("## mpt-kv: FAILED") and "### What broke" in summary, summary
    assert "| ownmpt.mpt_kv_target:build | P3/concat" in summary, summary


# --- examples/own_family: a model of another family (mistral: GQA, a sliding window), through mpt_kv.FamilyModel --

FAMILY_EXAMPLE = REPO / "examples" / "own_family"
FAMILY_TARGET = "owngqa.mpt_kv_target:build"
FAMILY_SECTION = "### A whole example: an own GQA model with a sliding window"


def family_section() -> str:
    text = (REPO / "docs" / "targets.md").read_text()
    start = text.index(FAMILY_SECTION)
    return text[start:text.index("\n### ", start + len(FAMILY_SECTION))]


def family_docs_commands() -> list[tuple[str, str, int]]:
    """(the comment above it, the command, the exit code it documents) of the section's bash block."""
    (block,) = re.findall(r"^```bash\n(.*?)^```", family_section(), flags=re.S | re.M)
    out, comment = [], ""
    for line in block.splitlines():
        if line.startswith("#"):
            comment = line[1:].strip()
        elif line.strip():
            code = re.search(r"exit (\d+)", comment)
            out.append((comment, line.strip(), int(code.group(1)) if code else 0))
    return out


@pytest.fixture(scope="module")
def family_project(installed):
    """The example copied outside the repository, its adapter replaced by the docs' (their python block)."""
    python, project, env, purelib = installed
    where = project.parent / "owngqa"
    if not where.exists():
        shutil.copytree(FAMILY_EXAMPLE, where, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    adapter = re.findall(r"^```python\n(.*?)^```", family_section(), flags=re.S | re.M)[0]
    (where / "src" / "owngqa" / "mpt_kv_target.py").write_text(adapter)
    return python, where, env, purelib


def family_row(out: str, path: str) -> dict[str, str]:
    """The matrix row of the example's target (mistral gqa, float32, `path`): {column: cell}."""
    columns = None
    for line in out.splitlines():
        cells = line.split()
        if cells[:4] == ["target", "device", "dtype", "path"]:
            columns = cells[4:]
        elif columns and cells[:4] == [f"{FAMILY_TARGET}/mistral/gqa", "cpu", "float32", path]:
            return dict(zip(columns, cells[4:]))
    raise AssertionError(f"no matrix row for {FAMILY_TARGET}/mistral/gqa cpu float32 {path}:\n{out}")


def test_the_docs_adapter_is_the_examples_whole_file():
    adapter = re.findall(r"^```python\n(.*?)^```", family_section(), flags=re.S | re.M)[0]
    assert adapter == (FAMILY_EXAMPLE / "src" / "owngqa" / "mpt_kv_target.py").read_text()


@pytest.mark.parametrize("comment, command, code", family_docs_commands(),
                         ids=["gaudi-gate" if "-m hpu" in c else "planted-bug" if code else "suite"
                              for _, c, code in family_docs_commands()])
def test_the_docs_commands_run_the_whole_suite_on_an_own_family_model_from_outside(family_project, comment, command,
                                                                                    code):
    """docs/targets.md's commands, copied, from the example's folder outside the repository: the family
    checks pass on the docs' adapter; the planted seed bug fails family-P3 and family-memory on concat and
    nothing else; the Gaudi gate is a usage error here."""
    python, where, env, _ = family_project
    argv = shlex.split(command)
    extra = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a))
    argv = [a for a in argv if not re.fullmatch(r"[A-Z_]+=\S*", a)]
    assert argv[:3] == ["python", "-m", "pytest"], command
    done = subprocess.run([str(python), *argv[1:], "-p", "no:cacheprovider"], cwd=where, capture_output=True, text=True,
                          timeout=HANG_S, env={**env, "CI": "true", **extra})
    out = done.stdout + done.stderr
    assert done.returncode == code, f"{command!r} ({comment}) exited {done.returncode}, not {code}:\n{out[-4000:]}"
    if "-m hpu" in command:
        assert "hpu is not available here" in out, out[-2000:]
        return
    concat, static = family_row(out, "concat"), family_row(out, "static")
    checks = ("family-P0", "family-P1", "family-P3", "family-P4", "family-ops", "family-memory")
    if code == 0:
        assert all(concat[c] == "passed" for c in checks), out
        assert all(static[c] == "passed" for c in checks[1:] + ("family-P2",)), out
    else:
        assert concat["family-P3"] == concat["family-memory"] == "failed", out
        assert [c for c in checks if concat[c] == "failed"] == ["family-P3", "family-memory"], out
        assert all(static[c] == "passed" for c in checks[1:]), out
        assert "128 bytes pinned beyond the cache" in out, out


def test_own_family_recipe_runs_the_docs_command_and_its_own_tests(family_project):
    """Its CI recipe (workflow and tox.ini alike): the conformance command is the docs' first one with the
    CI's flags; its own tests (the caches, and the family checks through parametrize_with_checks) pass."""
    workflow, tox = (FAMILY_EXAMPLE / ".github" / "workflows" / "cpu.yml").read_text(), (FAMILY_EXAMPLE / "tox.ini").read_text()
    cmds = [line.split("run: ", 1)[1] for line in workflow.splitlines() if line.strip().startswith("- run: python -m pytest")]
    assert len(cmds) == 2 and all(c in tox for c in cmds), cmds
    assert cmds[0].startswith(family_docs_commands()[0][1] + " --strict-known-failures"), cmds[0]
    python, where, env, _ = family_project
    done = subprocess.run([str(python), *cmds[1].split()[1:], "-p", "no:cacheprovider"], cwd=where, capture_output=True,
                          text=True, timeout=HANG_S, env={**env, "CI": "true"})
    out = done.stdout + done.stderr
    assert done.returncode == 0 and re.search(r"\b\d+ passed\b", out) and "failed" not in out.split("passed")[-1], out
    assert family_row(out, "concat")["family-P3"] == "passed", out  # the family checks of its own test file ran
