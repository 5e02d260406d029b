"""`python -m mpt_kv killmatrix`: the kill matrix (mpt_kv.catalogue.killmatrix) as text, Markdown
and JSON: the must-pass catalogue (reference and designs) and the must-kill catalogue (variants),
then the family catalogue's rows (mpt_kv.catalogue.family_catalogue) under the family checks, and the generate
catalogue's rows (mpt_kv.catalogue.generate_catalogue) under the generate columns (the generate check's modes).
Exit status: see mpt_kv.catalogue.killmatrix (0 all as expected, 1 a missed kill, 2 a false positive)."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from dataclasses import replace

import torch

from mpt_kv import devices, package_data
from mpt_kv.catalogue.family_catalogue import FAMILY_COLUMNS, FAMILY_DESIGNS, FAMILY_VARIANTS
from mpt_kv.catalogue.generate_catalogue import GENERATE_COLUMNS, GENERATE_DESIGNS, GENERATE_VARIANTS
from mpt_kv.catalogue.killmatrix import CASES, Cell, must_pass, problems, run_matrix_in, waiting
from mpt_kv.catalogue.killmatrix import __doc__ as MATRIX_DOC
from mpt_kv.catalogue.variants import COLUMNS, VARIANTS, Variant
from mpt_kv.cli import docblocks
from mpt_kv.outputs import clash_problem, file_problem

DOC = package_data.KILLMATRIX_DOC  # its block <!-- killmatrix:begin -->


def mark(variant, col: str, cell: Cell) -> str:
    """The cell text; '*' where the variant names this column as an expected killer."""
    expected = variant is not None and col in variant.killed_by
    return cell.result + ("*" if expected else "")


def variant_name(name: str, cells: dict) -> str:
    v = VARIANTS.get(name) or FAMILY_VARIANTS.get(name) or GENERATE_VARIANTS.get(name)
    return name + (" (waits)" if v is not None and waiting(v, cells) else "")


def table_rows(matrix: dict, checks: list[str]) -> list[list[str]]:
    rows = [["MUST PASS", *[""] * len(checks)]]
    rows += [[name, *[cells[c].result for c in checks]] for name, cells in matrix["must_pass"].items()]
    rows.append(["MUST BE KILLED", *[""] * len(checks)])
    rows += [[variant_name(name, cells), *[mark(VARIANTS.get(name), c, cells[c]) for c in checks]]
             for name, cells in matrix["must_kill"].items()]
    return rows


def family_table_rows(matrix: dict, checks: list[str]) -> list[list[str]]:
    rows = [["FAMILY MUST PASS", *[""] * len(checks)]]
    rows += [[f"{name} ({FAMILY_DESIGNS[name].family})", *[cells[c].result for c in checks]]
             for name, cells in matrix["family_must_pass"].items()]
    rows.append(["FAMILY MUST BE KILLED", *[""] * len(checks)])
    rows += [[f"{variant_name(name, cells)} ({FAMILY_VARIANTS[name].family})",
              *[mark(FAMILY_VARIANTS[name], c, cells[c]) for c in checks]]
             for name, cells in matrix["family_must_kill"].items()]
    return rows


def generate_table_rows(matrix: dict, checks: list[str]) -> list[list[str]]:
    rows = [["GENERATE MUST PASS", *[""] * len(checks)]]
    rows += [[f"{name} ({GENERATE_DESIGNS[name].path})", *[cells[c].result for c in checks]]
             for name, cells in matrix["generate_must_pass"].items()]
    rows.append(["GENERATE MUST BE KILLED", *[""] * len(checks)])
    rows += [[f"{variant_name(name, cells)} ({GENERATE_VARIANTS[name].path})",
              *[mark(GENERATE_VARIANTS[name], c, cells[c]) for c in checks]]
             for name, cells in matrix["generate_must_kill"].items()]
    return rows


def format_text(matrix: dict, checks: list[str], family_checks: list[str] = (), generate_checks: list[str] = ()) -> str:
    out = aligned([["", *checks], *table_rows(matrix, checks)])
    if matrix.get("family_must_pass") or matrix.get("family_must_kill"):
        out += "\n\n" + aligned([["", *family_checks], *family_table_rows(matrix, list(family_checks))])
    if matrix.get("generate_must_pass") or matrix.get("generate_must_kill"):
        out += "\n\n" + aligned([["", *generate_checks], *generate_table_rows(matrix, list(generate_checks))])
    return out


def aligned(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(matrix: dict, checks: list[str], seconds: float | None, family_checks: list[str] = (),
                    generate_checks: list[str] = ()) -> str:
    """The matrix as Markdown; `seconds` None: without the run's time (docs/catalogues.md's block,
    which --check-docs compares, must not change with the machine's speed)."""
    designs = must_pass()
    out = ["Must pass: the reference and legitimate designs (a FAIL is a false positive of that check).", "",
           "| design | what it does | " + " | ".join(checks) + " |", "|" + "---|" * (len(checks) + 2)]
    for name, cells in matrix["must_pass"].items():
        d = designs.get(name)
        out.append(f"| `{name}` | {d.what if d else ''} | " + " | ".join(cells[c].result for c in checks) + " |")
    out += ["", "Must be killed: known-bad variants (`*`: the check expected to kill it).", "",
            "| variant | what is wrong | " + " | ".join(checks) + " |", "|" + "---|" * (len(checks) + 2)]
    for name, cells in matrix["must_kill"].items():
        v = VARIANTS.get(name)
        out.append(f"| `{variant_name(name, cells)}` | {v.bug if v else ''} | "
                   + " | ".join(mark(v, c, cells[c]) for c in checks) + " |")
    regenerate = ("`python -m mpt_kv killmatrix --update-docs` (`--check-docs`: exit 1 when this block is stale)"
                  if seconds is None else f"`python -m mpt_kv killmatrix --markdown FILE` ({seconds:.0f} s on CPU)")
    out += ["", f"{legend(matrix)} Regenerate with {regenerate}.", ""]
    _, _, notes = problems(matrix)
    if notes:
        out += ["Waiting for a check this build lacks (reported, not failed):", ""]
        out += [f"- {n}" for n in notes] + [""]
    out += ["Where each design comes from:", ""]
    out += [f"- `{name}`: {designs[name].origin}" for name in matrix["must_pass"] if name in designs]
    out += ["", "Where each bug comes from:", ""]
    out += [f"- `{name}`: {VARIANTS[name].origin}" for name in matrix["must_kill"] if name in VARIANTS]
    if matrix.get("family_must_pass") or matrix.get("family_must_kill"):
        out += ["", *family_markdown(matrix, list(family_checks))]
    if matrix.get("generate_must_pass") or matrix.get("generate_must_kill"):
        out += ["", *generate_markdown(matrix, list(generate_checks))]
    return "\n".join(out) + "\n"


