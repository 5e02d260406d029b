"""The kill matrix: every check against both catalogues.

    python -m mpt_kv killmatrix [--design NAME ...] [--variant NAME ...] [--check NAME ...]
                                [--markdown FILE] [--json FILE]

Rows: the must-pass catalogue (the reference and the legitimate designs of designs.py) and the
must-kill catalogue (the known-bad variants of variants.py). Columns: P0-P4 (properties.py; P4,
the output-reuse check, is "n/a" in a build that lacks it), static-shape (static_shape.py),
graph-capture (capture.py), memory (ceilings.check_memory) and ops. Each column runs over fixed,
deterministic cases (`CASES`) and its cache paths (concat, static, static with the case's cache_idx
bucket), fp32 (or the row's own `dtype`, for an entry that differs from the reference only below
fp32), CPU by default. Each case names the columns that run it, to keep the matrix fast: the long
case runs the value columns (P0-P2) only; the memory column (the costliest: an exact byte count of
every op) runs the first case with 4 layers (its bounds are per layer: 2 layers cannot tell one layer's
bf16 upcast from a whole-cache copy), graph-capture (a compile per row) and static-shape the first
case, static-shape the wide one too.

Family rows (`mpt_kv.catalogue.family_catalogue`): the must-pass designs and must-kill variants of
the Gaudi zoo's cache designs (sliding windows, hybrid static caches, latent attention, mixtures of
experts), each transformers 5.x's implementation of one family with one change, under the family
checks' columns (`FAMILY_COLUMNS`: family-P1, family-P2, family-P3, family-memory, family-ops), on
cpu, on the row's cache path (family-P2 on the static path, against the concat path), with the
family checks' own fixed drive (`mpt_kv.checks.family_driver`), not `CASES`. Where transformers 5.x
is not installed their cells are "n/a" with the reason (their variants wait).

Generate rows (`mpt_kv.catalogue.generate_catalogue`): must-pass designs and must-kill variants of the half
of the cache that lives in `generate`, each transformers 5.x's MPT driven by its own generate with one change
to its generation methods, under the generate columns (`GENERATE_COLUMNS`: greedy, beam, prompt-lookup,
draft, chunked, contrastive, multi-turn: the generate check of that mode, `mpt_kv.checks.generate`), on cpu, on the
row's cache path (contrastive: n/a on every row, which transformers 5.x runs from the Hub only).

A kill is a check that raises: `PropertyFailure` is "killed", any other exception "killed (error:
ExcType)" (the variant crashes, which a user would see too). A column stops at its first kill.
On a must-pass row the same outcomes read "FAIL" and "FAIL (error: ExcType)". A case the target
declares unsupported (`Capabilities`) is skipped; a column where every case was is "unsupported".

Exit status:
  (the family rows and the generate rows by the same rules)
  0  every must-pass row passes, every variant is killed by the columns it names (where those
     exist in this build), or waits, as declared, for a check feature this build lacks
  1  a variant survived (a missing or weak test), an expected killer missed it, or a waiting
     variant is now killed by its expected killer (drop its `waits_for`, as for a strict xfail)
  2  a must-pass row failed a check (a false positive: fix the check, not the design), or bad
     arguments
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from dataclasses import dataclass

import torch

from mpt_kv.catalogue import family_catalogue, generate_catalogue
from mpt_kv.catalogue.designs import DESIGNS, Design
from mpt_kv.catalogue.family_catalogue import FAMILY_VARIANTS, FamilyEntry
from mpt_kv.catalogue.generate_catalogue import GENERATE_VARIANTS, GenerateEntry
from mpt_kv.catalogue.variants import COLUMNS, VARIANTS, Variant
from mpt_kv.checks import index, programs, running
from mpt_kv.checks.cases import Case
from mpt_kv.checks.registry import Check, path_label
from mpt_kv.errors import PropertyFailure, Unsupported
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets import resolve_target
from mpt_kv.targets.reference import build


@dataclass(frozen=True)
class MatrixCase:
    case: Case
    bucket: int                 # cache_idx bucket of the bucketed static path
    reaches: str                # what the case is there for
    columns: tuple[str, ...] = COLUMNS  # the columns that run it (the costly ones run where they matter)


def bool_mask(case: Case) -> Case:
    """The case with a bool attention mask, where `Case` carries a mask dtype (issue 12.4, the value
    checks' side); the case as it is in a build without one."""
    if "mask_dtype" not in {f.name for f in dataclasses.fields(Case)}:
        return case
    return dataclasses.replace(case, mask_dtype=torch.bool)


VALUES = ("P0", "P1", "P2")
PROPERTIES = ("P0", "P1", "P2", "P3", "P4")

FIRST = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32), (5, 3), 5, seed=1)
NOT_MEMORY = tuple(c for c in COLUMNS if c != "memory")

