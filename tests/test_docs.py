"""The README and docs/ as a reader meets them: the README is the front door (at most 300 lines),
every subject lives in exactly one place (no paragraph, table row or list item stands in two files),
every relative link resolves to a file and a heading, and every test the gate table names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def prose_lines(text: str) -> list[str]:
    """The lines a reader reads as text (fenced code left out: a command may be shown twice)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line.strip())
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines: move reference material into its one doc under docs/"


def test_no_line_of_prose_stands_in_two_places():
    seen: dict[str, str] = {}
    twice = []
    for path in DOCS:
        for line in prose_lines(path.read_text(encoding="utf-8")):
            if len(line) < 80 or set(line) <= set("|-: "):
                continue
            where = seen.setdefault(line, path.name)
            if where != path.name:
                twice.append(f"{where} and {path.name}: {line[:100]}")
    assert not twice, "\n".join(twice)


@pytest.mark.parametrize("path", [*DOCS, REPO / "CHANGELOG.md"], ids=lambda p: p.name)
def test_every_relative_link_resolves_to_a_file_and_heading(path):
    broken = []
    for target, anchor in LINK.findall(path.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        dest = (path.parent / target).resolve() if target else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor[1:] not in anchors(dest):
            broken.append(f"{target}{anchor}: no such heading in {dest.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


def gate_table_tests() -> list[tuple[str, str, str]]:
    """(row number, test file, test name) for every test the gate table of docs/gate.md names: each
    cell names its tests by file (`tests/test_x.py::test_y`), and `::test_z` continues the file
    named before it in the cell."""
    out = []
    for line in (REPO / "docs" / "gate.md").read_text(encoding="utf-8").splitlines():
        row = re.match(r"\| (\d+) \|", line)
        if row:
            proved_by, path = line.rstrip(" |").rsplit(" | ", 1)[-1], None
            for named, sep, name in re.findall(r"`(?:([\w/.]*)(::))?(test_\w+)", proved_by):
                # `tests/x.py::t` names its file, `::t` continues the one before, a bare `t` names none
                path = (named or path) if sep else None
                out.append((row.group(1), path, name))
    return out


def test_the_gate_table_names_only_tests_that_exist():
    defined = {}
    for path in (REPO / "tests").glob("test_*.py"):
        for name in re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), flags=re.M):
            defined.setdefault(name, set()).add(f"tests/{path.name}")
    rows = gate_table_tests()
    assert len({r for r, _, _ in rows}) >= 30, "the gate table lost its rows"
    missing = [f"row {r}: {path or '(no file)'}::{name}" for r, path, name in rows if path not in defined.get(name, ())]
    assert not missing, "the gate table names tests that do not exist where it says: " + ", ".join(missing)
