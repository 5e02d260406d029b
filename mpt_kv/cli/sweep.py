"""`python -m mpt_kv sweep SPEC [SPEC ...]`: the conformance run over published releases of
optimum-habana, transformers and/or llm-foundry, one environment per release, merged into one table
(release x check: property/path), with the first and last release of each finding.

SPEC: `optimum-habana==1.12.1`, `transformers==4.55.4`, or a range (`optimum-habana>=1.7,<=1.21.2`):
every release `pip index versions` lists in it (with --per-minor: the newest patch of each minor).

For each release:
  pins   optimum-habana X: the transformers its own metadata requires (Requires-Dist of its wheel,
         fetched with `pip download --no-deps`): the newest release in that range, or its lower
         bound where the range is open-ended (1.7.x asks for >=4.32.0: the version it was written
         for; the newest transformers came years later). transformers X: X. Always torch==2.13.0
         (the CPU build) and the test tools pinned by constraints/hpu.txt.
  env    <envs>/<package>-<version>/: a venv layered on one shared base venv (torch and the test
         tools, installed once) by a .pth file, mpt-kv from this checkout by another; reused while
         its lock.json (python, the requested pins, the base) matches, else rebuilt.
  run    `python -m mpt_kv run --target optimum-habana|transformers --only-targets` in that env,
         CI=true, with --dtype and -k as given, under the per-release time limit (--timeout:
         install and run together). The transformers target reorders a beam cache as that
         release's own beam search does (`mpt_kv.targets.hf_generation`); the table lists the route
         each release took, from its run's description of the target.

Stored ceilings: they are keyed by target version, so another release has no entry. The runs
start in the release's env folder, where no ini file names `mpt_kv_require_ceilings` and no
`mpt_kv_ceilings/` exists, and without $MPT_KV_CEILINGS_DIR: the memory cases check the
analytic properties only (retained bytes = the KV cache exactly, bounded decode transients, no
leak), which is what differs between releases. The gate's own runs are unchanged.

--repros: instead of the conformance run, the family findings' standalone repros
(`mpt_kv.families.repros`, written once into a temporary folder) in each release's env: the
transformers scripts in transformers releases, the optimum-habana ones in optimum-habana releases
(with the transformers that release pins), all of a release's scripts in one interpreter (runpy,
SystemExit caught; this checkout taken off its path: the scripts never see mpt_kv). The table:
finding x release, 1 (the bug holds) / 0 (fixed) / 2 (the experiment cannot run there: the
script's last line below the table), and each finding's first and last release where it holds
and the first tried release after that where it is fixed (repros.md and repros.json in --out).

A release whose pins cannot be read or whose install fails, times out or writes no report says
why in its row; the exit status is 1 if any release did (0 when every release ran, whatever the
checks found: the table is the result).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mpt_kv import package_data, versions
from mpt_kv.errors import SweepError  # noqa: F401  (raised here; its home is errors.py)
from mpt_kv.outputs import dir_problem, mark_output, path_arg

PACKAGES = dict(sorted((b.requires[0], name) for name, b in versions.BUILTIN.items() if b.requires))  # package -> target
TORCH = "torch==2.13.0"  # the CPU build in the local store; never unpinned (a CUDA build is GBs)
# the checks the table needs, without the long variants (max-seq-len-2048, long generations, ...)
DEFAULT_K = "not max-seq-len and not long-generation and not bucket-128 and not head-dim and not graphs"
ORDER = ["error", "failed", "XPASS", "xfail", "unsupported", "passed", "skipped"]  # a cell shows its worst
FINDINGS = ("error", "failed", "XPASS")
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


# --- which releases ------------------------------------------------------------------------------

def parse_spec(text: str) -> tuple[str, SpecifierSet]:
    try:
        req = Requirement(text)
    except InvalidRequirement as e:  # argparse would say only "invalid parse_spec value"
        raise argparse.ArgumentTypeError(f"{text!r} is not a requirement ({str(e).splitlines()[0]}): give "
                                         f"{' or '.join(f'{p}==X' for p in PACKAGES)}, or a range (>=A,<=B)") from None
    if req.name not in PACKAGES:
        raise argparse.ArgumentTypeError(f"{text!r}: the sweep knows {', '.join(PACKAGES)}, not {req.name!r}")
    if not str(req.specifier):
        raise argparse.ArgumentTypeError(f"{text!r}: give a release or a range ({req.name}==X, {req.name}>=A,<=B)")
    return req.name, req.specifier


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


# --- pins: from the release's own metadata ---------------------------------------------------------

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


def download(release: Release, folder: Path) -> Path:
    """The release's wheel (or sdist), fetched once with pip download --no-deps."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{stem}-{release.version}{end}" for stem in {release.package, release.package.replace("-", "_")}
             for end in ("-", ".tar.gz")]

    def fetched():
        return [p for p in folder.iterdir() if p.name.lower().startswith(tuple(names))]

    if fetched():
        return fetched()[0]
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder),
                          f"{release.package}=={release.version}"], capture_output=True, text=True, timeout=600,
                         env=pip_env())
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