CASES = (
    MatrixCase(FIRST, 4, "3 heads (ALiBi slopes of a non-power of two), left padding, decode steps at and before a "
                         "bucket boundary (cache_idx 8 and 10)", NOT_MEMORY),
    # memory's bounds are per layer: with 2 layers one layer's bf16 upcast allowance is a whole cache, so a
    # step that copies the whole cache passes; 4 layers separate them (as ceilings.SHAPE)
    MatrixCase(dataclasses.replace(FIRST, cfg=dataclasses.replace(FIRST.cfg, n_layers=4)), 4,
               "the first case with 4 layers: a whole-cache copy is twice one layer's bf16 upcast allowance",
               ("memory",)),
    MatrixCase(bool_mask(Case(ModelConfig(d_model=16, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=32,
                                            clip_qkv=0.5), (6, 2, 4), 4, seed=2)),
               4, "clip_qkv small enough to clamp most of mixed_qkv; three rows, two padded; a bool mask", PROPERTIES),
    MatrixCase(Case(ModelConfig(d_model=16, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=16), (1,), 3, seed=3),
               4, "a one-token, one-row prompt: its k, v slices of mixed_qkv are already contiguous", PROPERTIES),
    MatrixCase(Case(ModelConfig(d_model=64, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=24), (18, 11), 6, seed=4),
               8, "head_dim 32 (fused kernels' sizes; MPT-7B has 128), decode past 16 positions, the last slot at "
                  "max_seq_len", (*PROPERTIES, "static-shape")),
    MatrixCase(Case(ModelConfig(d_model=32, n_heads=1, n_layers=1, vocab_size=64, max_seq_len=258), (254, 129), 4,
                      seed=5),
               128, "prompts past 128, decode across position 256 (bf16 positions, the bucket boundary of 128) to "
                    "max_seq_len", VALUES),
    MatrixCase(Case(ModelConfig(d_model=32, n_heads=16, n_layers=4, vocab_size=64, max_seq_len=9, alibi_bias_max=16,
                                  layer_norm_epsilon=1e-3), (6, 6, 2, 2), 3, seed=6),
               4, "a batch of 4 (2 prompts x 2 beams, unequal padding), 4 layers, 16 heads, alibi_bias_max 16, "
                  "layer_norm_epsilon 1e-3 (a config field an adapter drops shows in P0: issue 17, bugs past the "
                  "drawn ranges; short, so cheap)", ("P0", "P1")),
    MatrixCase(Case(ModelConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=67), (65,), 2, seed=7),
               4, "a prompt past 64 tokens (a path chosen by prompt length), one row, one layer", ("P3",)),
)


def paths(prop: index.Property, bucket: int) -> list[tuple[str | None, int | None]]:
    """(path, bucket) pairs of a property's index paths, with the case's cache_idx bucket."""
    out = []
    for label in prop.paths:
        out.append((None, None) if not label else ("static", bucket) if label == "static+bucket" else (label, None))
    return out


def inputs(prop: index.Property, mc: MatrixCase, bucket: int | None) -> list[dict]:
    """What one property runs on one matrix case, as Context fields: the case itself; for the program
    checks the fixed beam and speculative programs (programs.FIXED) on the case's model, then the
    corner program on its own (batch 1, one head, one layer, a prompt of 1: `programs.corner_program`);
    for ops-memory one reorder, for ops-retained one reorder and one crop, on a filled cache of the
    case's model (`programs.MEMORY_CASE`) and then on the corner (`programs.MEMORY_CORNER`), on the
    unbucketed paths (a bucket changes only the slack, not what an operation copies or keeps)."""
    if prop.runs == "program":
        fixed = [programs.Program(dataclasses.replace(f.case, cfg=mc.case.cfg), f.ops, f.style)
                 for f in programs.FIXED.values()]
        corner = programs.corner_program(set(programs.OPERATIONS))
        return [{"case": p.case, "program": p} for p in [*fixed, corner] if p is not None]
    if prop.runs == "operation":
        ops = ("reorder",) if prop.name == "ops-memory" else prop.operations  # ops-memory: the reorder transient
        cases = (dataclasses.replace(programs.MEMORY_CASE, cfg=mc.case.cfg), programs.MEMORY_CORNER)
        return [] if bucket is not None else [{"case": case, "operation": op} for case in cases for op in ops]
    return [{"case": mc.case}]