FAMILY_LEGEND = ("Family rows (`mpt_kv/catalogue/family_catalogue.py`): transformers 5.x's implementation of a zoo "
                 "family with one change, under the family checks, on cpu, with their own fixed drive (a left-padded "
                 "batch of 2, a prompt of 6, decode steps and a 3-token call, unpadded in family-P1 of a row with sdpa "
                 "attention; family-ops' beam and assisted programs); family-P2 on the static path (against the concat "
                 "path), the other columns on the row's path.")


def row_where(e) -> str:
    """A family row's family/variant and path, with its attention implementation where it names one."""
    return f"{e.family}/{e.variant}, {e.path}" + (f", {e.attention}" if e.attention else "")


def family_markdown(matrix: dict, checks: list[str]) -> list[str]:
    head = " | ".join(checks)
    out = [FAMILY_LEGEND, "", "| design | family/variant, path | what it does | " + head + " |",
           "|" + "---|" * (len(checks) + 3)]
    for name, cells in matrix["family_must_pass"].items():
        e = FAMILY_DESIGNS[name]
        out.append(f"| `{name}` | {row_where(e)} | {e.why} | "
                   + " | ".join(cells[c].result for c in checks) + " |")
    out += ["", "| variant | family/variant, path | what is wrong | " + head + " |", "|" + "---|" * (len(checks) + 3)]
    for name, cells in matrix["family_must_kill"].items():
        e = FAMILY_VARIANTS[name]
        out.append(f"| `{variant_name(name, cells)}` | {row_where(e)} | {e.why} | "
                   + " | ".join(mark(e, c, cells[c]) for c in checks) + " |")
    unsupported = {f"{name} / {c}: {cell.detail}" for kind in ("family_must_pass", "family_must_kill")
                   for name, cells in matrix[kind].items() for c, cell in cells.items() if cell.result == "unsupported"}
    if unsupported:
        out += ["", "Unsupported (the implementation lacks what the check drives):", ""]
        out += [f"- {line}" for line in sorted(unsupported)]
    out += ["", "Where each family design and variant comes from:", ""]
    out += [f"- `{name}`: {FAMILY_DESIGNS[name].origin}" for name in matrix["family_must_pass"]]
    out += [f"- `{name}`: {FAMILY_VARIANTS[name].origin}" for name in matrix["family_must_kill"]]
    return out


