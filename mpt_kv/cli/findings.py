"""`python -m mpt_kv findings`: the findings of the family checks (mpt_kv/findings/family_known_failures.json)
and the MPT targets' whose repros are kept as one table, with what each costs at a real config of its
family (mpt_kv.findings.costs).

  python -m mpt_kv findings                  the table, as text
  python -m mpt_kv findings --markdown       the table of docs/findings.md
  python -m mpt_kv findings --update-docs    rewrite the block between <!-- findings:begin --> and
                                             <!-- findings:end --> in docs/findings.md (or --doc PATH)
  python -m mpt_kv findings --check          exit 1 if that block is not what --markdown prints
  python -m mpt_kv findings --configs        every real config: its K/V and fused output bytes per token
  python -m mpt_kv findings --repro DIR      one folder per finding under DIR: a standalone repro.py
                                             (torch and transformers only, no mpt-kv; exit 1 where the
                                             bug is there, 0 where not, 2 where it could not run) and a
                                             README.md (what reaches it, upstream line, cost, fix);
                                             DIR/README.md indexes them and lists the findings
                                             without a repro (mpt_kv/findings/repros.py)

Exit status 0; 1 for a stale block (--check) or a finding whose real config does not fit it; 2 for
bad arguments or a doc that is missing, unwritable or has no block, or a --repro DIR that is a
file or cannot be written (checked before any work).
(--update-readme and --readme are the old names of --update-docs and --doc: the table moved out
of the README into docs/findings.md.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mpt_kv import package_data
from mpt_kv.cli import docblocks
from mpt_kv.findings import repros, scripts, user_path
from mpt_kv.findings.costs import finding_cost, real_configs, sizes_per_token
from mpt_kv.findings.raw import raw_entries, target_of
from mpt_kv.findings.grouping import DTYPE_NAME, POINTS, checks_seen, grouped, human, versions, what
from mpt_kv.outputs import dir_problem, file_problem, mark_output, path_arg

BEGIN, END = docblocks.markers("findings")
DOC = package_data.FINDINGS_DOC
COMMAND = "python -m mpt_kv findings --update-docs"
def usage_error(message: str):
    """Exit 2, as the help says, with one line naming what is wrong."""
    print(f"mpt-kv findings: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage + error lines become one line, exit 2
        usage_error(f"{message} (see python -m mpt_kv findings --help)")


def rows() -> list[list[str]]:
    """One row per finding (`grouped`), in the file's order of first appearance."""
    out = []
    for entries in grouped(raw_entries()):
        entry = entries[0]
        cost = finding_cost(entry, POINTS, getattr(torch, DTYPE_NAME))
        if cost.pinned is None:
            config, pinned, kv = "-", [f"- ({cost.why_none})"] + ["-"] * (len(POINTS) - 1), "-"
        else:
            config = cost.config.checkpoint
            pinned = []
            for batch, tokens in POINTS:
                n = cost.pinned[(batch, tokens)]
                if tokens is None:
                    context = cost.config.context()
                    pinned.append("- (no context length in its config.json)" if context is None
                                  else f"{human(n)} ({context} tokens)")
                else:
                    pinned.append(human(n))
            kv = human(cost.kv[POINTS[0]])
        implementation, family, variant = target_of(entry)
        out.append([f"{family}/{variant}", implementation,
                    versions(entry), checks_seen(entries), user_path.cell(entries), what(entry), config, *pinned, kv,
                    entry["upstream"]])
    return out


# MPT targets whose findings have rows too: the MPT implementations the family checks do not build
# (llm-foundry's MPTForCausalLM, what the Hub's mosaicml/mpt-* run with trust_remote_code), one row per kept
# repro of mpt_kv/findings/known_failures.json, its cost at mosaicml/mpt-7b where it is the views of Wqkv
TARGET_ROWS = ("llm-foundry",)