def reference_build(cfg, state_dict, device, dtype):
    return build(cfg, state_dict, device, dtype)


REFERENCE = Design("reference", "the oracle itself", "mpt_kv/model/reference.py", reference_build)


def must_pass() -> dict[str, Design]:
    return {"reference": REFERENCE, **DESIGNS}


@dataclass
class Cell:
    result: str          # "killed" | "killed (error: X)" | "survived" | "n/a" | "unsupported"
    detail: str = ""     # the first failure's message, or why n/a / unsupported

    @property
    def killed(self) -> bool:
        return self.result.startswith("killed")


# Columns this build lacks, with why (a column a variant names before its check is in the build: its
# cells read "n/a", and a variant only it can kill waits, as declared by `Variant.waits_for`).
UNAVAILABLE: dict[str, str] = {}


def unavailable(column: str) -> str | None:
    return UNAVAILABLE.get(column) or (None if column in COLUMNS else f"no column {column!r} in this build")


def run_column(column: str, build, name: str, device, dtype, runners: dict) -> Cell:
    """Run one column (its properties of the index, in index order) over every case and path until
    the first failure, through the run layer (`mpt_kv.checks.running.Run`: the context, the oracles,
    the property's function), on runners built once per case (`runners_for`); each input read by
    `reading`, the column "unsupported" when no input ran."""
    reason = unavailable(column)
    if reason:
        return Cell("n/a", reason)
    target = resolve_target(build)
    ran, skipped = 0, ""
    for mc in CASES:
        if column not in mc.columns:
            continue
        for prop in index.of_column(column):
            for path, bucket in paths(prop, mc.bucket):
                check = Check(f"{prop.name}/{path_label(path, bucket)}", prop.name, path, bucket)
                for fields in inputs(prop, mc, bucket):
                    case = fields.pop("case")

                    def one(case=case, fields=fields, path=path, bucket=bucket, check=check):
                        # the corner cases have their own model; every other input runs on the matrix case's,
                        # with the weights its oracles are built from (the case's seed: a bf16 row's fp32 twin)
                        shared = case.cfg == mc.case.cfg and case.seed == mc.case.seed
                        runner = runners_for(target, mc.case if shared else case, device, dtype, runners)
                        runner.require(path, "bucket" if bucket else None, dtype_feature(dtype), device.type)
                        run = running.Run(check, target, device, dtype)
                        run.check_case(runner, run.context(case, **fields))

                    cell = reading(one, f"{case.describe()}, path={path}, bucket={bucket}")
                    if cell.killed:
                        return cell
                    if cell.result == "unsupported":
                        skipped = cell.detail
                    else:
                        ran += 1
    return Cell("survived") if ran else Cell("unsupported", skipped)


def run_family_column(column: str, entry: FamilyEntry, dtype: torch.dtype = torch.float32) -> Cell:
    """One family column on one family row: its family check (by property) on the entry's
    implementation and path (family-P2: static), the entry's patch applied around it, on cpu, in
    `dtype` (the matrix's fp32; tests/test_family_catalogue.py runs bf16 too), read by `reading`."""
    reason = family_catalogue.unavailable()
    if reason:
        return Cell("n/a", reason)
    return reading(lambda: family_catalogue.run(entry, column, dtype=dtype),
                   f"{entry.family}/{entry.variant}, path={entry.path}")


def run_generate_column(column: str, entry: GenerateEntry) -> Cell:
    """One generate column (a mode) on one generate row: the generate check of that mode on the row's path,
    on its factory (cpu, float32), read by `reading`. A mode the row does not run, or a build
    without transformers 5.x, reads "n/a" with the reason."""
    reason = generate_catalogue.unavailable() or entry.skipped(column)
    if reason:
        return Cell("n/a", reason)
    return reading(lambda: generate_catalogue.run(entry, column), f"{entry.name}, path={entry.path}, mode={column}")