# --- environments -----------------------------------------------------------------------------------

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
    """A venv in folder/venv whose lock.json matches `lock`; built by `install(venv)` otherwise."""
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
    out = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SweepError(f"python -m venv failed: {last_line(out.stderr)}")
    install(venv, timeout)
    frozen = pip(venv, ["freeze", "--all"], 120, "pip freeze").split()
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

    written = ensure_venv(envs / "_base", lock, install, timeout)
    return envs / "_base" / "venv", digest(written)


def release_env(release: Release, envs: Path, base: tuple[Path, str], deadline: float,
                listing=published) -> tuple[Path, str]:
    """The release's env (built or reused) and its pins as a line ("transformers 4.40.2")."""
    base_venv, base_digest = base
    artifact = None
    if release.package == "optimum-habana":
        artifact = download(release, envs / "_downloads")
        requirements = [transformers_pin(release, artifact, listing), *runtime_requirements(artifact)]
    elif release.package == "llm-foundry":
        # its model code alone (mpt_kv/targets/foundry.py): the transformers it pins, the three small packages
        # its files import, and the release itself with --no-deps (not composer, streaming, mlflow, its torch)
        artifact = download(release, envs / "_downloads")
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

    written = ensure_venv(envs / release.slug, lock, install, deadline - time.monotonic())
    versions = dict(line.split("==", 1) for line in written["installed"] if "==" in line)
    pins = ", ".join(f"{n} {versions[n]}" for n in ("transformers", "tokenizers") if n in versions)
    return envs / release.slug / "venv", pins


# --- one release ------------------------------------------------------------------------------------

def run_release(release: Release, envs: Path, out: Path, base, timeout: float, run_args: list[str],
                listing=published) -> Row:
    start = time.monotonic()
    deadline = start + timeout
    row = Row(release, report=out / f"{release.slug}.json", log=out / f"{release.slug}.log")
    row.report.unlink(missing_ok=True)
    try:
        venv, row.pins = release_env(release, envs, base, deadline, listing)
    except SweepError as e:
        row.problem = f"install: {e}"
    except subprocess.TimeoutExpired as e:
        row.problem = f"install: timed out after {e.timeout:.0f} s"
    if row.problem is None:
        row.problem = run_conformance(release, venv, row, deadline, run_args)
    row.seconds = time.monotonic() - start
    return row