def target_rows() -> list[list[str]]:
    kept, _, _ = repros.target_plan(repros.target_entries())
    out = []
    for r in kept:
        entry = r.entries[0]
        if entry["target"] not in TARGET_ROWS:
            continue
        constants = scripts.script_constants(r.script)
        views = ["key", "value"] if any(e["property"] == "P3" for e in r.entries) else []
        cost = finding_cost({"target": f"{entry['target']}/mpt/alibi", "views": views, "cost_config": "mpt-7b"},
                            POINTS, getattr(torch, DTYPE_NAME))
        if cost.pinned is None:
            config, pinned, kv = "-", [f"- ({cost.why_none})"] + ["-"] * (len(POINTS) - 1), "-"
        else:
            config = cost.config.checkpoint
            pinned = [human(cost.pinned[(b, t)]) + ("" if t else f" ({cost.config.context()} tokens)")
                      for b, t in POINTS]
            kv = human(cost.kv[POINTS[0]])
        checks = ", ".join(dict.fromkeys(e.get("check") or (e["property"] + (f" ({e['path']})" if e.get("path") else ""))
                                         for e in r.entries))
        out.append(["mpt/alibi (MPTForCausalLM)", entry["target"], versions(entry), checks,
                    # every one an option: mpt-7b's config.json has use_cache false, which generate follows
                    f"option: {constants['CALL']}",
                    constants["WHAT"], config, *pinned, kv, constants["UPSTREAM"]])
    return out


def header() -> list[str]:
    (b0, t0), (b1, _) = POINTS
    return ["finding", "implementation", "versions", "checks that see it", "how a user reaches it",
            "what pins / the error", "real config",
            f"pinned, batch {b0} x {t0}", f"pinned, batch {b1} x its context", f"K/V cache, batch {b0} x {t0}",
            "upstream"]


def intro() -> str:
    (b0, t0), (b1, _) = POINTS
    return (f"Bytes pinned beyond the K/V cache by each finding (its fused projection's output, less the cached "
            f"tensors that view it, in every caching layer, held from the prefill until the first decode step "
            f"copies) at a real config of the family "
            f"(mpt_kv/data/families), {DTYPE_NAME}, after a prefill of batch {b0} x {t0} tokens and of batch "
            f"{b1} x the checkpoint's context length (its config.json's n_positions, max_position_embeddings or "
            f"max_seq_len); the last byte column is the analytic K/V cache at batch {b0} x {t0}, for scale.")


def markdown() -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|")
    lines = [intro(), "", "| " + " | ".join(header()) + " |", "|" + "---|" * len(header())]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows() + target_rows()]
    return "\n".join(lines) + "\n"


def text() -> str:
    table = [header()] + rows() + target_rows()
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [intro(), ""] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines) + "\n"


def configs_text() -> str:
    """Every real config with its analytic K/V bytes per token and its fused projection's output
    bytes per token and layer."""
    table = [["config", "checkpoint", "family", f"K/V bytes per token ({DTYPE_NAME})",
              "fused output bytes per token and layer", "source"]]
    for name, real in sorted(real_configs().items()):
        kv, fused = sizes_per_token(real, getattr(torch, DTYPE_NAME))
        table.append([name, real.checkpoint, real.family, str(kv), "-" if fused is None else str(fused), real.source])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table) + "\n"


def readme_block(readme: str) -> tuple[int, int]:
    """(start, end) of the block's content between the markers; ValueError if there is none."""
    return docblocks.span(readme, "findings")


REPRO_COMMAND = "findings --repro"


def write_repros(directory: Path) -> int:
    """--repro DIR: the repro folders and their index; one line per folder and per finding without one."""
    written, missing = repros.write(directory, grouped(raw_entries()))
    mark_output(directory, REPRO_COMMAND)  # a rerun may write here again; nothing else may
    for r in written:
        print(f"{directory / r.slug}/repro.py")
    for entries in missing:
        print(f"no standalone repro yet: {repros.describe(entries)}")
    print(f"{directory / 'README.md'}: {len(written)} repros, {len(missing)} findings without one")
    return 0


