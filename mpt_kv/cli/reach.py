"""`python -m mpt_kv reach`: the reach table (which ranges each check's cases reached).

  python -m mpt_kv reach REPORT.json       a run's own table, from its JSON report
  python -m mpt_kv reach --draw ci         the draws of a hypothesis profile (no model run)
  python -m mpt_kv reach --update-docs     rewrite the default run's table (the `ci` profile's draws)
                                           between <!-- reach:begin --> and <!-- reach:end --> in
                                           docs/reach.md, and the family checks' edges reached (a run
                                           of family-P1 and family-ops on transformers' concat path,
                                           a few seconds) between <!-- family-reach:begin --> and
                                           <!-- family-reach:end --> in docs/families.md (--doc PATH:
                                           the blocks of that one doc)
  python -m mpt_kv reach --check           exit 1 if a block is not what those runs print

Exit status 0; 1 for a stale block or a report without reach records; 2 for bad arguments or a
doc that is missing, unwritable or has no block (checked before any work)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpt_kv import package_data
from mpt_kv.cli import docblocks
from mpt_kv.checks import profiles, reach
from mpt_kv.outputs import file_problem, path_arg

DOC = package_data.REACH_DOC
FAMILIES_DOC = package_data.FAMILIES_DOC
BLOCKS = ("reach", "family-reach")  # the generated blocks this command keeps
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
    p.add_argument("report", nargs="?", type=path_arg, help="a JSON report with a 'reach' list of records")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--draw", metavar="PROFILE", type=hypothesis_profile,
                      help="the draws of a hypothesis profile (ci, dev, thorough)")
    mode.add_argument("--update-docs", dest="update", action="store_true", help="rewrite docs/reach.md's and docs/families.md's reach tables")
    mode.add_argument("--check", action="store_true", help="exit 1 if one of those tables is stale")
    p.add_argument("--doc", type=path_arg, default=None, help=f"one doc, its reach blocks (default {DOC} and {FAMILIES_DOC})")
    p.add_argument("--reference-model", type=path_arg, help="a real model's values (default mpt-7b)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    generated = args.update or args.check
    if args.doc is not None and not generated:
        usage_error("--doc is only read with --update-docs or --check")
    if generated and args.report:
        usage_error("--update-docs and --check compare the default run's draws, not a report")
    try:  # read before any work: a file that is missing, a folder or not a model's values is one line
        reference_model = reach.load_reference_model(args.reference_model)
    except ValueError as e:
        usage_error(f"--reference-model: {e}")
    if not generated and not args.draw:
        if not args.report:
            usage_error("give a report file, --draw PROFILE, --update-docs or --check")
        records = report_records(args.report)
        if not records:
            print(f"{args.report}: no 'reach' records (a run without reach recording, or nothing ran)", file=sys.stderr)
            return 1
        print("\n".join(reach.report_lines(records, reference_model)))
        return 0
    if args.draw:
        from mpt_kv.checks.registry import drawn_records  # lazy: torch and the models only where this command needs them

        if args.report:
            usage_error("give a report file or --draw PROFILE, not both")
        profiles.load_profile()
        print("\n".join(reach.table_lines(reach.summarize(drawn_records(args.draw)), reference_model)))
        return 0
    docs = [args.doc] if args.doc is not None else [DOC, FAMILIES_DOC]
    found = []  # (doc, block, text, start, end): checked before any work
    for path in docs:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            usage_error(f"{path}: {e}")
        names = [b for b in BLOCKS if docblocks.markers(b)[0] in text] if args.doc is not None else \
            [BLOCKS[docs.index(path)]]
        if not names:
            names = ["reach"]  # its error names the block a doc needs
        for name in names:
            try:
                found.append((path, name, *docblocks.read_block(path, name)))
            except (OSError, ValueError) as e:
                usage_error(f"{path}: {e}")
        if args.update and (problem := file_problem(path)):
            usage_error(f"{path}: {problem}")
    stale = 0
    for path, name, text, start, end in found:
        if args.update:  # a doc with both blocks: the second rewrite reads what the first wrote
            text, start, end = docblocks.read_block(path, name)
        table = "\n".join(block_lines(name, args.reference_model)) + "\n"
        what = "reach table" if name == "reach" else "family checks' reach table"
        if args.check:
            if not docblocks.is_current(text, start, end, table):
                print(f"mpt-kv reach: the {what} in {path} is stale: run {COMMAND}", file=sys.stderr)
                stale = 1
            else:
                print(f"{path}: the {what} is up to date")
            continue
        docblocks.rewrite(path, text, start, end, table)
        print(f"{path}: {what} rewritten")
    return stale


def hypothesis_profile(name: str) -> str:
    """--draw's type: a registered hypothesis profile (mpt-kv's dev, ci and thorough)."""
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument

    try:
        settings.get_profile(name)
    except InvalidArgument:
        raise argparse.ArgumentTypeError(f"{name!r} is no hypothesis profile: give one of {', '.join(profiles.NAMES)}")
    return name


def report_records(path: Path) -> list:
    """A report's reach records; a file that is missing, a folder or not a JSON report is a usage error."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # missing, a folder, not UTF-8, not JSON
        usage_error(f"cannot read the report {path}: {type(e).__name__}: {e}")
    if not isinstance(data, dict):
        usage_error(f"{path} is not an mpt-kv report (a JSON object with a 'reach' list); write one with pytest "
                    "--mpt-kv-report FILE")
    records = data.get("reach")
    if records is not None and not isinstance(records, list):
        usage_error(f"{path}: field 'reach' is {type(records).__name__}: expected a list of records")
    return records or []


def block_lines(name: str, reference_model: str | None) -> list[str]:
    """A generated block's table: "reach" the `ci` profile's draws (no model run); "family-reach" a run of
    the family programs (`registry.family_program_records`)."""
    # lazy: torch and the models only where this command needs them
    if name == "reach":
        from mpt_kv.checks.registry import drawn_records

        return reach.table_lines(reach.summarize(drawn_records(DOC_PROFILE)), reach.load_reference_model(reference_model))
    from mpt_kv.checks.registry import family_program_records

    return reach.family_doc_lines(family_program_records())