def run_conformance(release: Release, venv: Path, row: Row, deadline: float, run_args: list[str]) -> str | None:
    """The run in the release's env; None when it wrote its report, else why not."""
    cmd = [str(venv / "bin" / "python"), "-m", "mpt_kv", "run", "--target", PACKAGES[release.package],
           "--only-targets", "--report", str(row.report), "--no-mpt-kv-matrix", "-p", "mpt_kv.plugin",
           "-rfE", *run_args]
    # not the caller's: its ceilings folder, pytest options, path, or xdist worker (a sweep run from a test)
    env = {k: v for k, v in os.environ.items() if k not in ("MPT_KV_CEILINGS_DIR", "PYTEST_ADDOPTS", "PYTHONPATH")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["CI"] = "true"  # the small derandomized hypothesis profile: the same cases in every release
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return "timed out before the run (the install used the whole --timeout)"
    with open(row.log, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=venv.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"run: timed out after {remaining:.0f} s (--timeout)"
    if not row.report.is_file():
        return f"run: exit {proc.returncode}, no report written: {last_line(row.log.read_text())}"
    return target_build_problem(row.log.read_text(), PACKAGES[release.package])


def target_build_problem(log_text: str, target: str) -> str | None:
    """Why the target did not build, from the run's first lines (then every case errors with it)."""
    built = re.search(rf"^target {re.escape(target)}\s+does not build on \w+: (.*)$", log_text, re.M)
    return f"the target does not build: {built.group(1)[:300]}" if built else None


def reorder_route_of(row: Row) -> str | None:
    """How the release's beam search reorders the cache, as its run described its target (the
    transformers target follows its release's own route: `mpt_kv.targets.hf_generation`)."""
    from mpt_kv.cli.run import BEAM_REORDER

    if row.log is None or not row.log.is_file():
        return None
    target = PACKAGES[row.release.package]
    found = re.search(rf"^target {re.escape(target)}\s+ok [^\n]*?; {BEAM_REORDER} (.*)$", row.log.read_text(), re.M)
    return found.group(1).strip() if found else None


# --- the table --------------------------------------------------------------------------------------

def column_of(result: dict) -> str:
    """A result's column: its check id, memory configs folded into their path."""
    check = result.get("check") or "/".join(x for x in (result.get("property"), result.get("path")) if x)
    if result.get("property") == "memory":
        return "/".join(check.split("/")[:2])
    return check


def failure_lines(log_text: str) -> dict[str, str]:
    """nodeid -> the one-line message pytest's -rfE summary gives for it."""
    out = {}
    for line in log_text.splitlines():
        m = re.match(r"^(?:FAILED|ERROR) (\S+) - (.*)$", line)
        if m:
            out.setdefault(m.group(1), m.group(2))
    return out


def one_line(message: str) -> str:
    """The finding's summary: the exception's message without its class path and case context."""
    message = re.sub(r"^[\w.]+(Error|Failure|Exception|Unavailable): ", "", message)
    message = re.sub(r" \[target=.*$", "", message)
    return message[:220] + ("..." if len(message) > 220 else "")


def cells_of(row: Row) -> dict[str, tuple[str, str]]:
    """column -> (worst outcome, summary of its first failing result)."""
    data = json.loads(row.report.read_text())
    messages = failure_lines(row.log.read_text()) if row.log and row.log.is_file() else {}
    cells: dict[str, tuple[str, str]] = {}
    for r in data.get("results", []):
        if "property" not in r:
            continue
        col, outcome = column_of(r), r.get("outcome", "error")
        outcome = outcome if outcome in ORDER else "error"
        summary = one_line(messages.get(r.get("nodeid", ""), "")) if outcome in FINDINGS else ""
        if outcome in FINDINGS and not summary:
            summary = f"{outcome}: see {row.log.name if row.log else 'the log'} ({r.get('nodeid', '?')})"
        prev = cells.get(col)
        if prev is None or ORDER.index(outcome) < ORDER.index(prev[0]):
            cells[col] = (outcome, summary)
    return cells


def column_order(col: str) -> tuple:
    prop, _, path = col.partition("/")
    props = ["P0", "P1", "P2", "P3", "P4", "static-shape", "memory"]
    return (props.index(prop) if prop in props else len(props), prop, path)


@dataclasses.dataclass
class Finding:
    ident: str
    column: str
    outcome: str
    summary: str
    releases: list[Release]


def signature(summary: str) -> str:
    """What makes two releases' failures one finding: the message with its numbers left out (the
    same bug names other sizes and shapes in another release's run)."""
    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "#", summary)


def finding_key(package: str, column: str, outcome: str, summary: str) -> tuple:
    return package, column, outcome, signature(summary)


def findings_of(rows: list[Row], cells: dict) -> list[Finding]:
    """A finding: a column with the same bad outcome and message; its releases in order (first and last)."""
    found: dict[tuple, Finding] = {}
    for row in rows:
        for col, (outcome, summary) in sorted(cells.get(row.release, {}).items(), key=lambda kv: column_order(kv[0])):
            if outcome not in FINDINGS:
                continue
            key = finding_key(row.release.package, col, outcome, summary)
            if key not in found:
                found[key] = Finding("", col, outcome, summary, [])
            found[key].releases.append(row.release)
    out = sorted(found.values(), key=lambda f: (f.releases[0], column_order(f.column)))
    for i, f in enumerate(out, 1):
        f.ident = f"F{i}"
    return out


WORD = {"passed": "pass", "failed": "FAIL", "error": "error", "XPASS": "XPASS", "xfail": "xfail",
        "unsupported": "unsupported", "skipped": "skipped"}


def table_lines(rows: list[Row]) -> list[str]:
    """The markdown table: one row per release, one column per check; then the findings."""
    rows = sorted(rows, key=lambda r: r.release)
    cells = {r.release: cells_of(r) for r in rows if r.problem is None}
    findings = findings_of(rows, cells)
    ident = {finding_key(f.releases[0].package, f.column, f.outcome, f.summary): f.ident for f in findings}
    columns = sorted({c for cs in cells.values() for c in cs}, key=column_order)
    lines = []
    for package in sorted({r.release.package for r in rows}):
        lines += [f"### {package} (target `{PACKAGES[package]}`)", "",
                  "| release | pins | " + " | ".join(columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for row in (r for r in rows if r.release.package == package):
            if row.problem is not None:
                lines.append(f"| {row.release.version} | {row.pins or '-'} | " + f"**not run**: {row.problem}".replace("|", "/")
                             + " |" * len(columns))
                continue
            cs = cells[row.release]
            out = []
            for col in columns:
                outcome, summary = cs.get(col, ("", ""))
                word = WORD.get(outcome, "-")
                if outcome in FINDINGS:
                    word += f" {ident[finding_key(package, col, outcome, summary)]}"
                out.append(word)
            lines.append(f"| {row.release.version} | {row.pins} | " + " | ".join(out) + " |")
        lines.append("")
        routes = [(row.release.version, reorder_route_of(row)) for row in rows if row.release.package == package]
        if any(route for _, route in routes):
            lines += [f"Beam search's cache reorder in each {package} release (read from the release's own "
                      "generation code; its ops checks reorder that way):", "", "| release | reorders with |",
                      "|---|---|"]
            lines += [f"| {version} | {route or '-'} |" for version, route in routes]
            lines.append("")
    if findings:
        lines += ["### Findings", "", "| id | check | outcome | first | last | releases | summary (first release) |",
                  "|---|---|---|---|---|---|---|"]
        for f in findings:
            lines.append(f"| {f.ident} | {f.column} | {f.outcome} | {f.releases[0]} | {f.releases[-1]} | "
                         f"{len(f.releases)} | {f.summary.replace('|', '/')} |")
        lines.append("")
    return lines


# --- --repros: the findings' standalone repros in each release ---------------------------------------

HOLDS, FIXED, CANNOT = 1, 0, 2


def write_repro_scripts(folder: Path) -> dict[str, list[tuple[str, Path]]]:
    """The repros (`python -m mpt_kv findings --repro`) under folder: package -> [(slug, repro.py)]."""
    from mpt_kv.families import repros
    from mpt_kv.families.costs import known_entries
    from mpt_kv.families.findings import grouped

    made, _ = repros.write(folder, grouped(known_entries()))
    scripts: dict[str, list[tuple[str, Path]]] = {}
    for r in made:
        scripts.setdefault(repros.implementation(r.entries[0]), []).append((r.slug, folder / r.slug / "repro.py"))
    return scripts


def output_last_line(output: str) -> str:
    """A script's last line; where that only points at the traceback above ("see the error above",
    "the prefill above raised"), the exception's line with it."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    last = (lines or ["(no output)"])[-1]
    if "above" in last:
        raised = [ln for ln in lines[:-1] if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", ln)]
        if raised:
            last = f"{last.split(' (see')[0].split(': the')[0]}: {raised[-1]}"
    return re.sub(r" \(/[^)]*\)", "", last)[:200]  # no "(/the/env/.../__init__.py)": one note for every release


def note_id(n: int) -> str:
    """The n-th note's letters: a ... z, aa, ab, ..."""
    letters = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        letters = chr(ord("a") + r) + letters
    return letters


def run_repros(venv: Path, scripts: list[tuple[str, Path]], deadline: float) -> dict[str, tuple[int, str]]:
    """slug -> (exit status, last line) of the scripts, run in one interpreter of the release's env."""
    from mpt_kv.families import repros  # lazy: torch and the models only where this command needs them

    if not scripts:
        return {}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["OMP_NUM_THREADS"] = "1"
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise SweepError("timed out before the repros (the install used the whole --timeout)")
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c", repros.DRIVER, str(SOURCE),
                              *(str(path) for _, path in scripts)], capture_output=True, text=True,
                             cwd=scripts[0][1].parent.parent, env=env, timeout=remaining)
    except subprocess.TimeoutExpired as e:
        raise SweepError(f"repros: timed out after {e.timeout:.0f} s (--timeout)") from e
    try:
        report = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SweepError(f"repros: the driver exited {out.returncode} without its report: "
                         f"{last_line(out.stderr or out.stdout)}") from None
    if report["mpt_kv_modules"]:
        raise SweepError(f"repros: the scripts imported {', '.join(report['mpt_kv_modules'])}")
    by_path = report["results"]
    return {slug: (by_path[str(path)]["code"], output_last_line(by_path[str(path)]["output"]))
            for slug, path in scripts}


def run_release_repros(release: Release, envs: Path, base, timeout: float,
                       scripts: dict[str, list[tuple[str, Path]]], listing=published) -> Row:
    """The release's env (built or reused, as the conformance sweep's), then its package's repros."""
    start = time.monotonic()
    deadline = start + timeout
    row = Row(release)
    try:
        venv, row.pins = release_env(release, envs, base, deadline, listing)
        row.repros = run_repros(venv, scripts.get(release.package, []), deadline)
    except SweepError as e:
        row.problem = str(e) if str(e).startswith("repros:") else f"install: {e}"
    except subprocess.TimeoutExpired as e:
        row.problem = f"install: timed out after {e.timeout:.0f} s"
    row.seconds = time.monotonic() - start
    return row


def holds_range(codes: list[tuple[Release, int]]) -> tuple[Release | None, Release | None, Release | None]:
    """(first, last) release where the bug holds (status 1) among releases in order, and the first
    release after the last that ran it without the bug (0: fixed there); None where there is none.
    A 2 (cannot run) is neither."""
    held = [r for r, code in codes if code == HOLDS]
    if not held:
        return None, None, None
    after = [r for r, code in codes if code == FIXED and r > held[-1]]
    return held[0], held[-1], (after[0] if after else None)


def repro_table_lines(rows: list[Row]) -> list[str]:
    """Per package: finding x release (1 holds, 0 fixed, 2 cannot run, with a note), then each
    finding's first and last release where it holds and the first fixed after it."""
    rows = sorted(rows, key=lambda r: r.release)
    lines = []
    for package in sorted({r.release.package for r in rows}):
        mine = [r for r in rows if r.release.package == package]
        ran = [r for r in mine if r.problem is None]
        slugs = list(dict.fromkeys(s for r in ran for s in r.repros))
        notes: dict[str, str] = {}  # a 2's last line -> its note's letter
        lines += [f"### {package}", "",
                  "| finding | " + " | ".join(str(r.release.version) for r in mine)
                  + " | holds first | holds last | fixed in |",
                  "|---|" + "---|" * (len(mine) + 3)]
        for slug in slugs:
            cells, codes = [], []
            for r in mine:
                if r.problem is not None or slug not in r.repros:
                    cells.append("-")
                    continue
                code, last = r.repros[slug]
                code = code if code in (HOLDS, FIXED) else CANNOT
                codes.append((r.release, code))
                if code == CANNOT:
                    letter = notes.setdefault(last, note_id(len(notes)))
                    cells.append(f"2{letter}")
                else:
                    cells.append(str(code))
            first, last, fixed = holds_range(codes)
            ends = [str(x.version) if x else "-" for x in (first, last, fixed)]
            lines.append(f"| {slug} | " + " | ".join(cells) + " | " + " | ".join(ends) + " |")
        lines.append("")
        if notes:
            lines += ["Cannot run (2), the script's last line:", ""]
            lines += [f"- 2{letter}: {text}" for text, letter in notes.items()]
            lines.append("")
        for r in mine:
            lines.append(f"- {r.release}: " + (f"**not run**: {r.problem}" if r.problem else f"{r.pins}")
                         + f" ({r.seconds:.0f} s)")
        lines.append("")
    return lines


def main_repros(args, argv: list[str], releases: list[Release]) -> int:
    import tempfile

    started = time.monotonic()
    print(f"mpt-kv sweep --repros: {len(releases)} releases, -p {args.parallel}, --timeout {args.timeout:.0f} s, "
          f"envs {args.envs}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mpt-kv-repros-") as folder:
        try:
            scripts = write_repro_scripts(Path(folder))
        except ImportError as e:
            raise SystemExit(f"mpt-kv sweep --repros: writing the repros needs torch and transformers here: {e}")
        try:
            base = base_env(args.envs.resolve(), args.timeout)
        except SweepError as e:
            raise SystemExit(f"mpt-kv sweep: {e}")
        rows = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = [pool.submit(run_release_repros, r, args.envs.resolve(), base, args.timeout, scripts)
                       for r in releases]
            for future in concurrent.futures.as_completed(futures):
                row = future.result()
                rows.append(row)
                counts = {c: sum(1 for code, _ in (row.repros or {}).values() if (code if code in (0, 1) else 2) == c)
                          for c in (HOLDS, FIXED, CANNOT)}
                print(f"  {row.release}: {row.problem or 'ran: %d hold, %d fixed, %d cannot run' % tuple(counts.values())}"
                      f" ({row.pins or 'no env'}; {row.seconds:.0f} s)", flush=True)
    elapsed = time.monotonic() - started
    made = (f"Made by `python -m mpt_kv sweep {' '.join(argv)}` in {elapsed / 60:.1f} min "
            f"({time.strftime('%Y-%m-%d')}, -p {args.parallel}).")
    (args.out / "repros.json").write_text(json.dumps({"made": made, "rows": [
        {"package": r.release.package, "version": str(r.release.version), "pins": r.pins, "problem": r.problem,
         "seconds": round(r.seconds, 1), "repros": r.repros} for r in sorted(rows, key=lambda r: r.release)]},
        indent=1))
    lines = [made, "", *repro_table_lines(rows)]
    (args.out / "repros.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"table: {args.out / 'repros.md'}")
    return 1 if any(r.problem for r in rows) else 0


# --- the command ------------------------------------------------------------------------------------

def default_envs() -> Path:
    return Path(os.environ.get("MPT_KV_SWEEP_ENVS") or Path.home() / ".cache" / "mpt-kv" / "sweep-envs")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="*", type=parse_spec, metavar="SPEC",
                   help="optimum-habana==X, transformers==X, or a range (optimum-habana>=1.7,<=1.21.2)")
    p.add_argument("--per-minor", action="store_true", help="in a range, only the newest patch of each minor")
    p.add_argument("-p", "--parallel", type=int, default=1, help="releases at once (at most the cores; default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per release, install and run (default 1800)")
    p.add_argument("--envs", type=path_arg, default=default_envs(),
                   help="the environments' cache (default $MPT_KV_SWEEP_ENVS or ~/.cache/mpt-kv/sweep-envs)")
    p.add_argument("--out", type=path_arg, default=Path("reports/sweep"), help="reports, logs and table.md (default reports/sweep)")
    p.add_argument("--dtype", action="append", choices=["fp32", "bf16"], help="dtypes to run (default fp32)")
    p.add_argument("-k", dest="keyword", default=None, help=f"pytest -k of the runs (default: {DEFAULT_K!r})")
    p.add_argument("--render", action="store_true",
                   help="run nothing: make the table again from --out's rows.json, reports and logs")
    p.add_argument("--repros", action="store_true",
                   help="run the findings' standalone repros in each release instead of the conformance run: "
                        "finding x release, 1 holds / 0 fixed / 2 cannot run (repros.md in --out)")
    args = p.parse_args(argv)
    if args.repros and (args.render or args.dtype or args.keyword is not None):
        given = [o for o, v in (("--render", args.render), ("--dtype", args.dtype), ("-k", args.keyword is not None))
                 if v]
        p.error(f"--repros runs the findings' repros, not the conformance cases: not with {', '.join(given)}")
    if args.keyword is None:
        args.keyword = DEFAULT_K
    if args.render:
        return render(args.out)
    if not args.specs:
        p.error("name the releases: optimum-habana==X, transformers==X or a range")
    cores = os.cpu_count() or 1
    if not 1 <= args.parallel <= cores:
        p.error(f"-p {args.parallel}: between 1 and the {cores} cores")
    if not math.isfinite(args.timeout) or args.timeout <= 0:  # nan <= 0 is False: nan would pass a bare <= 0
        p.error(f"--timeout {args.timeout}: give a positive number of seconds, a finite one")
    for option, folder, command in (("--out", args.out, "sweep"), ("--envs", args.envs, None)):  # before any work
        problem = dir_problem(folder, command)
        if problem:
            p.error(f"{option} {folder}: {problem}")
    releases = expand(args.specs, args.per_minor)
    if args.repros:
        args.envs.mkdir(parents=True, exist_ok=True)
        args.out.mkdir(parents=True, exist_ok=True)
        mark_output(args.out, "sweep")
        return main_repros(args, argv, releases)
    run_args = [f"--dtype={d}" for d in (args.dtype or ["fp32"])] + (["-k", args.keyword] if args.keyword else [])
    args.envs.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    mark_output(args.out, "sweep")
    started = time.monotonic()
    print(f"mpt-kv sweep: {len(releases)} releases, -p {args.parallel}, --timeout {args.timeout:.0f} s, "
          f"envs {args.envs}", flush=True)
    try:
        base = base_env(args.envs.resolve(), args.timeout)
    except SweepError as e:
        raise SystemExit(f"mpt-kv sweep: {e}")
    rows = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {pool.submit(run_release, r, args.envs.resolve(), args.out.resolve(), base, args.timeout,
                               run_args): r for r in releases}
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            rows.append(row)
            print(f"  {row.release}: {row.problem or 'ran'} ({row.pins or 'no env'}; {row.seconds:.0f} s)", flush=True)
    elapsed = time.monotonic() - started
    made = (f"Made by `python -m mpt_kv sweep {' '.join(argv)}` in {elapsed / 60:.1f} min "
            f"({time.strftime('%Y-%m-%d')}, -p {args.parallel}).")
    (args.out / "rows.json").write_text(json.dumps({"made": made, "rows": [
        {"package": r.release.package, "version": str(r.release.version), "pins": r.pins, "problem": r.problem,
         "seconds": round(r.seconds, 1)} for r in rows]}, indent=1))
    return write_table(args.out, made, rows)


def write_table(out: Path, made: str, rows: list[Row]) -> int:
    lines = [made, "", *table_lines(rows)]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"table: {out / 'table.md'}")
    return 1 if any(r.problem for r in rows) else 0


