"""The kill matrix: every property against every known-bad variant (variants.py).

    python -m mpt_kv killmatrix [--variant NAME ...] [--check NAME ...] [--markdown FILE] [--json FILE]

Columns: P0-P3 (properties.py), static-shape (static_shape.py) and memory
(`mpt_kv.ceilings.check_memory`, "n/a" until that module exists). Each column runs over a fixed,
deterministic set of cases (`CASES`: left padding, 3 heads, clip_qkv, several decode steps) and
its cache paths (concat, static, static with cache_idx buckets of `BUCKET`), fp32, CPU by default.

What counts as a kill: a check run on the variant raises. `PropertyFailure` is "killed"; any
other exception is "killed (error: ExcType)": the variant crashes, which a user would see too.
A column stops at its first kill. "survived": every run of the column passed.

The unmodified reference runs through the same checks first and must pass them all: checks that
fail the good model prove nothing about the bad ones.

Exit status: 0 every variant killed, each by the columns it names as expected killers (where
those are available); 1 a variant survived every check, or an expected killer missed it; 2 the
reference failed a check, or bad arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from mpt_kv.checks import properties as P
from mpt_kv.checks import static_shape
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.catalogue.variants import COLUMNS, VARIANTS, Variant

BUCKET = 4
CASES = (
    # 3 heads (ALiBi slopes of a non-power of two), rows of 5 and 3 tokens (left padding); with
    # bucket 4 the steps at token_idx 6..10 reach cache_idx 8 and 10 at and before the boundary
    P.Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32), (5, 3), 5, seed=1),
    # clip_qkv small enough to clamp most of mixed_qkv; three rows, two of them padded
    P.Case(ModelConfig(d_model=16, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=0.5),
           (6, 2, 4), 4, seed=2),
)
ALL_PATHS = (("concat", None), ("static", None), ("static", BUCKET))
STATIC_PATHS = (("static", None), ("static", BUCKET))


def memory_unavailable() -> str | None:
    if importlib.util.find_spec("mpt_kv.checks.ceilings") is None:
        return "mpt_kv.checks.ceilings (memory ceilings) does not exist yet"
    return None


def check_memory(runner, reference, c):
    importlib.import_module("mpt_kv.checks.ceilings").check_memory(runner, c)


@dataclass(frozen=True)
class Check:
    name: str
    paths: tuple                              # (path, bucket) pairs it runs on
    run: Callable                             # (runner, reference, Context) -> None, raises to fail
    unavailable: Callable[[], str | None] = lambda: None


CHECKS = {c.name: c for c in (
    Check("P0", ((None, None),), lambda r, ref, c: P.check_oracle(r, ref, c)),
    Check("P1", ALL_PATHS, lambda r, ref, c: P.check_cached_equals_uncached(r, c)),
    Check("P2", STATIC_PATHS, lambda r, ref, c: P.check_static_equals_concat(r, c)),
    Check("P3", ALL_PATHS, lambda r, ref, c: P.check_no_aliasing(r, c)),
    Check("static-shape", STATIC_PATHS, lambda r, ref, c: static_shape.check_static_shape(r, c)),
    Check("memory", ALL_PATHS, check_memory, memory_unavailable),
)}
assert tuple(CHECKS) == COLUMNS


@dataclass
class Cell:
    result: str          # "killed" | "killed (error: X)" | "survived" | "n/a"  (reference: "pass" | "FAIL ...")
    detail: str = ""     # the first failure's message, or why n/a

    @property
    def killed(self) -> bool:
        return self.result.startswith("killed")


def run_column(check: Check, build, name: str, device, dtype, runners: dict) -> Cell:
    """Run one check over every case and path until the first failure."""
    reason = check.unavailable()
    if reason:
        return Cell("n/a", reason)
    for case in CASES:
        for path, bucket in check.paths:
            c = P.Context(name, device.type, dtype, case, path, bucket)
            try:
                runner, reference = runners_for(build, case, device, dtype, runners)
                check.run(runner, reference, c)
            except PropertyFailure as e:
                return Cell("killed", first_line(e))
            except Exception as e:  # noqa: BLE001  a crash is a kill too, reported as such
                return Cell(f"killed (error: {type(e).__name__})", f"{type(e).__name__}: {first_line(e)} [{c.case.describe()}, path={path}, bucket={bucket}]")
    return Cell("survived")


def runners_for(build, case, device, dtype, cache: dict):
    """(runner, reference runner) for a case, built once and reused across columns."""
    from mpt_kv.targets.reference import build as reference_build

    key = (build, case)
    if key not in cache:
        sd = random_state_dict(case.cfg, seed=case.seed)
        if (reference_build, case) not in cache:
            cache[(reference_build, case)] = reference_build(case.cfg, sd, device, dtype)
        cache[key] = cache[(reference_build, case)] if build is reference_build else build(case.cfg, sd, device, dtype)
    return cache[key], cache[(reference_build, case)]


def first_line(e: BaseException, limit: int = 400) -> str:
    s = " ".join(str(e).split())
    return s if len(s) <= limit else s[:limit] + " ..."


def run_matrix(variants: list[Variant], checks: list[str], device="cpu", dtype=torch.float32) -> dict:
    """{"reference": {check: Cell}, "variants": {name: {check: Cell}}} for the given variants and checks."""
    from mpt_kv.targets.reference import build as reference_build

    device = torch.device(device)
    runners: dict = {}
    ref_cells = {}
    for name in checks:
        cell = run_column(CHECKS[name], reference_build, "reference", device, dtype, runners)
        if cell.result == "survived":
            cell = Cell("pass")
        elif cell.killed:
            cell = Cell("FAIL" + cell.result[len("killed"):], cell.detail)
        ref_cells[name] = cell
    out = {}
    for v in variants:
        out[v.name] = {name: run_column(CHECKS[name], v.build, v.name, device, dtype, runners) for name in checks}
    return {"reference": ref_cells, "variants": out}


def problems(matrix: dict, checks: list[str]) -> tuple[list[str], list[str]]:
    """(reference failures, variant problems) as messages."""
    ref = [f"the reference fails {name}: {cell.detail}" for name, cell in matrix["reference"].items()
           if cell.result.startswith("FAIL")]
    bad = []
    for name, cells in matrix["variants"].items():
        if not any(cell.killed for cell in cells.values()):
            ran = [n for n, cell in cells.items() if cell.result != "n/a"]
            bad.append(f"{name} SURVIVED every check that ran ({', '.join(ran) or 'none'}): a missing or weak test")
        for col in VARIANTS[name].killed_by if name in VARIANTS else ():
            cell = cells.get(col)
            if cell is not None and cell.result == "survived":
                bad.append(f"{name}: expected {col} to kill it, but it survived {col}")
    return ref, bad