def reading(call, where: str) -> Cell:
    """The one rule by which every kill-matrix cell (MPT, family and generate rows alike) reads a check's
    outcome: a PropertyFailure is "killed"; any other exception a kill too, reported as such ("killed (error:
    X)", naming `where`); `Unsupported` (a pytest skip: not an Exception) "unsupported"; a return "survived"."""
    try:
        call()
    except Unsupported as e:
        return Cell("unsupported", str(e.msg))
    except PropertyFailure as e:
        return Cell("killed", first_line(e))
    except Exception as e:  # noqa: BLE001  a crash is a kill too, reported as such
        return Cell(f"killed (error: {type(e).__name__})", f"{type(e).__name__}: {first_line(e)} [{where}]")
    return Cell("survived")


def dtype_feature(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def runners_for(target, case, device, dtype, cache: dict):
    """The target's runner for a case, built once and reused across columns (so a runner sees
    several generations, as a served model does)."""
    key = (target.factory, case)
    if key not in cache:
        cache[key] = target.build(case.cfg, random_state_dict(case.cfg, seed=case.seed), device, dtype)
    return cache[key]


def first_line(e: BaseException, limit: int = 400) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[:limit] + " ..."


def as_must_pass(cell: Cell) -> Cell:
    """A must-pass row's reading of a cell: survived = pass, killed = FAIL."""
    if cell.result == "survived":
        return Cell("pass")
    if cell.killed:
        return Cell("FAIL" + cell.result[len("killed"):], cell.detail)
    return cell


def run_matrix(designs: list[Design], variants: list[Variant], checks: list[str], device="cpu",
               dtype=torch.float32, family_designs: list[FamilyEntry] = (), family_variants: list[FamilyEntry] = (),
               family_checks: list[str] = (), generate_designs: list[GenerateEntry] = (),
               generate_variants: list[GenerateEntry] = (), generate_checks: list[str] = ()) -> dict:
    """{"must_pass": {name: {check: Cell}}, "must_kill": {name: {check: Cell}}, "family_must_pass": ...,
    "family_must_kill": ...} (the family rows under `family_checks`, on cpu). The reference is always
    the first must-pass row."""
    device = torch.device(device)
    runners: dict = {}
    rows = [REFERENCE] + [d for d in designs if d.name != "reference"]
    # a row that names its own dtype (a design or bug that exists only below float32) runs in it
    passing = {d.name: {c: as_must_pass(run_column(c, d.build, d.name, device, d.dtype or dtype, runners))
                        for c in checks} for d in rows}
    killing = {v.name: {c: run_column(c, v.build, v.name, device, v.dtype or dtype, runners) for c in checks}
               for v in variants}
    family_passing = {e.name: {c: as_must_pass(run_family_column(c, e)) for c in family_checks} for e in family_designs}
    family_killing = {e.name: {c: run_family_column(c, e) for c in family_checks} for e in family_variants}
    generate_passing = {e.name: {c: as_must_pass(run_generate_column(c, e)) for c in generate_checks}
                        for e in generate_designs}
    generate_killing = {e.name: {c: run_generate_column(c, e) for c in generate_checks} for e in generate_variants}
    return {"must_pass": passing, "must_kill": killing, "family_must_pass": family_passing,
            "family_must_kill": family_killing, "generate_must_pass": generate_passing,
            "generate_must_kill": generate_killing}


_SHARES: list = []  # each forked process's rows (set before the fork: the rows' builds are closures, not picklable)


def _run_share(i: int) -> dict:
    return run_matrix(*_SHARES[i])


def run_matrix_in(jobs: int, designs: list[Design], variants: list[Variant], checks: list[str], device="cpu",
                  dtype=torch.float32, family_designs: list[FamilyEntry] = (), family_variants: list[FamilyEntry] = (),
                  family_checks: list[str] = (), generate_designs: list[GenerateEntry] = (),
                  generate_variants: list[GenerateEntry] = (), generate_checks: list[str] = ()) -> dict:
    """`run_matrix` over `jobs` forked processes: the rows dealt round robin (the MPT rows, then the
    family rows), the same matrix in the same row order. Each process builds the reference again (the
    oracle its rows are compared with). CPU only (a forked process cannot use a CUDA or HPU context
    made before the fork)."""
    family = (family_designs, family_variants, family_checks)
    generate = (generate_designs, generate_variants, generate_checks)
    if jobs <= 1 or torch.device(device).type != "cpu":
        return run_matrix(designs, variants, checks, device, dtype, *family, *generate)
    rows = [d for d in designs if d.name != "reference"] + list(variants)
    kinds = {id(r): ("must_kill" if any(r is v for v in variants) else "must_pass") for r in rows}
    family_rows = [*family_designs, *family_variants]
    generate_rows = [*generate_designs, *generate_variants]
    _SHARES[:] = [([r for r in rows[i::jobs] if kinds[id(r)] == "must_pass"],
                   [r for r in rows[i::jobs] if kinds[id(r)] == "must_kill"], checks, device, dtype,
                   [e for e in family_rows[i::jobs] if e in family_designs],
                   [e for e in family_rows[i::jobs] if e in family_variants], family_checks,
                   [e for e in generate_rows[i::jobs] if e in generate_designs],
                   [e for e in generate_rows[i::jobs] if e in generate_variants], generate_checks)
                  for i in range(jobs)]
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            parts = pool.map(_run_share, range(jobs))
    finally:
        _SHARES.clear()
    merged = {kind: {name: cells for part in parts for name, cells in part[kind].items()}
              for kind in ("must_pass", "must_kill", "family_must_pass", "family_must_kill", "generate_must_pass",
                           "generate_must_kill")}
    return {"must_pass": {REFERENCE.name: parts[0]["must_pass"][REFERENCE.name],
                          **{d.name: merged["must_pass"][d.name] for d in designs if d.name != REFERENCE.name}},
            "must_kill": {v.name: merged["must_kill"][v.name] for v in variants},
            "family_must_pass": {e.name: merged["family_must_pass"][e.name] for e in family_designs},
            "family_must_kill": {e.name: merged["family_must_kill"][e.name] for e in family_variants},
            "generate_must_pass": {e.name: merged["generate_must_pass"][e.name] for e in generate_designs},
            "generate_must_kill": {e.name: merged["generate_must_kill"][e.name] for e in generate_variants}}


def waiting(v: Variant | FamilyEntry, cells: dict[str, Cell]) -> str:
    """Why a variant may survive in this build ('' if it may not): its declared `waits_for`, or
    every expected killer that ran here is n/a (not in this build)."""
    if v.waits_for:
        return v.waits_for
    mine = [cells[c] for c in v.killed_by if c in cells]
    if mine and all(cell.result == "n/a" for cell in mine):
        return "; ".join(sorted({cell.detail for cell in mine}))
    return ""


def catalogued_variant(name: str) -> Variant | FamilyEntry:
    """A must-kill row's entry: an MPT variant or a family variant (an unknown name: one that names no
    expected killer)."""
    return VARIANTS.get(name) or FAMILY_VARIANTS.get(name) or GENERATE_VARIANTS.get(name) or \
        Variant(name, "", "", (), None)


def problems(matrix: dict) -> tuple[list[str], list[str], list[str]]:
    """(false positives, missed kills, waiting notes) as messages, the MPT rows then the family rows."""
    false_positives = [f"must-pass {name} fails {c}: {cell.detail}"
                       for kind in ("must_pass", "family_must_pass", "generate_must_pass")
                       for name, cells in matrix.get(kind, {}).items()
                       for c, cell in cells.items() if cell.result.startswith("FAIL")]
    missed, notes = [], []
    for kind, source in (("must_kill", "variants.py"), ("family_must_kill", "family_catalogue.py"),
                         ("generate_must_kill", "generate_catalogue.py")):
        for name, cells in matrix.get(kind, {}).items():
            v = catalogued_variant(name)
            why = waiting(v, cells)
            expected = [c for c in v.killed_by if c in cells]
            if v.waits_for and any(cells[c].killed for c in expected):
                missed.append(f"{name}: {', '.join(c for c in expected if cells[c].killed)} kills it now, but it is "
                              f"declared waiting for '{v.waits_for}': drop its waits_for ({source})")
                continue
            if why:
                if not any(cell.killed for cell in cells.values()):
                    notes.append(f"{name} survives here, waiting for {why} (expected killers: "
                                 f"{', '.join(v.killed_by)})")
                continue
            if not any(cell.killed for cell in cells.values()):
                ran = [c for c, cell in cells.items() if cell.result not in ("n/a", "unsupported")]
                missed.append(f"{name} SURVIVED every check that ran ({', '.join(ran) or 'none'}): a missing or "
                              "weak test")
            for c in expected:
                if cells[c].result == "survived":
                    missed.append(f"{name}: expected {c} to kill it, but it survived {c}")
    return false_positives, missed, notes