def derive(modes: list[str], reports: list[Path]) -> int:
    """--derive SOURCE NEW: the derived entries on stdout (JSON, to append to the known-failures files after
    review), every failed cell no entry explains on stderr (exit 1 then)."""
    from mpt_kv.checks import index
    from mpt_kv.findings.derive import derive_from_reports

    unknown = [m for m in modes if m not in index.GENERATE_MODES]
    if unknown:
        usage_error(f"--derive {' '.join(modes)}: {unknown[0]!r} is no generate mode: {', '.join(index.GENERATE_MODES)}")
    if not reports:
        usage_error("--derive needs at least one --report (a conformance run's JSON report)")
    missing = [str(r) for r in reports if not r.is_file()]
    if missing:
        usage_error(f"--report {missing[0]}: no such file")
    derived, unexplained = derive_from_reports(reports, *modes)
    print(json.dumps(derived, indent=2))
    for r in unexplained:
        print(f"unexplained: {r['target']} {r['check']}: {r.get('message', '')[:300]}", file=sys.stderr)
    return 1 if unexplained else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = Parser(prog="python -m mpt_kv findings", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--markdown", action="store_true", help="the markdown table of docs/findings.md")
    mode.add_argument("--update-docs", "--update-readme", dest="update", action="store_true",
                      help=f"rewrite the {BEGIN} block of docs/findings.md (or --doc)")
    mode.add_argument("--check", action="store_true", help="exit 1 if that block is stale")
    mode.add_argument("--configs", action="store_true", help="every real config's K/V and fused bytes per token")
    mode.add_argument("--repro", type=path_arg, metavar="DIR", default=None,
                      help="write a standalone reproduction script per finding under DIR")
    mode.add_argument("--derive", nargs=2, metavar=("SOURCE", "NEW"), default=None,
                      help="print, as JSON, the known failures of generate mode NEW's failed cells in --report that a "
                           "SOURCE mode entry (or a direct-drive entry of the target) already explains "
                           "(mpt_kv.findings.derive); exit 1 when a failed cell is left unexplained")
    p.add_argument("--report", type=path_arg, action="append", default=[],
                   help="with --derive: a conformance run's JSON report (repeatable)")
    p.add_argument("--doc", "--readme", dest="doc", type=path_arg, default=None, help=f"the doc (default {DOC})")
    args = p.parse_args(argv)
    if args.derive is not None:
        return derive(args.derive, args.report)
    if args.report:
        usage_error("--report is only read with --derive")
    readme_path = args.doc or DOC
    if args.doc is not None and not (args.update or args.check):
        usage_error("--doc is only read with --update-docs or --check")
    if args.update or args.check:
        # the doc is checked before any work: it exists, has the block, and can be written
        try:
            readme = readme_path.read_text(encoding="utf-8")
            start, end = readme_block(readme)
        except (OSError, ValueError) as e:
            usage_error(f"{readme_path}: {e}")
        if args.update:

            problem = file_problem(readme_path)
            if problem:
                usage_error(f"{readme_path}: {problem}")
    if args.repro is not None:
        problem = dir_problem(args.repro, REPRO_COMMAND)
        if problem:
            usage_error(f"--repro: {problem}")
        return write_repros(args.repro)
    if args.configs:
        sys.stdout.write(configs_text())
        return 0
    try:
        out = markdown() if (args.markdown or args.update or args.check) else text()
    except ValueError as e:  # a finding whose real config does not fit it: the data is wrong
        print(f"mpt-kv findings: {e}", file=sys.stderr)
        return 1
    if args.check:
        if readme[start:end] != "\n" + out:
            print(f"mpt-kv findings: the findings table in {readme_path} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        print(f"{readme_path}: the findings table is up to date")
        return 0
    if args.update:
        readme_path.write_text(readme[:start] + "\n" + out + readme[end:], encoding="utf-8")
        print(f"{readme_path}: findings table rewritten ({len(out.splitlines()) - 4} findings)")
        return 0
    sys.stdout.write(out)
    return 0
