"""mpt-kv as a release (docs/releasing.md): the sdist and the wheel that `python -m build` makes (the
run's one build, tests/conftest.py::wheel_venv), checked by `twine check --strict` and inspected; the
wheel installed into a fresh virtual environment and run outside the repository, opening no file of
the package but those of its one list (mpt_kv/package_data.py); the metadata an index shows; the
changelog's entry for this version."""

from __future__ import annotations

import email.parser
import hashlib
import base64
import json
import re
import shlex
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from mpt_kv import package_data
from plugin_testing import HANG_S

REPO = Path(__file__).resolve().parents[1]
VERSION = version("mpt-kv")  # this checkout's, as installed (pip install -e): the one a build makes
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
CHANGELOG = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")


def repository_files() -> list[str]:
    """The checkout's files as a fresh clone would hold them once committed (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\0")
    return sorted(name for name in out if name and (REPO / name).is_file())


def package_files() -> list[str]:
    """What the wheel must hold of the checkout: every file of the package, modules and data."""
    return [name for name in repository_files() if name.startswith("mpt_kv/")]


def shell_commands(doc: str) -> list[str]:
    """The commands of a doc's bash blocks."""
    blocks = re.findall(r"^\s*```bash\n(.*?)^\s*```", (REPO / doc).read_text(encoding="utf-8"), flags=re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


# --- the two artifacts ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # the run's one build (tests/conftest.py), shared with the downstream tests
def test_releasings_twine_check_passes_on_both_artifacts(wheel_venv):
    """docs/releasing.md's check, as written there, in the folder the README's build wrote dist/ in."""
    (command,) = [c for c in shell_commands("docs/releasing.md") if "twine check" in c]
    assert command == ".venv/bin/python -m twine check --strict dist/*", command
    built = wheel_venv.sdist.parent
    assert sorted(p.name for p in built.iterdir()) == sorted([wheel_venv.sdist.name, wheel_venv.wheel.name])
    done = subprocess.run([sys.executable, *command.split()[1:-1], *map(str, sorted(built.iterdir()))],
                          cwd=built.parent, capture_output=True, text=True, timeout=HANG_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and out.count("PASSED") == 2, out
    print(f"python -m build: {wheel_venv.build_seconds} s (sdist, then the wheel from it)")


@pytest.mark.slow
def test_the_wheel_is_built_from_the_sdist_and_the_sdist_holds_what_that_needs(wheel_venv):
    """pyproject, README, LICENSE, CHANGELOG and the whole package with its data; not the repository's
    tests (they need the whole clone: MANIFEST.in)."""
    log = wheel_venv.build_log.read_text()
    assert "* Building sdist..." in log and "* Building wheel from sdist" in log, log[-2000:]
    top = f"mpt_kv-{VERSION}"
    with tarfile.open(wheel_venv.sdist) as sdist:
        names = {name.removeprefix(top + "/") for name in sdist.getnames()}
        read = {name: sdist.extractfile(f"{top}/{name}").read() for name in ("LICENSE", "CHANGELOG.md", "README.md")}
    needed = {"pyproject.toml", "PKG-INFO", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in", *package_files()}
    assert not needed - names, f"the sdist lacks {sorted(needed - names)}"
    assert not [n for n in names if n.startswith("tests/")], "the sdist holds tests/: MANIFEST.in prunes them"
    assert all(read[name] == (REPO / name).read_bytes() for name in read)


@pytest.mark.slow
def test_the_wheel_holds_the_package_as_it_is_in_the_checkout(wheel_venv):
    """Every module and data file, byte for byte (its RECORD's hashes), nothing else of the package, no
    file of the clone around it (package_data.CHECKOUT), the license."""
    with zipfile.ZipFile(wheel_venv.wheel) as wheel:
        names = set(wheel.namelist())
        info = f"mpt_kv-{VERSION}.dist-info"
        record = {row.split(",")[0]: row.split(",")[1] for row in wheel.read(f"{info}/RECORD").decode().splitlines()}
        license_text = wheel.read(f"{info}/licenses/LICENSE")
    package = {n for n in names if not n.startswith(info + "/")}
    assert package == set(package_files()), (f"missing from the wheel: {sorted(set(package_files()) - package)}; "
                                             f"not in the checkout: {sorted(package - set(package_files()))}")
    for name in package:
        digest = base64.urlsafe_b64encode(hashlib.sha256((REPO / name).read_bytes()).digest()).rstrip(b"=").decode()
        assert record[name] == f"sha256={digest}", f"{name}: the wheel's copy is not the checkout's"
    assert license_text == (REPO / "LICENSE").read_bytes()
    clone_only = [str(p.relative_to(package_data.CHECKOUT_ROOT)) for p in package_data.CHECKOUT]
    assert not set(clone_only) & names, clone_only


@pytest.mark.slow  # about 5 s
def test_releasings_install_check_runs_the_shipped_suite_from_the_wheel(wheel_venv, tmp_path):
    """docs/releasing.md's last step, its run of the shipped suite from a folder outside the repository,
    with the wheel's mpt-kv (the index's install before it gives the same wheel, once published)."""
    (command,) = [c for c in shell_commands("docs/releasing.md") if "--pyargs" in c]
    argv = shlex.split(command.split("&&", 1)[1])  # after `cd /tmp &&`: any folder outside a clone
    assert argv[0] == "/tmp/mpt-kv-installed/bin/python" and argv[1:4] == ["-m", "pytest", "--pyargs"], argv
    done = subprocess.run([str(wheel_venv.python), *argv[1:], "-p", "no:cacheprovider"], cwd=tmp_path,
                          env=wheel_venv.env(CI="true"), capture_output=True, text=True, timeout=HANG_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and re.search(r"\d+ passed", out), out[-3000:]


# Run in the wheel's venv: every file the installed package opens while its openers run (an audit
# hook on "open"), less the modules imported, beside what its one list names.
PROBE = """
import contextlib, io, json, os, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(os.fsdecode(args[0]))
                 if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None)
from mpt_kv import package_data
from mpt_kv.checks import reach
from mpt_kv.findings import entries as known_failures
from mpt_kv.cli import findings
root = str(package_data.PACKAGE_ROOT)
with contextlib.redirect_stdout(io.StringIO()):
    codes = [findings.main(["--repro", sys.argv[1]]), findings.main(["--configs"])]
known_failures.load()
reach.load_reference_model()
from mpt_kv.catalogue import gate_profile
gate_profile.load()
modules = {os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
data = {os.path.realpath(p) for p in opened if not p.endswith(".pyc")} - modules
print(json.dumps({"codes": codes, "root": root, "opened": sorted(os.path.relpath(p, root) for p in data
                                                                  if p.startswith(root + os.sep)),
                  "listed": sorted(str(p.relative_to(package_data.PACKAGE_ROOT)) for p in package_data.files())}))
"""


@pytest.mark.slow  # about 4 s: the findings' repros and configs, from the installed wheel
def test_the_installed_wheel_opens_the_files_of_its_list_and_no_other(wheel_venv, tmp_path):
    """The openers run from the wheel's copy, outside the repository (`findings --repro` writes every
    standalone repro from the templates and the kept scripts; `findings --configs` reads every real
    config; the known failures, the reach table's reference model and the gate profile load): each file of the list is
    in the wheel and opened, and no other file of the package is."""
    done = subprocess.run([str(wheel_venv.python), "-c", PROBE, str(tmp_path / "repros")], cwd=tmp_path,
                          env=wheel_venv.env(), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["root"] == str(wheel_venv.purelib / "mpt_kv"), got["root"]  # the wheel's copy, not the checkout
    assert got["codes"] == [0, 0]
    here = sorted(str(p.relative_to(package_data.PACKAGE_ROOT)) for p in package_data.files())
    listed, opened = set(got["listed"]), set(got["opened"])
    assert got["listed"] == here, f"the installed wheel lacks files of the list: {sorted(set(here) - listed)}"
    assert opened <= listed, f"opened, not in mpt_kv/package_data.py: {sorted(opened - listed)}"
    assert opened == listed, f"listed, never opened: {sorted(listed - opened)}"


# a module of the package that names its own location for what it is not opening: why
OWN_LOCATION_ALLOWED = {
    "mpt_kv/package_data.py": "the one list",
    "mpt_kv/checks/static_shape.py": "which stack frames are its own (a host sync is reported at the caller's line)",
}


def test_no_module_finds_a_file_by_its_own_location_but_the_list():
    """A module that builds a path from its own `__file__` or `importlib.resources` opens a file the
    list does not name, and a move leaves it behind. (The kept repro scripts are templates, not modules of
    the package: they run standalone, against another install.)"""
    own = re.compile(r"(?<![\w.])__file__|importlib\.resources|from importlib import resources|pkgutil\.get_data")
    found = [f"{name}:{n}: {line.strip()}" for name in package_files() if name.endswith(".py")
             and name not in OWN_LOCATION_ALLOWED
             for n, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), 1)
             if own.search(line.split("#", 1)[0])]
    assert not found, "\n".join(found)


# --- what an index shows ---------------------------------------------------------------------------------------------

def test_the_metadata_an_index_shows():
    """Classifiers (each one the index knows; Framework :: Pytest; the Python versions tested, inside
    requires-python), the license as an SPDX expression with its file, keywords, authors."""
    import trove_classifiers
    from packaging.specifiers import SpecifierSet

    classifiers = PROJECT["classifiers"]
    assert not [c for c in classifiers if c not in trove_classifiers.classifiers], classifiers
    assert "Framework :: Pytest" in classifiers and "Topic :: Software Development :: Testing" in classifiers
    pythons = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert pythons and all(SpecifierSet(PROJECT["requires-python"]).contains(p + ".0") for p in pythons), pythons
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text() and "Version 2.0, January 2004" in (REPO / "LICENSE").read_text()
    assert not [c for c in classifiers if c.startswith("License ::")]  # the expression replaces them (PEP 639)
    assert PROJECT["keywords"] and PROJECT["authors"]


@pytest.mark.slow
def test_the_wheels_metadata_carries_the_urls_and_classifiers(wheel_venv):
    with zipfile.ZipFile(wheel_venv.wheel) as wheel:
        meta = email.parser.Parser().parsestr(wheel.read(f"mpt_kv-{VERSION}.dist-info/METADATA").decode())
    assert meta["Name"] == "mpt-kv" and meta["Version"] == VERSION and meta["License-Expression"] == "Apache-2.0"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert sorted(meta.get_all("Classifier")) == sorted(PROJECT["classifiers"])
    assert {u.split(", ", 1)[0].lower() for u in meta.get_all("Project-URL")} == {k.lower() for k in PROJECT["urls"]}


def test_every_url_is_on_the_one_repository_base_and_names_a_file_that_exists():
    """pyproject's [project.urls] and CHANGELOG.md's release links: one base to change when the public
    home moves; a URL into the tree names a file this checkout has."""
    base = PROJECT["urls"]["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", base), base
    for label, url in PROJECT["urls"].items():
        assert url.startswith(base), f"[project.urls] {label}: {url} is not on {base}"
        path = url.removeprefix(base).removeprefix("/blob/main/")
        assert url == base or (REPO / path).is_file(), f"[project.urls] {label}: {url} names no file of the repository"
    links = re.findall(r"^\[([^\]]+)\]: (\S+)$", CHANGELOG, flags=re.M)
    assert links and all(url.startswith(base + "/") for _, url in links), links


# --- the changelog ---------------------------------------------------------------------------------------------------

TYPES = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")  # Keep a Changelog's, in its order


def releases() -> list[tuple[str, str | None, list[str]]]:
    """(version or 'Unreleased', date, its ### headings) per `## [...]` heading, in the file's order."""
    out = []
    for line in CHANGELOG.splitlines():
        if line.startswith("## "):
            found = re.fullmatch(r"## \[(Unreleased|\d+\.\d+\.\d+)\](?: - (\d{4}-\d{2}-\d{2}))?", line)
            assert found, f"CHANGELOG.md: {line!r} is not '## [X.Y.Z] - YYYY-MM-DD' or '## [Unreleased]'"
            out.append((found.group(1), found.group(2), []))
        elif line.startswith("#") and not line.startswith("# "):
            assert line.startswith("### ") and out, f"CHANGELOG.md: {line!r}: a release has ### headings only"
            out[-1][2].append(line[4:])
    return out


def test_the_current_version_has_a_changelog_entry_in_keep_a_changelog_form():
    from packaging.version import Version

    assert VERSION == PROJECT["version"], f"installed mpt-kv {VERSION}, pyproject.toml {PROJECT['version']}: pip install -e ."
    found = releases()
    assert found[0][:2] == ("Unreleased", None), "CHANGELOG.md starts with ## [Unreleased]"
    dated = found[1:]
    assert all(date for _, date, _ in dated), [v for v, date, _ in dated if not date]
    numbers = [Version(v) for v, _, _ in dated]
    assert numbers == sorted(numbers, reverse=True) and len(set(numbers)) == len(numbers), "newest first, once each"
    assert [date for _, date, _ in dated] == sorted((date for _, date, _ in dated), reverse=True)
    assert dated and dated[0][0] == VERSION, f"mpt-kv {VERSION} has no entry: CHANGELOG.md's newest is {dated[0][0]}"
    for name, _, headings in found:
        assert all(h in TYPES for h in headings), f"{name}: {headings}: Keep a Changelog's are {TYPES}"
        assert headings == sorted(set(headings), key=TYPES.index), f"{name}: {headings}: once each, in {TYPES}' order"
    entry = CHANGELOG.split(f"## [{VERSION}]")[1].split("\n## ")[0]
    assert "**Upgrading**" in entry, "a release says first what a project must do"
    linked = dict(re.findall(r"^\[([^\]]+)\]: (\S+)$", CHANGELOG, flags=re.M))
    assert [v for v, _, _ in found] == list(linked), f"one link per release, in order: {list(linked)}"


def known_failure_ids() -> dict[str, str]:
    """{id: which file} for every shipped known failure: an MPT target entry's `repro`; a family
    finding's repro folder (its entries grouped as `findings --repro` groups them)."""
    from mpt_kv.findings import repros
    from mpt_kv.findings.entries import raw_entries
    from mpt_kv.findings.grouping import grouped

    ids = {}
    for entry in json.loads(package_data.MPT_KNOWN_FAILURES.read_text()):
        assert entry.get("repro"), f"an MPT target entry without its repro has no id: {entry}"
        ids[entry["repro"]] = "mpt_kv/findings/known_failures.json"
    for entries in grouped(raw_entries()):  # its repro's folder, or the one the index names it by until it has one
        ids.setdefault(repros.finding_id(entries), "mpt_kv/findings/family_known_failures.json")
    return ids


def test_every_shipped_known_failure_is_named_in_the_changelog():
    """A known failure added (or its repro renamed) changes downstream verdicts: the changelog names it
    by its id, under the release that ships it (docs/releasing.md)."""
    ids = known_failure_ids()
    assert len(ids) >= 80, len(ids)
    named = set(re.findall(r"`([a-z0-9.-]+)`", CHANGELOG))
    missing = sorted(f"{i} ({where})" for i, where in ids.items() if i not in named)
    assert not missing, "known failures the changelog does not name: " + ", ".join(missing)


def test_every_wheel_name_and_pin_in_the_repository_names_this_version():
    """docs/releasing.md step 2: the README's install, the examples' workflows, the docs (the changelog
    keeps its history)."""
    wrong = []
    for name in repository_files():
        if name == "CHANGELOG.md" or not name.endswith((".md", ".yml", ".yaml", ".toml", ".ini", ".txt", ".py")):
            continue
        text = (REPO / name).read_text(encoding="utf-8", errors="replace")
        for found in re.finditer(r"mpt_kv-(\d[\w.]*)-py3-none-any\.whl|mpt-kv(?:~=|==)(\d[\w.]*)", text):
            if (found.group(1) or found.group(2)) != VERSION:
                wrong.append(f"{name}: {found.group(0)}")
    assert not wrong, f"not {VERSION}: {wrong}"
