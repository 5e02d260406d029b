"""Published releases and the environments both sweeps run them in (`python -m mpt_kv sweep`: the
conformance run per release, `mpt_kv.cli.sweep`; the findings' repros per release,
`mpt_kv.findings.sweep`).

    releases = expand([("optimum-habana", SpecifierSet(">=1.7,<=1.21.2"))], per_minor=True)
    base = base_env(envs, timeout)                       # torch and the test tools, installed once
    venv, pins = release_env(release, envs, base, deadline)
    rows = over_releases(releases, parallel, one_release, report)

Which releases: an exact `==X` as given, a range from `pip index versions`. Pins: optimum-habana X
and llm-foundry X run with the transformers their own metadata requires (Requires-Dist of the wheel,
fetched with `pip download --no-deps`): the newest release in that range, or its lower bound where
the range is open-ended; transformers X with X. Always torch==2.13.0 (the CPU build) and the test
tools pinned by constraints/hpu.txt. An env: <envs>/<package>-<version>-<checkout>/, a venv layered on
one shared base venv by a .pth file, mpt-kv from this checkout by another (<checkout>: a digest of its
path, so two checkouts sharing the envs folder never rebuild each other's env under a running sweep);
reused while its lock.json (python, the requested pins, the base) matches, else rebuilt, under a file
lock beside it (two sweeps of one checkout build it once). A release whose pins cannot be read or
whose install fails or times out is a `SweepError` saying why: its row of the sweep's table.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from filelock import FileLock  # a dependency of torch: present wherever mpt-kv runs
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mpt_kv import package_data, versions
from mpt_kv.errors import SweepError


PACKAGES = dict(sorted((b.requires[0], name) for name, b in versions.BUILTIN.items() if b.requires))  # package -> target

TORCH = "torch==2.13.0"  # the CPU build in the local store; never unpinned (a CUDA build is GBs)

SOURCE = package_data.CHECKOUT_ROOT  # the checkout whose mpt-kv every env runs


@dataclasses.dataclass(frozen=True, order=True)
class Release:
    package: str
    version: Version

    def __str__(self):
        return f"{self.package} {self.version}"

    @property
    def slug(self) -> str:
        return f"{self.package}-{self.version}"


@dataclasses.dataclass
class Row:
    release: Release
    pins: str = ""                 # what the env holds: "transformers 4.40.2"
    problem: str | None = None     # why the release has no results (install, timeout, no report)
    report: Path | None = None
    log: Path | None = None
    seconds: float = 0.0
    repros: dict | None = None     # --repros: slug -> (exit status, the script's last line)


@functools.lru_cache(maxsize=None)
def published(package: str) -> list[Version]:
    """The package's releases as pip lists them (`pip index versions`), oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                         text=True, timeout=300, env=pip_env())
    m = re.search(r"Available versions: (.*)", out.stdout)
    if not m:
        raise SystemExit(f"mpt-kv sweep: pip index versions {package} listed nothing: {out.stderr.strip()[-500:]}")
    return sorted(Version(v.strip()) for v in m.group(1).split(","))


def expand(specs: list[tuple[str, SpecifierSet]], per_minor: bool, listing=published) -> list[Release]:
    """The releases the specs name: an exact `==X` as given, a range from the package's listing."""
    out = set()
    for package, spec in specs:
        exact = [s.version for s in spec if s.operator in ("==", "===") and "*" not in s.version]
        if len(spec) == 1 and exact:
            out.add(Release(package, Version(exact[0])))
            continue
        chosen = [v for v in listing(package) if v in spec and not v.is_prerelease]
        if per_minor:
            newest = {}
            for v in chosen:
                newest[(v.major, v.minor)] = max(v, newest.get((v.major, v.minor), v))
            chosen = list(newest.values())
        if not chosen:
            raise SystemExit(f"mpt-kv sweep: no published {package} release in {spec}")
        out.update(Release(package, v) for v in chosen)
    return sorted(out)


def metadata_text(path: Path) -> str:
    """METADATA of a wheel or PKG-INFO of an sdist."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode()
    with tarfile.open(path) as t:
        member = next(m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
        return t.extractfile(member).read().decode()


def requirement_of(metadata: str, name: str) -> Requirement | None:
    """The release's own Requires-Dist on `name` (not one behind an extra)."""
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.name.lower() == name and not (req.marker and "extra" in str(req.marker)):
                return req
    return None