def legend(matrix: dict) -> str:
    cases = "; ".join(f"{mc.case.describe()}, bucket {mc.bucket}"
                      + ("" if mc.columns == COLUMNS else f" ({', '.join(mc.columns)} only)") for mc in CASES)
    na = {c: cell.detail for cells in matrix["must_pass"].values() for c, cell in cells.items() if cell.result == "n/a"}
    return (f"Cases (fp32; a row whose entry says 'a bfloat16 row' runs in bfloat16): {cases}; paths concat, static, static with the case's cache_idx bucket. A kill is a "
            f"check that raises: PropertyFailure (killed / FAIL) or any other exception (killed / FAIL (error: type)); "
            f"(waits): the variant's killer is a check feature this build lacks."
            + "".join(f" {c} n/a: {why}." for c, why in na.items()))


GENERATE_LEGEND = ("Generate rows (`mpt_kv/catalogue/generate_catalogue.py`): transformers 5.x's MPT driven by its own "
                   "generate with one change to its generation methods (the forward, attention and cache classes "
                   "unchanged), on cpu, under the generate check of each mode (greedy, beam, prompt-lookup, draft) on "
                   "the row's path: every forward call generate makes observed (docs/generate.md). The base crops by "
                   "copying (`crop_copies`): transformers 5.24's own slice is a known failure.")


def generate_markdown(matrix: dict, checks: list[str]) -> list[str]:
    head = " | ".join(checks)
    out = [GENERATE_LEGEND, "", "| design | path | what it does | " + head + " |", "|" + "---|" * (len(checks) + 3)]
    for name, cells in matrix["generate_must_pass"].items():
        e = GENERATE_DESIGNS[name]
        out.append(f"| `{name}` | {e.path} | {e.why} | " + " | ".join(cells[c].result for c in checks) + " |")
    out += ["", "| variant | path | what is wrong | " + head + " |", "|" + "---|" * (len(checks) + 3)]
    for name, cells in matrix["generate_must_kill"].items():
        e = GENERATE_VARIANTS[name]
        out.append(f"| `{variant_name(name, cells)}` | {e.path} | {e.why} | "
                   + " | ".join(mark(e, c, cells[c]) for c in checks) + " |")
    skipped = {f"{name} / {c}: {cell.detail}" for kind in ("generate_must_pass", "generate_must_kill")
               for name, cells in matrix[kind].items() for c, cell in cells.items()
               if cell.result in ("n/a", "unsupported")}
    if skipped:
        out += ["", "Not run (n/a) or unsupported:", ""] + [f"- {line}" for line in sorted(skipped)]
    out += ["", "Where each generate design and variant comes from:", ""]
    out += [f"- `{name}`: {GENERATE_DESIGNS[name].origin}" for name in matrix["generate_must_pass"]]
    out += [f"- `{name}`: {GENERATE_VARIANTS[name].origin}" for name in matrix["generate_must_kill"]]
    return out


