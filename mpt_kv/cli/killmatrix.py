"""`python -m mpt_kv killmatrix`: the kill matrix (mpt_kv.catalogue.killmatrix) as text,
Markdown and JSON; exit status 0 when every variant is killed and the reference passes."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from mpt_kv import devices
from mpt_kv.catalogue.killmatrix import CASES, BUCKET, CHECKS, Cell, problems, run_matrix
from mpt_kv.catalogue.killmatrix import __doc__ as MATRIX_DOC
from mpt_kv.catalogue.variants import VARIANTS, Variant
from mpt_kv.cli.outputs import file_problem


def mark(variant: Variant | None, col: str, cell: Cell) -> str:
    """The cell text; '*' where the variant names this column as an expected killer."""
    expected = variant is not None and col in variant.killed_by
    return cell.result + ("*" if expected else "")


def table_rows(matrix: dict, checks: list[str]) -> list[list[str]]:
    rows = [["reference (must pass)", *[matrix["reference"][c].result for c in checks]]]
    for name, cells in matrix["variants"].items():
        v = VARIANTS.get(name)
        rows.append([name, *[mark(v, c, cells[c]) for c in checks]])
    return rows


def format_text(matrix: dict, checks: list[str]) -> str:
    rows = [["variant", *checks], *table_rows(matrix, checks)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(matrix: dict, checks: list[str], seconds: float) -> str:
    head = ["variant", "what is wrong", *checks]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out.append("| reference | (none: must pass every check) | " + " | ".join(matrix["reference"][c].result for c in checks) + " |")
    for name, cells in matrix["variants"].items():
        v = VARIANTS.get(name)
        out.append(f"| `{name}` | {v.bug if v else ''} | " + " | ".join(mark(v, c, cells[c]) for c in checks) + " |")
    out.append("")
    out.append(f"`*` marks the check each variant is expected to be killed by. {legend(checks, matrix)} "
               f"Regenerate with `python -m mpt_kv killmatrix --markdown FILE` ({seconds:.0f} s on CPU).")
    out.append("")
    out.append("Where each bug comes from:")
    out.append("")
    for name in matrix["variants"]:
        if name in VARIANTS:
            out.append(f"- `{name}`: {VARIANTS[name].origin}")
    return "\n".join(out) + "\n"


def legend(checks: list[str], matrix: dict) -> str:
    na = {c: cell.detail for c, cell in matrix["reference"].items() if cell.result == "n/a"}
    cases = "; ".join(c.describe() for c in CASES)
    text = (f"Cases (fp32): {cases}; paths concat, static, static with cache_idx buckets of {BUCKET}. "
            f"A kill is a check that raises on the variant: PropertyFailure (killed) or any other "
            f"exception (killed (error: type)).")
    return text + "".join(f" {c} n/a: {why}." for c, why in na.items())


def to_json(matrix: dict, checks: list[str], seconds: float) -> dict:
    return {
        "checks": checks,
        "cases": [c.describe() for c in CASES],
        "bucket": BUCKET,
        "seconds": round(seconds, 2),
        "reference": {c: vars(cell) for c, cell in matrix["reference"].items()},
        "variants": {
            name: {"bug": VARIANTS[name].bug, "origin": VARIANTS[name].origin,
                   "killed_by": list(VARIANTS[name].killed_by),
                   "killed": any(cell.killed for cell in cells.values()),
                   "cells": {c: vars(cell) for c, cell in cells.items()}}
            for name, cells in matrix["variants"].items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpt_kv killmatrix", description=MATRIX_DOC.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help=f"run only this variant (repeatable): {', '.join(VARIANTS)}")
    parser.add_argument("--check", action="append", default=[], metavar="NAME",
                        help=f"run only this column (repeatable): {', '.join(CHECKS)}")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the matrix as Markdown (for the README)")
    parser.add_argument("--json", metavar="FILE", help="also write the matrix, with each first failure, as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each kill's first failure")
    args = parser.parse_args(argv)

    unknown = [n for n in args.variant if n not in VARIANTS] + [n for n in args.check if n not in CHECKS]
    if unknown:
        print(f"unknown variant/check {unknown}: variants {list(VARIANTS)}, checks {list(CHECKS)}", file=sys.stderr)
        return 2
    try:
        kind = torch.device(args.device).type
    except RuntimeError as e:
        parser.error(f"--device {args.device!r} is not a torch device: {e}")
    reason = devices.unavailable_reason(kind) if kind in devices.KINDS else f"mpt-kv supports {devices.KINDS}"
    if not reason and kind == "cuda" and torch.device(args.device).index is not None \
            and torch.device(args.device).index >= torch.cuda.device_count():
        reason = f"only {torch.cuda.device_count()} cuda devices"
    if reason:  # a usage error, not "reference FAIL" for every check
        parser.error(f"--device {args.device} is not available here: {reason}")
    for flag, path in (("--markdown", args.markdown), ("--json", args.json)):
        problem = path and file_problem(path)
        if problem:
            parser.error(f"{flag} {path}: {problem}")
    variants = [VARIANTS[n] for n in (args.variant or VARIANTS)]
    checks = [c for c in CHECKS if not args.check or c in args.check]

    torch.set_num_threads(1)  # tiny tensors: more threads only contend (and make timings jump)
    start = time.perf_counter()
    matrix = run_matrix(variants, checks, args.device)
    seconds = time.perf_counter() - start

    print(f"kill matrix: {len(variants)} variants x {len(checks)} checks on {args.device}, fp32, "
          f"{len(CASES)} cases ({seconds:.1f} s)")
    print(format_text(matrix, checks))
    print("* = expected killer.", legend(checks, matrix))
    if args.verbose:
        for name, cells in [("reference", matrix["reference"]), *matrix["variants"].items()]:
            for c, cell in cells.items():
                if cell.detail:
                    print(f"  {name} / {c}: {cell.detail}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(matrix, checks, seconds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(matrix, checks, seconds), f, indent=1)

    ref_failures, bad = problems(matrix, checks)
    for msg in ref_failures + bad:
        print("FAIL:", msg, file=sys.stderr)
    if ref_failures:
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
