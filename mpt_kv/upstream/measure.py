"""A run under coverage.py, and its summary: which lines and branches of the selected upstream functions it
executed (selection.py), per function, with the reason for each function it never entered (source.py).

    measurement = Measurement()          # coverage.py started in this process; every Python subprocess
    measurement.start()                  # started from now on (xdist's workers) measures itself too
    ... the run ...
    measurement.stop()                   # saved and combined: one coverage.py data set
    summary = summarize(measurement.coverage, implementations, profile)

coverage.py measures only the selected upstream files (its `include`), with branches; each process writes
its own data file into a temporary folder (`parallel`), Python subprocesses start measuring through
coverage.py's `.pth` file and the environment variable its `patch = subprocess` sets, and `patch = _exit`
saves a process that leaves through `os._exit`. The summary is analysed here, where the upstream files are
installed; it holds figures and reasons only, so the tables of several environments are made anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from mpt_kv.upstream import selection as S
from mpt_kv.upstream.source import NEEDS_HPU, NOT_DRIVEN, Reason, SourceFile

FORMAT = "mpt-kv upstream coverage 1"  # a summary's "format": what `python -m mpt_kv coverage` reads
INCLUDE_MODEL_FILES = "*/transformers/models/*/modeling_*.py"
INCLUDE_PORTS = "*/optimum/habana/transformers/models/*/modeling_*.py"


def include_patterns() -> list[str]:
    """coverage.py's `include`: the files SOURCES may select (no other file's lines are recorded or analysed;
    the run's cost is the tracer's, whatever it records: docs/cost.md)."""
    special = {S.MODEL_FILES: INCLUDE_MODEL_FILES, S.PORTS: INCLUDE_PORTS}
    return sorted({special.get(s.path, f"*/{s.path}") for s in S.SOURCES})


class Measurement:
    """coverage.py over this process and the Python processes it starts, into a temporary folder."""

    def __init__(self):
        import coverage  # lazy: a dev dependency (pyproject's extras), needed only where a run is measured

        self.folder = Path(tempfile.mkdtemp(prefix="mpt-kv-coverage-"))
        rc = self.folder / "coveragerc"
        include = "".join(f"\n    {p}" for p in include_patterns())
        # this process measures little itself (xdist's workers run the cases): no warning that it collected nothing
        rc.write_text(f"[run]\nbranch = True\nparallel = True\npatch =\n    subprocess\n    _exit\n"
                      f"disable_warnings = no-data-collected\ndata_file = {self.folder / '.coverage'}\n"
                      f"include ={include}\n", encoding="utf-8")
        self.coverage = coverage.Coverage(config_file=str(rc))
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.time()
        self.coverage.start()

    def stop(self) -> None:
        """Stop measuring, and combine this process's data with its subprocesses' (each saved at its exit)."""
        self.coverage.stop()
        self.coverage.save()
        os.environ.pop("COVERAGE_PROCESS_CONFIG", None)  # later subprocesses of this process are not measured
        self.coverage.combine([str(self.folder)])
        self.coverage.save()

    def keep(self, path: Path) -> None:
        """Copy the combined data (a coverage.py data file: `coverage html --data-file PATH`, `python -m mpt_kv
        coverage --data PATH`) to `path`."""
        import coverage

        kept = coverage.CoverageData(basename=str(path))  # one file, not a parallel one with a suffix
        kept.update(self.coverage.get_data())
        kept.write()

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def data_path(summary: Path) -> Path:
    """Where `run --coverage SUMMARY` keeps the run's coverage.py data: beside it, SUMMARY with `.coverage` for `.json`."""
    return summary.with_suffix(".coverage") if summary.suffix != ".coverage" else summary.with_name(summary.name + ".data")


def what_ran(report: Path, since: float | None = None) -> tuple[list[str], str | None]:
    """(the implementations, the hypothesis profile) of a run, from its JSON report (`--mpt-kv-report`): a family
    case names its implementation, an MPT target's case is its target's own. A report older than `since` (an earlier
    run's, where this one wrote none) says nothing: ([], None)."""
    if not report.is_file() or (since is not None and report.stat().st_mtime < since):
        return [], None
    ran = json.loads(report.read_text(encoding="utf-8"))
    implementations = {r.get("implementation") or r["target"].split("/")[0] for r in ran.get("results", [])}
    return sorted(implementations), ran.get("hypothesis_profile")


def installed_file(relpath: str) -> Path | None:
    """`relpath` (transformers/cache_utils.py) under the folder that holds its top-level package, where installed."""
    top = relpath.split("/", 1)[0]
    loaded = sys.modules.get(top)  # a package registered bare (optimum.habana's, llmfoundry's loaders) has no spec
    folders = list(getattr(loaded, "__path__", None) or [])
    if not folders:
        spec = importlib.util.find_spec(top)
        folders = list(spec.submodule_search_locations or []) if spec else []
    return next((p for f in folders if (p := Path(f).parent / relpath).is_file()), None)


def module_relpath(module: str) -> str:
    return module.replace(".", "/") + ".py"