def to_json(matrix: dict, checks: list[str], seconds: float, family_checks: list[str] = (),
            generate_checks: list[str] = ()) -> dict:
    designs = must_pass()
    return {
        "checks": checks,
        "cases": [{"case": mc.case.describe(), "bucket": mc.bucket, "reaches": mc.reaches,
                   "columns": list(mc.columns)} for mc in CASES],
        "seconds": round(seconds, 2),
        "must_pass": {name: {"what": designs[name].what if name in designs else "",
                             "origin": designs[name].origin if name in designs else "",
                             "passed": not any(cell.result.startswith("FAIL") for cell in cells.values()),
                             "cells": {c: vars(cell) for c, cell in cells.items()}}
                      for name, cells in matrix["must_pass"].items()},
        "must_kill": {name: {"bug": VARIANTS[name].bug if name in VARIANTS else "",
                             "origin": VARIANTS[name].origin if name in VARIANTS else "",
                             "killed_by": list(VARIANTS[name].killed_by) if name in VARIANTS else [],
                             "waits_for": waiting(VARIANTS[name], cells) if name in VARIANTS else "",
                             "killed": any(cell.killed for cell in cells.values()),
                             "cells": {c: vars(cell) for c, cell in cells.items()}}
                      for name, cells in matrix["must_kill"].items()},
        "family_checks": list(family_checks),
        "family_must_pass": {name: {"family": FAMILY_DESIGNS[name].family, "variant": FAMILY_DESIGNS[name].variant,
                                    "path": FAMILY_DESIGNS[name].path, "what": FAMILY_DESIGNS[name].why,
                                    "origin": FAMILY_DESIGNS[name].origin,
                                    "passed": not any(cell.result.startswith("FAIL") for cell in cells.values()),
                                    "cells": {c: vars(cell) for c, cell in cells.items()}}
                             for name, cells in matrix.get("family_must_pass", {}).items()},
        "family_must_kill": {name: {"family": FAMILY_VARIANTS[name].family, "variant": FAMILY_VARIANTS[name].variant,
                                    "path": FAMILY_VARIANTS[name].path, "bug": FAMILY_VARIANTS[name].why,
                                    "origin": FAMILY_VARIANTS[name].origin,
                                    "killed_by": list(FAMILY_VARIANTS[name].killed_by),
                                    "waits_for": waiting(FAMILY_VARIANTS[name], cells),
                                    "killed": any(cell.killed for cell in cells.values()),
                                    "cells": {c: vars(cell) for c, cell in cells.items()}}
                             for name, cells in matrix.get("family_must_kill", {}).items()},
        "generate_checks": list(generate_checks),
        "generate_must_pass": {name: {"path": GENERATE_DESIGNS[name].path, "what": GENERATE_DESIGNS[name].why,
                                      "origin": GENERATE_DESIGNS[name].origin,
                                      "passed": not any(cell.result.startswith("FAIL") for cell in cells.values()),
                                      "cells": {c: vars(cell) for c, cell in cells.items()}}
                               for name, cells in matrix.get("generate_must_pass", {}).items()},
        "generate_must_kill": {name: {"path": GENERATE_VARIANTS[name].path, "bug": GENERATE_VARIANTS[name].why,
                                      "origin": GENERATE_VARIANTS[name].origin,
                                      "killed_by": list(GENERATE_VARIANTS[name].killed_by),
                                      "waits_for": waiting(GENERATE_VARIANTS[name], cells),
                                      "killed": any(cell.killed for cell in cells.values()),
                                      "cells": {c: vars(cell) for c, cell in cells.items()}}
                               for name, cells in matrix.get("generate_must_kill", {}).items()},
    }


