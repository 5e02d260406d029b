"""Generated blocks in the docs: a command's output kept between two HTML comments in a markdown
file (`<!-- NAME:begin -->` ... `<!-- NAME:end -->`), rewritten by the command's --update-docs and
compared by its --check (a test runs the check, so a stale table fails CI). One helper for every
generated table (findings, reach)."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def span(text: str, name: str) -> tuple[int, int]:
    """(start, end) of the block's content between the markers; ValueError if there is not exactly one."""
    begin, end = markers(name)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i or text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"needs exactly one {begin} ... {end} block")
    return i + len(begin), j


def read_block(path: Path, name: str) -> tuple[str, int, int]:
    """(the doc's text, start, end), checked before any work: OSError or ValueError say why not."""
    text = path.read_text(encoding="utf-8")
    start, end = span(text, name)
    return text, start, end


def is_current(text: str, start: int, end: int, content: str) -> bool:
    return text[start:end] == "\n" + content


def rewrite(path: Path, text: str, start: int, end: int, content: str) -> None:
    path.write_text(text[:start] + "\n" + content + text[end:], encoding="utf-8")
