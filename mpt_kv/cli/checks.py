"""`python -m mpt_kv checks`: the index of checks (mpt_kv/checks/index.py) as the README's table, one
row per property: its name and title, what fails it, its doc.

  python -m mpt_kv checks                 the table, as Markdown
  python -m mpt_kv checks --ids           every check id of the registry, one per line
  python -m mpt_kv checks --update-docs   rewrite the block between <!-- checks:begin --> and
                                          <!-- checks:end --> in README.md (or --doc PATH)
  python -m mpt_kv checks --check         exit 1 if that block is not what the command prints

Exit status 0; 1 for a stale block (--check); 2 for bad arguments or a doc that is missing,
unwritable or has no block (checked before any work).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpt_kv import package_data
from mpt_kv.checks import index
from mpt_kv.cli import docblocks
from mpt_kv.outputs import file_problem

DOC = package_data.CHECKS_DOC
COMMAND = "python -m mpt_kv checks --update-docs"


def usage_error(message: str):
    print(f"mpt-kv checks: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(f"{message} (see python -m mpt_kv checks --help)")


def table() -> str:
    """The index as a Markdown table (links relative to the repository root, as the README's)."""
    rows = ["| check | what fails it | doc |", "|---|---|---|"]
    for p in index.PROPERTIES:
        name = p.doc.split("/")[-1].split("#")[0].removesuffix(".md")
        rows.append(f"| `{p.name}` {p.title} | {p.line} | [{name}]({p.doc}) |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m mpt_kv checks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--ids", action="store_true", help="every check id of the registry")
    mode.add_argument("--update-docs", dest="update", action="store_true", help="rewrite README.md's table")
    mode.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    p.add_argument("--doc", type=Path, default=None, help=f"the doc (default {DOC})")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.doc is not None and not (args.update or args.check):
        usage_error("--doc is only read with --update-docs or --check")
    if args.ids:
        from mpt_kv.checks.registry import CHECKS  # lazy: torch and the models only where this command needs them

        print("\n".join(CHECKS))
        return 0
    if not (args.update or args.check):
        print(table(), end="")
        return 0
    path = args.doc or DOC
    try:
        text, start, end = docblocks.read_block(path, "checks")
    except (OSError, ValueError) as e:
        usage_error(f"{path}: {e}")
    if args.update and (problem := file_problem(path)):
        usage_error(f"{path}: {problem}")
    if args.check:
        if not docblocks.is_current(text, start, end, table()):
            print(f"mpt-kv checks: the table of checks in {path} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        print(f"{path}: the table of checks is up to date")
        return 0
    docblocks.rewrite(path, text, start, end, table())
    print(f"{path}: the table of checks rewritten")
    return 0