def with_progress(rows: list, variants: list[Variant], start: float) -> tuple[list, list[Variant]]:
    """The same rows, each of whose factory prints one line to stderr the first time it is built
    (the matrix runs row by row, so that is when its row starts): about 30 s otherwise silent.
    The reference row, always first, keeps its own factory (the matrix shares it as the oracle)."""
    designs = [d for d in rows if d.name != "reference"]
    total = 1 + len(designs) + len(variants)
    print(f"killmatrix: {total} rows; reference first", file=sys.stderr, flush=True)

    def announced(row, kind: str, number: int):
        said = []

        def build(*args, **kwargs):
            if not said:
                said.append(True)
                print(f"killmatrix: [{number}/{total}] {kind} {row.name} "
                      f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
            return row.build(*args, **kwargs)

        return replace(row, build=build)

    # a row's number is its place in the matrix, whichever process runs it (--jobs)
    return ([d for d in rows if d.name == "reference"]
            + [announced(d, "must-pass design", 2 + i) for i, d in enumerate(designs)],
            [announced(v, "must-kill variant", 2 + len(designs) + i) for i, v in enumerate(variants)])


def main(argv: list[str] | None = None) -> int:
    designs = must_pass()
    parser = argparse.ArgumentParser(prog="python -m mpt_kv killmatrix", description=MATRIX_DOC.split("\n\n")[0])
    parser.add_argument("--design", action="append", default=[], metavar="NAME",
                        help=f"run only this must-pass design (repeatable; the reference always runs): "
                             f"{', '.join([*designs, *FAMILY_DESIGNS, *GENERATE_DESIGNS])}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help=f"run only this must-kill variant (repeatable): "
                             f"{', '.join([*VARIANTS, *FAMILY_VARIANTS, *GENERATE_VARIANTS])}")
    parser.add_argument("--check", action="append", default=[], metavar="NAME",
                        help=f"run only this column (repeatable): {', '.join([*COLUMNS, *FAMILY_COLUMNS])}, generate "
                             "(the generate columns, one per mode), or one of "
                             f"{', '.join(GENERATE_COLUMNS)} (the family columns run the family rows only, the "
                             "generate ones the generate rows)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the matrix as Markdown")
    docs = parser.add_mutually_exclusive_group()
    docs.add_argument("--update-docs", action="store_true", help=f"rewrite the matrix block of {DOC} (a full run)")
    docs.add_argument("--check-docs", action="store_true", help=f"exit 1 if the matrix block of {DOC} is not this run's")
    parser.add_argument("--json", metavar="FILE", help="also write the matrix, with each first failure, as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each kill's and failure's first message")
    parser.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                        help="run the rows in N processes on cpu (default 1; .ci/run uses 2, one per core): the same "
                             "matrix, each process building the reference again")
    args = parser.parse_args(argv)

    unknown = ([n for n in args.design if n not in designs and n not in FAMILY_DESIGNS and n not in GENERATE_DESIGNS]
               + [n for n in args.variant if n not in VARIANTS and n not in FAMILY_VARIANTS
                  and n not in GENERATE_VARIANTS]
               + [n for n in args.check if n not in COLUMNS and n not in FAMILY_COLUMNS and n != "generate"
                  and n not in GENERATE_COLUMNS])
    if unknown:
        print(f"unknown design/variant/check {unknown}: designs {list(designs)}, family designs "
              f"{list(FAMILY_DESIGNS)}, generate designs {list(GENERATE_DESIGNS)}, variants {list(VARIANTS)}, family "
              f"variants {list(FAMILY_VARIANTS)}, generate variants {list(GENERATE_VARIANTS)}, checks {list(COLUMNS)}, "
              f"family checks {list(FAMILY_COLUMNS)}, generate checks generate or {list(GENERATE_COLUMNS)}",
              file=sys.stderr)
        return 2
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more processes")
    try:
        kind = torch.device(args.device).type
    except RuntimeError as e:
        parser.error(f"--device {args.device!r} is not a torch device: {e}")
    reason = devices.unavailable_reason(kind) if kind in devices.KINDS else f"mpt-kv supports {devices.KINDS}"
    index = torch.device(args.device).index
    if not reason and index is not None:
        count = {"cpu": 1, "cuda": torch.cuda.device_count() if kind == "cuda" else 0}.get(kind)
        if count is not None and index >= count:
            reason = ("cpu is one device (cpu or cpu:0)" if kind == "cpu" else
                      f"only {count} cuda devices (cuda:0..cuda:{count - 1})")
    if reason:  # a usage error, not "reference FAIL" for every check
        parser.error(f"--device {args.device} is not available here: {reason}")
    for flag, path in (("--markdown", args.markdown), ("--json", args.json)):
        problem = path is not None and file_problem(path)
        if problem:
            parser.error(f"{flag} {path}: {problem}")
    problem = clash_problem([("--markdown", args.markdown), ("--json", args.json)],
                            [("the kill matrix's doc", DOC)] if args.update_docs or args.check_docs else [])
    if problem:
        parser.error(problem)
    if (args.update_docs or args.check_docs) and (args.design or args.variant or args.check or kind != "cpu"):
        parser.error("--update-docs and --check-docs compare the whole matrix on cpu: name no --design, --variant, "
                     "--check or other --device")
    if args.update_docs or args.check_docs:
        try:
            doc_text, doc_start, doc_end = docblocks.read_block(DOC, "killmatrix")
        except (OSError, ValueError) as e:
            parser.error(f"{DOC}: {e}")
        problem = args.update_docs and file_problem(str(DOC))
        if problem:
            parser.error(f"{DOC}: {problem}")
    chosen = args.design or args.variant  # naming some rows runs only those (and the reference)
    rows = [designs[n] for n in (args.design if chosen else designs) if n in designs]
    variants = [VARIANTS[n] for n in (args.variant if chosen else VARIANTS) if n in VARIANTS]
    checks = [c for c in COLUMNS if not args.check or c in args.check]
    family_checks = [c for c in FAMILY_COLUMNS if not args.check or c in args.check]
    # the family rows run where a family column does (on cpu: the family rows run there, whatever --device)
    family_designs = [FAMILY_DESIGNS[n] for n in (args.design if chosen else FAMILY_DESIGNS)
                      if n in FAMILY_DESIGNS] if family_checks else []
    family_variants = [FAMILY_VARIANTS[n] for n in (args.variant if chosen else FAMILY_VARIANTS)
                       if n in FAMILY_VARIANTS] if family_checks else []
    if not (family_designs or family_variants):
        family_checks = []
    generate_checks = [c for c in GENERATE_COLUMNS if not args.check or c in args.check or "generate" in args.check]
    generate_designs = [GENERATE_DESIGNS[n] for n in (args.design if chosen else GENERATE_DESIGNS)
                        if n in GENERATE_DESIGNS] if generate_checks else []
    generate_variants = [GENERATE_VARIANTS[n] for n in (args.variant if chosen else GENERATE_VARIANTS)
                         if n in GENERATE_VARIANTS] if generate_checks else []
    if not (generate_designs or generate_variants):
        generate_checks = []
    if not checks:  # only family or generate columns named: no MPT row (the reference stays, with no column)
        rows, variants = [], []

    torch.set_num_threads(1)  # tiny tensors: more threads only contend (and make timings jump)
    start = time.perf_counter()
    rows, variants = with_progress(rows, variants, start)
    if family_checks:
        print(f"killmatrix: and {len(family_designs) + len(family_variants)} family rows x {len(family_checks)} "
              "family checks (cpu)", file=sys.stderr, flush=True)
    if generate_checks:
        print(f"killmatrix: and {len(generate_designs) + len(generate_variants)} generate rows x "
              f"{len(generate_checks)} generate checks (cpu)", file=sys.stderr, flush=True)
    matrix = run_matrix_in(args.jobs, rows, variants, checks, args.device, torch.float32, family_designs,
                           family_variants, family_checks, generate_designs, generate_variants, generate_checks)
    seconds = time.perf_counter() - start

    print(f"kill matrix: {len(matrix['must_pass'])} must-pass rows and {len(variants)} must-kill variants x "
          f"{len(checks)} checks on {args.device}, fp32, {len(CASES)} cases; {len(family_designs)} family must-pass "
          f"rows and {len(family_variants)} family must-kill variants x {len(family_checks)} family checks on cpu; "
          f"{len(generate_designs)} generate must-pass rows and {len(generate_variants)} generate must-kill variants "
          f"x {len(generate_checks)} generate checks on cpu ({seconds:.1f} s)")
    print(format_text(matrix, checks, family_checks, generate_checks))
    print("* = expected killer.", legend(matrix))
    if args.verbose:
        for name, cells in [*matrix["must_pass"].items(), *matrix["must_kill"].items(),
                            *matrix["family_must_pass"].items(), *matrix["family_must_kill"].items(),
                            *matrix["generate_must_pass"].items(), *matrix["generate_must_kill"].items()]:
            for c, cell in cells.items():
                if cell.detail:
                    print(f"  {name} / {c}: {cell.detail}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(matrix, checks, seconds, family_checks, generate_checks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(matrix, checks, seconds, family_checks, generate_checks), f, indent=1)

    stale = False
    if args.update_docs or args.check_docs:
        block = format_markdown(matrix, checks, None, family_checks, generate_checks)
        if args.update_docs:
            docblocks.rewrite(DOC, doc_text, doc_start, doc_end, block)
            print(f"{DOC}: kill matrix block rewritten")
        elif not docblocks.is_current(doc_text, doc_start, doc_end, block):
            stale = True
            print(f"FAIL: the kill matrix in {DOC} is not this run's: run python -m mpt_kv killmatrix --update-docs",
                  file=sys.stderr)
            # which lines differ, so a reviewer sees the cells that moved, not only that some did
            diff = difflib.unified_diff(doc_text[doc_start:doc_end].lstrip("\n").splitlines(), block.splitlines(),
                                        f"{DOC} (committed)", "this run", lineterm="", n=0)
            for line in list(diff)[:40]:
                print(line, file=sys.stderr)
    false_positives, missed, notes = problems(matrix)
    for msg in notes:
        print("WAITING:", msg)
    for msg in false_positives + missed:
        print("FAIL:", msg, file=sys.stderr)
    if false_positives:
        return 2
    return 1 if missed or stale else 0


if __name__ == "__main__":
    sys.exit(main())
