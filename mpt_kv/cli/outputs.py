"""Output paths are checked before any work starts: a run of minutes must not end in a
traceback because its report cannot be written."""

from __future__ import annotations

import os
from pathlib import Path


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why a folder cannot be created or written to (None if it can). Parents are created later."""
    path = Path(path).absolute()
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        return f"{path} cannot be created: {base} is not a folder"
    return None if os.access(base, os.W_OK | os.X_OK) else f"{path} cannot be created: {base} is not writable"


def file_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written (None if it can; its missing parent folders are created later)."""
    path = Path(path).absolute()
    if path.is_dir():
        return f"{path} is a folder, expected a file name"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    return dir_problem(path.parent)