def download(release: Release, folder: Path, timeout: float = 600) -> Path:
    """The release's wheel (or sdist), fetched once with pip download --no-deps, within `timeout` seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{stem}-{release.version}{end}" for stem in {release.package, release.package.replace("-", "_")}
             for end in ("-", ".tar.gz")]

    def fetched():
        return [p for p in folder.iterdir() if p.name.lower().startswith(tuple(names))]

    if fetched():
        return fetched()[0]
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder),
                          f"{release.package}=={release.version}"], capture_output=True, text=True,
                         timeout=max(1.0, timeout), env=pip_env())
    found = fetched()
    if out.returncode != 0 or not found:
        raise SweepError(f"pip download --no-deps {release.package}=={release.version} failed: "
                         f"{last_line(out.stderr or out.stdout)}")
    return found[0]


def transformers_pin(release: Release, artifact: Path, listing=published) -> str:
    """The transformers an optimum-habana or llm-foundry release runs with, from its Requires-Dist."""
    req = requirement_of(metadata_text(artifact), "transformers")
    if req is None:
        raise SweepError(f"{artifact.name} has no Requires-Dist on transformers")
    spec = req.specifier
    if not any(s.operator in ("<", "<=", "==", "~=") for s in spec):
        lower = [s.version for s in spec if s.operator in (">=",)]
        if not lower:
            raise SweepError(f"{artifact.name} requires transformers {spec or '(any)'}: no bound to pin from")
        return f"transformers=={lower[0]}"
    matching = [v for v in listing("transformers") if v in spec and not v.is_prerelease]
    if not matching:
        raise SweepError(f"{artifact.name} requires transformers {spec}: no published release matches")
    return f"transformers=={max(matching)}"


# what llm-foundry's model files import besides torch and transformers (the lock of tox -e foundry)
FOUNDRY_MODEL_IMPORTS = ("einops==0.8.2", "catalogue==2.0.10", "tabulate==0.10.0")

RUNTIME = ("optimum", "accelerate")  # what the ports import besides transformers (optimum.utils, accelerate)


def runtime_requirements(artifact: Path) -> list[str]:
    """The release's own Requires-Dist on optimum and accelerate (its ports import them), as it states
    them: pip resolves them next to the transformers pin. Not its heavy extras' pins (diffusers,
    sentence-transformers): no MPT-family code imports them."""
    text = metadata_text(artifact)
    reqs = [requirement_of(text, name) for name in RUNTIME]
    return [f"{req.name}{req.specifier}" for req in reqs if req is not None]


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and "is ignored" not in ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1][:300]


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python*/site-packages"))


def pip_env() -> dict:
    """The environment of the sweep's pip calls: our constraints file pins, not the caller's
    (tox sets PIP_CONSTRAINT to its own lock, which pins another transformers)."""
    return {k: v for k, v in os.environ.items() if k not in ("PIP_CONSTRAINT", "PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}


def pip(venv: Path, args: list[str], timeout: float, what: str) -> str:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True,
                             timeout=max(1.0, timeout), env=pip_env())
    except subprocess.TimeoutExpired as e:
        raise SweepError(f"{what}: timed out after {e.timeout:.0f} s") from e
    if out.returncode != 0:
        raise SweepError(f"{what} failed: {last_line(out.stderr or out.stdout)}")
    return out.stdout


def constraints_file(envs: Path) -> Path:
    """torch==2.13.0 and the test tools' pins (constraints/hpu.txt of this checkout)."""
    tools = package_data.TEST_TOOLS_LOCK
    if not tools.is_file():
        raise SystemExit(f"mpt-kv sweep: {tools} is missing: the sweep runs from an mpt-kv checkout")
    path = envs / "constraints.txt"
    path.write_text(f"{TORCH}\n{tools.read_text()}")
    return path


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def ensure_venv(folder: Path, lock: dict, install, timeout: float) -> dict:
    """A venv in folder/venv whose lock.json matches `lock`; built by `install(venv)` otherwise, while
    holding `<folder>.lock` (another process of the same request waits, then reuses what it built)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        return _ensure_venv(folder, lock, install, timeout)


def _ensure_venv(folder: Path, lock: dict, install, timeout: float) -> dict:
    venv, lock_file = folder / "venv", folder / "lock.json"
    if lock_file.is_file() and (venv / "bin" / "python").exists():
        try:
            old = json.loads(lock_file.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("request") == lock:
            return old
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # every step within the caller's limit (the sweep's --timeout): no fixed limit of its own, which a loaded
    # machine can pass while the release's time is not spent
    deadline = time.monotonic() + timeout
    try:
        out = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True,
                             timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired as e:
        raise SweepError(f"python -m venv: timed out after {e.timeout:.0f} s") from e
    if out.returncode != 0:
        raise SweepError(f"python -m venv failed: {last_line(out.stderr)}")
    install(venv, deadline - time.monotonic())
    frozen = pip(venv, ["freeze", "--all"], deadline - time.monotonic(), "pip freeze").split()
    written = {"request": lock, "installed": frozen}
    lock_file.write_text(json.dumps(written, indent=1))
    return written


def base_env(envs: Path, timeout: float) -> tuple[Path, str]:
    """The shared layer: torch 2.13.0 and the test tools, installed once."""
    constraints = constraints_file(envs)
    lock = {"python": sys.version, "constraints": constraints.read_text()}

    def install(venv, t):
        pip(venv, ["install", "-q", "--no-compile", "-c", str(constraints), TORCH, "pytest", "hypothesis",
                   "pytest-xdist", "pytest-benchmark", "packaging"], t, f"the base env ({TORCH} and the test tools)")

    folder = envs / f"_base-{digest(lock)[:8]}"  # one per python and constraints: never rebuilt under another's run
    written = ensure_venv(folder, lock, install, timeout)
    return folder / "venv", digest(written)


def release_env(release: Release, envs: Path, base: tuple[Path, str], deadline: float,
                listing=published) -> tuple[Path, str]:
    """The release's env (built or reused) and its pins as a line ("transformers 4.40.2")."""
    base_venv, base_digest = base
    artifact = None
    if release.package == "optimum-habana":
        artifact = download(release, envs / "_downloads", deadline - time.monotonic())
        requirements = [transformers_pin(release, artifact, listing), *runtime_requirements(artifact)]
    elif release.package == "llm-foundry":
        # its model code alone (mpt_kv/targets/foundry.py): the transformers it pins, the three small packages
        # its files import, and the release itself with --no-deps (not composer, streaming, mlflow, its torch)
        artifact = download(release, envs / "_downloads", deadline - time.monotonic())
        requirements = [transformers_pin(release, artifact, listing), *FOUNDRY_MODEL_IMPORTS]
    else:
        requirements = [f"transformers=={release.version}"]
    lock = {"python": sys.version, "requirements": requirements, "artifact": artifact.name if artifact else None,
            "base": base_digest, "source": str(SOURCE)}

    def install(venv, t):
        sp = site_packages(venv)
        (sp / "_mpt_kv_base.pth").write_text(f"{site_packages(base_venv)}\n")  # torch, pytest: shared
        (sp / "_mpt_kv_source.pth").write_text(f"{SOURCE}\n")  # mpt-kv from this checkout, no build
        pip(venv, ["install", "-q", "--no-compile", "-c", str(envs / "constraints.txt"), *requirements],
            deadline - time.monotonic(), f"pip install {' '.join(requirements)}")
        if artifact is not None:
            pip(venv, ["install", "-q", "--no-compile", "--no-deps", str(artifact)], deadline - time.monotonic(),
                f"pip install --no-deps {artifact.name}")

    folder = envs / f"{release.slug}-{digest(str(SOURCE))[:8]}"  # this checkout's own env of the release
    written = ensure_venv(folder, lock, install, deadline - time.monotonic())
    versions = dict(line.split("==", 1) for line in written["installed"] if "==" in line)
    pins = ", ".join(f"{n} {versions[n]}" for n in ("transformers", "tokenizers") if n in versions)
    return folder / "venv", pins


# --- running the releases --------------------------------------------------------------------------

def run_env(**more: str) -> dict:
    """The environment of a run in a release's env: not the caller's pytest options, path or xdist
    worker (a sweep run from a test), plus `more`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTHONPATH")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    return {**env, **more}


def over_releases(releases: list[Release], parallel: int, one: Callable[[Release], Row],
                  report: Callable[[Row], str]) -> list[Row]:
    """`one(release)` for every release, `parallel` at once, each row printed as `report(row)` says
    when it finishes; the rows in the order they finished."""
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        for future in concurrent.futures.as_completed([pool.submit(one, r) for r in releases]):
            row = future.result()
            rows.append(row)
            print(f"  {row.release}: {report(row)} ({row.pins or 'no env'}; {row.seconds:.0f} s)", flush=True)
    return rows


def made_line(argv: list[str], started: float, parallel: int) -> str:
    """What a sweep's table says it was made by."""
    elapsed = time.monotonic() - started
    return (f"Made by `python -m mpt_kv sweep {' '.join(argv)}` in {elapsed / 60:.1f} min "
            f"({time.strftime('%Y-%m-%d')}, -p {parallel}).")
