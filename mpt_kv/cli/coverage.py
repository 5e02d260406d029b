"""`python -m mpt_kv coverage`: which lines and branches of each implementation's attention and cache functions
(transformers' model files, cache_utils, masking_utils, sdpa path and generate; optimum-habana's ports and
GaudiGenerationMixin; llm-foundry's attention) a run executed, measured with coverage.py (docs/reach.md).

  python -m mpt_kv coverage SUMMARY.json ...       the tables of the runs' summaries (`python -m mpt_kv run
                                                   --coverage SUMMARY.json`, one per environment): per group,
                                                   per file, and every function never entered with its reason
  python -m mpt_kv coverage --data FILE (--report REPORT.json | --implementation NAME ...) [--json OUT]
                                                   a coverage.py data file of a run made here (the one `run
                                                   --coverage` keeps beside its summary, or `coverage run
                                                   --branch` then `coverage combine`), analysed in this
                                                   environment for the implementations its report says it ran
                                                   (and its profile), or those named
  python -m mpt_kv coverage --update-docs SUMMARY.json ...
                                                   rewrite the block between <!-- upstream-coverage:begin -->
                                                   and <!-- upstream-coverage:end --> in docs/reach.md (--doc
                                                   PATH: that doc's): the main job's runs, drawn under the ci
                                                   profile (CI=true)
  python -m mpt_kv coverage --check SUMMARY.json ...
                                                   exit 1 if that block is not what those summaries print or a
                                                   group is under its floor (mpt_kv/upstream/selection.py FLOORS)

Exit status 0; 1 for a stale block or a floor not held; 2 for bad arguments, a file that is not a summary,
two summaries of one environment, summaries not drawn under the ci profile (--update-docs, --check), a
data file coverage.py cannot read, or a doc that is missing, unwritable or has no block (checked before any
work).
"""

from __future__ import annotations

import argparse
import json
import sys

from mpt_kv import package_data
from mpt_kv.cli import docblocks
from mpt_kv.outputs import file_problem, path_arg
from mpt_kv.upstream import selection, tables

DOC = package_data.REACH_DOC
BLOCK = "upstream-coverage"
COMMAND = "python -m mpt_kv coverage --update-docs"
DOC_PROFILE = "ci"  # the main job's runs in CI: derandomized, so the table is the same on every machine
IMPLEMENTATIONS = sorted({s.implementation for s in selection.SOURCES})


def usage_error(message: str):
    print(f"mpt-kv coverage: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        usage_error(f"{message} (see python -m mpt_kv coverage --help)")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m mpt_kv coverage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summaries", nargs="*", type=path_arg, help="summaries written by python -m mpt_kv run --coverage")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--data", type=path_arg, help="a coverage.py data file (.coverage) of a run in this environment")
    mode.add_argument("--update-docs", dest="update", action="store_true", help="rewrite docs/reach.md's table")
    mode.add_argument("--check", action="store_true", help="exit 1 if that table is stale or a floor is not held")
    p.add_argument("--implementation", action="append", choices=IMPLEMENTATIONS,
                   help="with --data: an implementation the run drove (repeat for several)")
    p.add_argument("--report", type=path_arg, help="with --data: the run's JSON report (what it ran, its profile)")
    p.add_argument("--json", type=path_arg, help="with --data: write its summary there")
    p.add_argument("--doc", type=path_arg, default=None, help=f"with --update-docs or --check: the doc (default {DOC})")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    generated = args.update or args.check
    if args.doc is not None and not generated:
        usage_error("--doc is only read with --update-docs or --check")
    if args.data is None and (args.implementation or args.json or args.report):
        usage_error("--implementation, --report and --json are read with --data only")
    if args.data is not None:
        if args.summaries:
            usage_error("give --data FILE or summaries, not both")
        if bool(args.implementation) == bool(args.report):
            usage_error(f"--data needs what its run drove: its --report REPORT.json, or --implementation NAME "
                        f"({', '.join(IMPLEMENTATIONS)})")
        return from_data(args)
    if not args.summaries:
        usage_error("give the summaries of the runs (python -m mpt_kv run --coverage SUMMARY.json), or --data FILE")
    try:
        summaries = tables.load(args.summaries)
    except tables.SummaryError as e:
        usage_error(str(e))
    if not generated:
        print_tables(summaries)
        return 0
    drawn = tables.profiles(summaries) - {DOC_PROFILE}
    if drawn:
        usage_error(f"docs/reach.md's table is the main job's in CI (the {DOC_PROFILE} profile, CI=true); these "
                    f"summaries were drawn under {', '.join(sorted(map(str, drawn)))}")
    doc = args.doc or DOC
    try:
        text, start, end = docblocks.read_block(doc, BLOCK)
    except (OSError, ValueError) as e:
        usage_error(f"{doc}: {e}")
    if args.update and (problem := file_problem(doc)):
        usage_error(f"{doc}: {problem}")
    block = "\n".join(doc_lines(summaries)) + "\n"
    problems = tables.floor_problems(summaries)
    stale = 0
    if args.update:
        docblocks.rewrite(doc, text, start, end, block)
        print(f"{doc}: the upstream coverage table rewritten")
    elif not docblocks.is_current(text, start, end, block):
        print(f"mpt-kv coverage: the upstream coverage table in {doc} is stale: run {COMMAND} with the main job's "
              f"summaries (docs/reach.md says how)", file=sys.stderr)
        stale = 1
    else:
        print(f"{doc}: the upstream coverage table is up to date")
    for problem in problems:
        print(f"mpt-kv coverage: floor not held: {problem}", file=sys.stderr)
    return 1 if stale or problems else 0


def from_data(args) -> int:
    from mpt_kv.upstream import measure  # lazy: coverage.py and the family registry (torch) only here

    for option, path in (("--data", args.data), ("--report", args.report)):
        if path is not None and not path.is_file():
            usage_error(f"{option} {path}: no such file")
    if args.json is not None and (problem := file_problem(args.json)):
        usage_error(f"--json {args.json}: {problem}")
    implementations, profile = args.implementation, None
    if args.report is not None:
        try:
            implementations, profile = measure.what_ran(args.report)
        except (ValueError, KeyError, TypeError) as e:
            usage_error(f"--report {args.report}: not a run's JSON report ({type(e).__name__}: {e})")
    try:
        import coverage
    except ImportError:
        usage_error("--data needs coverage.py (pip install coverage; a dev dependency of mpt-kv)")
    cov = coverage.Coverage(data_file=str(args.data))
    try:
        cov.load()
    except coverage.CoverageException as e:
        usage_error(f"--data {args.data}: coverage.py cannot read it: {e}")
    summary = measure.summarize(cov, implementations, profile)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print_tables([summary])
    return 0


def print_tables(summaries) -> None:
    print("\n".join(["## per group", *tables.group_lines(summaries), "", "## per file", *tables.file_lines(summaries),
                     "", "## functions never entered", *tables.never_entered_lines(summaries)]))


def doc_lines(summaries) -> list[str]:
    """docs/reach.md's block: the group table, then the file table under a fold."""
    runs = "; ".join(f"{', '.join(s['implementations'])} ({', '.join(sorted({f['release'] for f in s['files']}))})"
                     for s in summaries)
    return [*tables.group_lines(summaries), "",
            f"Runs: {runs}; drawn under the {DOC_PROFILE} profile; coverage.py "
            f"{', '.join(sorted({s['coverage'] for s in summaries}))}.", "",
            "<details><summary>per file</summary>", "", *tables.file_lines(summaries), "", "</details>"]
