"""Output paths are checked before any work starts: a run of minutes must not end in a
traceback because its report cannot be written.

A path is checked by doing what the end of the run will do: create its missing parent folders
and open the file for writing (a folder: create it and a file in it). Whatever the check created
is removed again, so a refused or later-failing run leaves nothing behind, and a file that was
there is opened for appending, never truncated. `os.access` is not enough: it is true for root
on /proc, and says nothing about a read-only mount or a full quota.

Nothing the user did not name is overwritten: an empty path is refused everywhere (it is not the
current folder: `Path("")` is "."; `path_arg` is the argparse type every command's output option
takes), and a command that writes a folder writes only into a new or empty folder or into its own
earlier output, marked by a file `MARKER` naming the command (`dir_problem(path, command)`, then
`mark_output(path, command)`): `findings --repro .` in a project's root is refused, a rerun
replaces its own folders.

And no output replaces an input or another output: `clash_problem(outputs, inputs)` refuses two
outputs that name one file or folder, and an output that names a file the same run reads (`report
r.json --markdown r.json` would replace the report it merges; `--mpt-kv-report X --mpt-kv-markdown
X` would keep only the Markdown). Every command and the pytest plugin ask it, before any work.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

MARKER = ".mpt-kv-output"  # in a folder a command wrote: which command, so that a rerun may replace it
EMPTY = "an empty path ('') names no file or folder (it is not the current folder): give one"


def path_arg(value: str) -> Path:
    """The argparse type of every path option, output or input: '' is a usage error naming it, never '.'."""
    if str(value).strip() == "":
        raise argparse.ArgumentTypeError(EMPTY)
    return Path(value)


def same_place(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file or folder: one absolute path once links and '..' are resolved,
    or (both existing) one file by another name (a hard link, a case-insensitive file system)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): the resolved paths said it all
        return False


def clash_problem(outputs, inputs=()) -> str | None:
    """Why a run's outputs cannot all be written as named (None if they can): two outputs naming one file
    or folder (the second write would replace the first), or an output naming a file the run reads (the
    write would replace its own input). `outputs`, `inputs`: (what, path) pairs, `what` as the user named
    it (an option, "the report"); a path None is one not given."""
    outputs = [(what, path) for what, path in outputs if path is not None]
    inputs = [(what, path) for what, path in inputs if path is not None]
    for i, (what, path) in enumerate(outputs):
        for other, other_path in outputs[:i]:
            if same_place(path, other_path):
                return (f"{what} {path} is also {other} {other_path}: two outputs never share a file (the second "
                        "write would replace the first); name another")
        for other, other_path in inputs:
            if same_place(path, other_path):
                return (f"{what} {path} is {other} {other_path}, which this run reads: an output never replaces an "
                        "input; name another file")
    return None


def _make_parents(folder: Path, created: list[Path]) -> None:
    """mkdir `folder` and its missing parents, recording each one made (outermost first)."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for d in reversed(missing):
        d.mkdir()
        created.append(d)


def _remove(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            pass  # something else put a file there meanwhile: not ours to delete


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _not_a_folder(folder: Path) -> str | None:
    """Where `folder` (or the nearest of its parents that exists) is a file, not a folder."""
    if folder.exists():
        return None if folder.is_dir() else f"{folder} exists and is not a folder"
    base = folder.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    return None if base.is_dir() else f"{folder} cannot be created: {base} is not a folder"


def file_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written (None if it can), found by creating its parents and opening it
    for writing; everything the check created is removed."""
    if str(path).strip() == "":
        return EMPTY
    path = Path(path).absolute()
    if path.is_dir():
        return f"{path} is a folder, expected a file name"
    problem = _not_a_folder(path.parent)
    if problem:
        return problem
    created: list[Path] = []
    try:
        _make_parents(path.parent, created)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        return f"{path} cannot be written: {_reason(e)}"
    finally:
        _remove(created)
    return None


def dir_problem(path: str | os.PathLike, command: str | None = None) -> str | None:
    """Why files cannot be written in a folder (None if they can), found by creating the folder
    (and its parents) and a file in it; everything the check created is removed. `command` (the
    command that writes the folder, e.g. "findings --repro"): the folder must also be new, empty, or
    that command's own earlier output (its MARKER): a folder of other files is never written into."""
    if str(path).strip() == "":
        return EMPTY
    path = Path(path).absolute()
    problem = _not_a_folder(path)
    if problem:
        return problem
    if command is not None:
        problem = foreign_folder(path, command)
        if problem:
            return problem
    created: list[Path] = []
    try:
        _make_parents(path, created)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".mpt-kv-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{path} cannot be written: {_reason(e)}"
    finally:
        _remove(created)
    return None


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write an output file, creating its folders as pytest's --junitxml does (`file_problem` checked,
    before any work, that they can be made); an OSError is the caller's to word."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def foreign_folder(path: Path, command: str) -> str | None:
    """Why `command` must not write into `path`: it holds files and is not that command's earlier
    output (no MARKER naming it). None for a missing or empty folder, or its own output."""
    if not path.is_dir():
        return None
    entries = sorted(e.name for e in path.iterdir())
    if not entries:
        return None
    marker = path / MARKER
    owner = marker.read_text(encoding="utf-8", errors="replace").strip() if marker.is_file() else None
    if owner == command:
        return None
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    whose = f"the output of `{owner}`" if owner else "not an earlier output of this command"
    return (f"{path} is a folder of {len(entries)} entries ({shown}), {whose} (no {MARKER} naming "
            f"`python -m mpt_kv {command}` in it): it writes only into a new or empty folder or its own earlier "
            "output, never over files it did not write; name a new folder")


def mark_output(path: str | os.PathLike, command: str) -> None:
    """Mark a folder `command` wrote (after `dir_problem(path, command)` allowed it), so that a rerun
    may write there again."""
    (Path(path) / MARKER).write_text(command + "\n", encoding="utf-8")