ROW_FIELDS = ("package", "version", "pins", "problem", "seconds")  # what main writes of each row to rows.json


def check_rows(path: Path, data) -> None:
    """rows.json as main writes it: "made" and "rows", each row with ROW_FIELDS and a package the
    sweep knows; else one line naming the row and what it lacks (not a KeyError traceback)."""
    if not isinstance(data, dict) or "made" not in data or not isinstance(data.get("rows"), list):
        raise SystemExit(f"mpt-kv sweep --render: {path} has no 'made' and 'rows' list: not a sweep's rows.json")
    for i, r in enumerate(data["rows"]):
        missing = [k for k in ROW_FIELDS if not isinstance(r, dict) or k not in r]
        if missing:
            raise SystemExit(f"mpt-kv sweep --render: {path}: row {i} has no {', '.join(map(repr, missing))} "
                             f"(every row has {', '.join(ROW_FIELDS)})")
        if r["package"] not in PACKAGES:
            raise SystemExit(f"mpt-kv sweep --render: {path}: row {i} package {r['package']!r}: expected one of "
                             f"{', '.join(PACKAGES)}")


def render(out: Path) -> int:
    """The table again from a finished sweep's folder (rows.json, the reports and the logs)."""
    try:
        data = json.loads((out / "rows.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"mpt-kv sweep --render: cannot read {out / 'rows.json'}: {e}")
    check_rows(out / "rows.json", data)
    rows = []
    for r in data["rows"]:
        row = Row(Release(r["package"], Version(r["version"])), pins=r["pins"], problem=r["problem"],
                  seconds=r["seconds"])
        row.report, row.log = out / f"{row.release.slug}.json", out / f"{row.release.slug}.log"
        if row.problem is None and not row.report.is_file():
            row.problem = f"no report in {out}"
        if row.problem is None:
            row.problem = target_build_problem(row.log.read_text(), PACKAGES[row.release.package])
        rows.append(row)
    return write_table(out, data["made"], rows)
