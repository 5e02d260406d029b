"""`python -m mpt_kv reach`: the reach table (which ranges each check's cases reached).

  python -m mpt_kv reach REPORT.json       a run's own table, from its JSON report
  python -m mpt_kv reach --draw ci         the draws of a hypothesis profile (no model run)
  python -m mpt_kv reach --update-docs     rewrite the default run's table (the `ci` profile's draws)
                                           between <!-- reach:begin --> and <!-- reach:end --> in
                                           docs/reach.md (or --doc PATH)
  python -m mpt_kv reach --check           exit 1 if that block is not what --draw ci prints

Exit status 0; 1 for a stale block or a report without reach records; 2 for bad arguments or a
doc that is missing, unwritable or has no block (checked before any work)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpt_kv import package_data
from mpt_kv.cli import docblocks
from mpt_kv.checks import profiles, reach
from mpt_kv.outputs import file_problem, path_arg

DOC = package_data.REACH_DOC
COMMAND = "python -m mpt_kv reach --update-docs"
DOC_PROFILE = "ci"  # the default CI run's draws: derandomized, so the table is the same on every machine


class Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(message)


def usage_error(message: str):
    print(f"mpt-kv reach: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:

    p = Parser(prog="python -m mpt_kv reach", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", nargs="?", help="a JSON report with a 'reach' list of records")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--draw", metavar="PROFILE", help="the draws of a hypothesis profile (ci, dev, thorough)")
    mode.add_argument("--update-docs", dest="update", action="store_true", help="rewrite docs/reach.md's table")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/reach.md's table is stale")
    p.add_argument("--doc", type=path_arg, default=None, help=f"the doc (default {DOC})")
    p.add_argument("--reference-model", help="a real model's values (default mpt-7b)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    generated = args.update or args.check
    if args.doc is not None and not generated:
        usage_error("--doc is only read with --update-docs or --check")
    if generated and args.report:
        usage_error("--update-docs and --check compare the default run's draws, not a report")
    if not generated and not args.draw:
        if not args.report:
            usage_error("give a report file, --draw PROFILE, --update-docs or --check")
        rest = [args.report] + (["--reference-model", args.reference_model] if args.reference_model else [])
        return reach.main(rest)
    if args.draw:
        from mpt_kv.checks.registry import drawn_records  # lazy: torch and the models only where this command needs them

        if args.report:
            usage_error("give a report file or --draw PROFILE, not both")
        profiles.load_profile()
        print("\n".join(reach.table_lines(reach.summarize(drawn_records(args.draw)),
                                          reach.load_reference_model(args.reference_model))))
        return 0
    path = args.doc or DOC
    try:
        text, start, end = docblocks.read_block(path, "reach")
    except (OSError, ValueError) as e:
        usage_error(f"{path}: {e}")
    if args.update:

        if problem := file_problem(path):
            usage_error(f"{path}: {problem}")
    from mpt_kv.checks.registry import drawn_records  # lazy: torch and the models only where this command needs them

    table = "\n".join(reach.table_lines(reach.summarize(drawn_records(DOC_PROFILE)),
                                        reach.load_reference_model(args.reference_model))) + "\n"
    if args.check:
        if not docblocks.is_current(text, start, end, table):
            print(f"mpt-kv reach: the reach table in {path} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        print(f"{path}: the reach table is up to date")
        return 0
    docblocks.rewrite(path, text, start, end, table)
    print(f"{path}: reach table rewritten")
    return 0
