"""Every file mpt-kv opens by its own location, listed once: the code that opens one takes its path
from here, never from its own `__file__`.

PACKAGE: the data files of the package, shipped in the wheel (pyproject.toml's package-data says
which; `files()` lists each). CHECKOUT: files of the repository around the package, present in a
clone only: the docs whose generated blocks `checks`, `reach`, `findings` and `killmatrix`
rewrite or check (`--update-docs`, `--check-docs`), and the lock `sweep` installs: developers'
commands.

tests/test_release.py checks, on the wheel that `python -m build` makes and installed into a fresh
virtual environment, that it holds every file `files()` lists and none of CHECKOUT, that running
the openers there opens no other file of the package, and that no module but this one finds a file
by its own location. Moving a data file is one edit here (and pyproject's package-data, if its
folder changes).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # the installed (or checked-out) mpt_kv folder
CHECKOUT_ROOT = PACKAGE_ROOT.parent  # a clone's root; site-packages in an installed wheel

# --- shipped in the wheel ------------------------------------------------------------------------
# the findings (mpt_kv.findings): the MPT targets' known upstream failures (a project's own file replaces
# it) and the family checks' (mpt_kv.findings.entries)
MPT_KNOWN_FAILURES = PACKAGE_ROOT / "findings" / "known_failures.json"
FAMILY_KNOWN_FAILURES = PACKAGE_ROOT / "findings" / "family_known_failures.json"
# every standalone repro's source (mpt_kv.findings.scripts): the family findings' templates, the MPT
# target findings' kept scripts (<slug>.py.tmpl) and the code they share (<name>.part)
REPRO_SOURCES = PACKAGE_ROOT / "findings" / "sources"
REPRO_TEMPLATES = REPRO_SOURCES / "templates"
KEPT_REPROS = REPRO_SOURCES / "kept"
REPRO_PARTS = REPRO_SOURCES / "parts"
# MPT-7B's config: the reach table's reference model and the seed finding's cost (checks/reach.py, findings/costs.py)
MPT_7B_CONFIG = PACKAGE_ROOT / "data" / "mpt-7b.json"
# real configs of the other families, <name>.json: the findings' costs (findings/costs.py, entries.py)
REAL_CONFIGS = PACKAGE_ROOT / "data" / "families"
# the gate profile: the per-PR subset of the conformance run, computed from the catalogues (catalogue/gate_profile.py)
GATE_PROFILE = PACKAGE_ROOT / "data" / "gate-profile.json"
# the catalogue's modules, whose source the gate profile's fingerprint reads (a change makes it stale)
CATALOGUE_SOURCES = tuple(PACKAGE_ROOT / "catalogue" / name for name in ("variants.py", "designs.py", "assembly.py"))

# each entry: a file, or a folder with the patterns of the files it holds
PACKAGE = {
    MPT_KNOWN_FAILURES: (),
    FAMILY_KNOWN_FAILURES: (),
    MPT_7B_CONFIG: (),
    GATE_PROFILE: (),
    REAL_CONFIGS: ("*.json",),
    REPRO_TEMPLATES: ("*.py.tmpl",),
    KEPT_REPROS: ("*.py.tmpl",),
    REPRO_PARTS: ("*.part",),
}

# --- in a clone only (the developer commands that keep the docs' generated blocks) ---------------
CHECKS_DOC = CHECKOUT_ROOT / "README.md"  # the table of checks (python -m mpt_kv checks)
REACH_DOC = CHECKOUT_ROOT / "docs" / "reach.md"  # the reach table (python -m mpt_kv reach)
FAMILIES_DOC = CHECKOUT_ROOT / "docs" / "families.md"  # the family checks' edges reached (python -m mpt_kv reach)
FINDINGS_DOC = CHECKOUT_ROOT / "docs" / "findings.md"  # the findings table (python -m mpt_kv findings)
KILLMATRIX_DOC = CHECKOUT_ROOT / "docs" / "catalogues.md"  # the kill matrix (python -m mpt_kv killmatrix)
# the test tools' pins each release's env of `python -m mpt_kv sweep` installs (it runs from a clone)
TEST_TOOLS_LOCK = CHECKOUT_ROOT / "constraints" / "hpu.txt"
CHECKOUT = (CHECKS_DOC, REACH_DOC, FAMILIES_DOC, FINDINGS_DOC, KILLMATRIX_DOC, TEST_TOOLS_LOCK)


def files() -> list[Path]:
    """Every data file of the package that the code may open: PACKAGE's files, and its folders'
    files matching their patterns (a folder that is missing or holds none fails here, not later)."""
    out = []
    for path, patterns in PACKAGE.items():
        if not patterns:
            out.append(path)
            continue
        found = sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})
        if not found:
            raise FileNotFoundError(f"{path}: no {' or '.join(patterns)} file: the package is incomplete")
        out += found
    return out