def release(distribution: str) -> str | None:
    from mpt_kv.versions import installed

    version = installed(distribution)
    return f"{distribution} {version}" if version else None


def selected_files(implementations) -> list[dict]:
    """The files SOURCES selects for these implementations, where installed: {source, path (relative), file
    (installed), release, note (why the file cannot run off an HPU, from the family registry)}."""
    out = []
    for source in S.SOURCES:
        name = release(source.distribution)
        if source.implementation not in implementations or name is None:
            continue
        for relpath, note in expand(source):
            file = installed_file(relpath)
            if file is not None:
                out.append({"source": source, "path": relpath, "file": file, "release": name, "note": note})
    return out


def expand(source: S.Source) -> list[tuple[str, str | None]]:
    """(relative path, note) of each file of a Source: MODEL_FILES and PORTS are each family's of the registry."""
    if source.path not in (S.MODEL_FILES, S.PORTS):
        return [(source.path, None)]
    from mpt_kv.families import FAMILIES  # lazy: the registry imports torch

    out = {}
    for family in FAMILIES.values():
        if family.gaudi is None or (source.path == S.MODEL_FILES and family.remote_code):
            continue  # a remote-code family has no transformers implementation (its port is its model and oracle)
        if source.path == S.PORTS:
            out.setdefault(module_relpath(family.gaudi.module), family.gaudi.needs_hpu)
        else:
            out.setdefault(module_relpath(family.gaudi.hf_module), None)
    return list(out.items())


def summarize(cov, implementations, profile: str | None) -> dict:
    """The summary of a measured run (a coverage.Coverage with its data loaded) for the implementations its
    cases ran: per selected file, per selected function, the lines and branches executed and the reason
    where it was never entered."""
    files = selected_files(implementations)
    report = {"files": {}}
    if files:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "coverage.json"
            # a file no process imported is analysed too: its functions, none executed
            cov.json_report(morfs=[str(f["file"]) for f in files], outfile=str(out))
            report = json.loads(out.read_text(encoding="utf-8"))
    measured = {str(Path(k).resolve()): v for k, v in report["files"].items()}
    import coverage

    return {"format": FORMAT, "hypothesis_profile": profile, "implementations": sorted(implementations),
            "coverage": coverage.__version__,
            "files": [summarize_file(f, measured[str(Path(f["file"]).resolve())]) for f in files]}


def summarize_file(selected: dict, measured: dict) -> dict:
    """One file's entry: coverage.py's function regions of the functions the rule selects, and the reason for
    each that never ran."""
    source, rel = selected["source"], selected["path"]
    src = SourceFile(selected["file"])
    imported = bool(measured["executed_lines"])  # its module-level lines ran in some process
    regions = {r["start_line"]: r for r in measured["functions"].values() if "start_line" in r}
    statements = {line: {*r["executed_lines"], *r["missing_lines"]} for line, r in regions.items()}
    entered = {line for line, r in regions.items() if r["executed_lines"]}
    reasons = {}
    if imported:
        declared = {q: declared_reason(d) for (dist, path, q), d in S.DECLARED.items()
                    if dist == source.distribution and path == rel}
        reasons = src.reasons(statements, entered, declared)
    # where the source names no HPU kernel or option: a port that cannot run off an HPU (the family registry's
    # needs_hpu, with its upstream line) needs one; a file no process ran a line of was not driven
    fallback = Reason(NEEDS_HPU, selected["note"]) if selected["note"] else \
        Reason(NOT_DRIVEN, "no line of the file ran (no case of the run imported it)")
    reasons = {line: r if r.kind != NOT_DRIVEN or (imported and not selected["note"]) else fallback
               for line, r in reasons.items()} if imported else dict.fromkeys(src.functions, fallback)
    hpu = src.hpu_lines()
    functions = []
    for fn in src.selected(source.rule):
        region = regions.get(fn.line)
        if region is None or region.get("name", fn.qualname) != fn.qualname:
            continue  # the first of two `def`s of one name (if/else): coverage.py reports the last one only
        executed, missing = set(region["executed_lines"]), set(region["missing_lines"])
        reason = None if executed else reasons[fn.line]
        hpu_only = len(missing) if reason and reason.kind == NEEDS_HPU else len(missing & hpu)
        functions.append({"name": fn.qualname, "line": fn.line, "lines": [len(executed), len(executed | missing)],
                          "branches": [region["summary"]["covered_branches"], region["summary"]["num_branches"]],
                          "hpu_only": hpu_only, "reason": None if reason is None else str(reason)})
    return {"implementation": source.implementation, "release": selected["release"], "group": source.group,
            "path": rel, "rule": source.rule, "imported": imported, "functions": functions}


def declared_reason(declared: S.Declared) -> Reason:
    """A declared reason, with the number of its upstream line in the installed release."""
    file = installed_file(declared.file)
    lines = file.read_text(encoding="utf-8").splitlines() if file else []
    line = next((i for i, text in enumerate(lines, 1) if declared.needle in text), None)
    where = f"{declared.file}:{line}" if line else f"{declared.file} (no line has {declared.needle!r} in this release)"
    return Reason(declared.kind, declared.what, f"{where}; {declared.why}")
