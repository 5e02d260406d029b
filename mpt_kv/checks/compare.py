"""Tensor comparison that tells a reviewer what broke: where, by how much, in which context.

Tolerances are per (dtype, compared quantity) and come from a calibration
(`python -m mpt_kv calibrate`, docs/calibration.md); each entry's comment gives the
worst error measured there as a fraction of its bound.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mpt_kv.errors import (AdapterError, AliasedComparison, Crash, Finding, InputError, PropertyFailure,  # noqa: F401  (their home
                           TargetRaised, Unsupported, describe)                               # was here)


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * max|expected|: relative to the tensor's scale, not
    per element, because a rounding difference upstream moves every logit by about as much,
    small logits included. `key` is (dtype, quantity), for messages and the calibration."""

    atol: float
    rtol: float
    key: tuple[str, str] = ("?", "?")

    def bound(self, expected: torch.Tensor) -> float:
        return self.atol + self.rtol * expected.detach().abs().max().item()


# What is compared, per quantity. In fp32 a path is compared with the target's own oracle (its
# uncached forward, its concat path); in bf16 every path is compared with the same target run in
# fp32 from the bf16-rounded weights on the same tokens (its "fp32 twin"): comparing bf16 with
# bf16 would add two rounding errors of opposite signs (issue 11: 2.8-4.4% each).
QUANTITIES = {
    "logits:uncached": "uncached forward logits (P0: vs the reference; bf16 P1: vs the fp32 twin)",
    "logits:concat": "concat-path logits (fp32: vs the uncached forward; bf16: vs the fp32 twin)",
    "logits:static": "static-path logits, with or without cache_idx buckets (fp32: vs uncached or concat; bf16: vs the fp32 twin)",
    "kv:static": "static-path cached K/V at written positions (fp32: vs the concat path's; bf16: vs the fp32 twin's)",
    "kv:concat": "concat-path cached K/V (bf16 only: vs the fp32 twin's)",
    "logits:same": "two runs of one path in one dtype (graph replay vs eager: the same kernels)",
    "logits:compiled": "a static decode step compiled by torch.compile (aot_eager) vs the same step eager",
}


def _tol(dtype: str, quantity: str, atol: float, rtol: float) -> tuple[tuple[str, str], Tolerance]:
    return (dtype, quantity), Tolerance(atol, rtol, (dtype, quantity))


# Calibrated: docs/calibration.md (the command, the cases, the time). "worst" is the largest error
# measured as a fraction of this bound, over every compared tensor of every drawn case on the
# reference, transformers and optimum-habana targets. Aim: <= 0.5, zero failures. A stale or
# misplaced cache entry moves logits by a large fraction of their scale, far beyond any of these.
TOLERANCES: dict[tuple[str, str], Tolerance] = dict([
    _tol("float32", "logits:uncached", 1e-5, 5e-5),
    _tol("float32", "logits:concat", 1e-5, 5e-5),
    _tol("float32", "logits:static", 1e-5, 5e-5),
    _tol("float32", "kv:static", 1e-5, 5e-5),
    _tol("float32", "logits:same", 1e-5, 5e-5),
    _tol("float32", "logits:compiled", 1e-5, 5e-5),
    _tol("bfloat16", "logits:uncached", 1e-2, 0.15),
    _tol("bfloat16", "logits:concat", 1e-2, 0.15),
    _tol("bfloat16", "logits:static", 1e-2, 0.15),
    _tol("bfloat16", "kv:static", 0.05, 0.2),
    _tol("bfloat16", "kv:concat", 0.05, 0.2),
    _tol("bfloat16", "logits:same", 1e-2, 0.05),
    _tol("bfloat16", "logits:compiled", 1e-2, 0.05),
])


def tolerance(dtype: torch.dtype, quantity: str) -> Tolerance:
    name = str(dtype).replace("torch.", "")
    try:
        return TOLERANCES[(name, quantity)]
    except KeyError:
        known = sorted({d for d, _ in TOLERANCES}), sorted(QUANTITIES)
        raise ValueError(f"no tolerance for dtype {name}, quantity {quantity!r}: dtypes {known[0]}, "
                         f"quantities {known[1]}") from None


# never a crash of the target: mpt-kv's own verdicts, its skips and its input checks pass through
NOT_CRASHES = (PropertyFailure, Unsupported, InputError, AdapterError)


def crash_of(what: str, who: str, operation: str, error: BaseException, ctx: dict, at: str = "") -> Crash:
    """The crash rule (`Crash`) for `error`, raised by a call that is no NOT_CRASHES."""
    crash = Crash(what, who, operation, error, ctx, at)
    crash.__cause__ = error
    return crash


def judged_before(crash: Crash, judge, steps) -> None:
    """Raise for a drive that crashed after recording `steps`: `judge()` compares them first (a
    failure there is the verdict, noting the crash), then the crash, naming the steps that held."""
    try:
        judge()
    except PropertyFailure as failure:
        raise PropertyFailure(f"{failure}{crash.note()}") from crash
    raise crash.held(steps)


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of the two tensors' storages overlap (views of one buffer, or
    one tensor twice)."""
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    if sa.nbytes() == 0 or sb.nbytes() == 0:
        return False
    pa, pb = sa.data_ptr(), sb.data_ptr()
    return pa < pb + sb.nbytes() and pb < pa + sa.nbytes()


# --- measurement mode (the calibration) ------------------------------------------------------------
_measurements: list[dict] | None = None


@contextlib.contextmanager
def measuring():
    """Record every comparison instead of failing on a bound: yields the list of records
    {key, what, err, scale, bound, frac}, err = max |actual - expected| over the compared
    elements, scale = max |expected|. Non-finite values and shape mismatches still raise."""
    global _measurements
    outer, _measurements = _measurements, []
    try:
        yield _measurements
    finally:
        _measurements = outer


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str, ctx: dict,
                 where: torch.Tensor | None = None) -> None:
    """Fail with the largest absolute and relative error and their index, unless within `tol`.
    `where` (broadcastable bool) restricts the comparison, e.g. to non-padding positions."""
    if shares_memory(actual, expected):
        raise AliasedComparison(
            f"{what}: refusing to compare two tensors that share memory (shapes {tuple(actual.shape)} and "
            f"{tuple(expected.shape)}): one buffer compared with itself proves nothing. A result of the "
            f"target was kept without a copy while the target ran again [{describe(ctx)}]")
    if actual.shape != expected.shape:
        raise PropertyFailure(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)} [{describe(ctx)}]")
    if expected.numel() == 0:  # the same empty shape (a cached tensor of zero width): no element can differ
        return
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    keep = torch.ones_like(e, dtype=torch.bool) if where is None else where.detach().cpu().expand_as(e)
    # NaN/inf fail on their own, even where both sides agree: they come from the inputs or
    # weights, and a comparison against them proves nothing (nor does a NaN error bound)
    nonfinite = [r for r in (non_finite(n, x, keep) for n, x in (("got", a), ("expected", e))) if r]
    if nonfinite:
        raise PropertyFailure(f"{what}: NaN/inf appeared ({'; '.join(nonfinite)}); shape {tuple(a.shape)} [{describe(ctx)}]")
    zero = torch.zeros_like(e)
    bound = tol.bound(e.where(keep, zero))
    err = (a - e).abs().where(keep, zero)
    if _measurements is not None:
        worst, scale = err.max().item(), e.where(keep, zero).abs().max().item()
        _measurements.append(dict(key=tol.key, what=what, err=worst, scale=scale, bound=bound,
                                  frac=worst / bound, ctx=describe(ctx)))
        return
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return
    err = torch.nan_to_num(err, nan=float("inf"))
    i_abs = unravel(err.argmax(), err.shape)
    rel = err / e.abs().clamp_min(1e-12)
    i_rel = unravel(rel.argmax(), rel.shape)
    raise PropertyFailure(
        f"{what} differ at {int(bad.sum())} of {int(keep.sum())} elements (bound {bound:.3e} = "
        f"{tol.atol} + {tol.rtol} x max|expected|, {tol.key[0]} {tol.key[1]}): "
        f"max abs err {err[i_abs].item():.3e} = {err[i_abs].item() / bound:.3g} x bound at {i_abs} "
        f"(got {a[i_abs].item():.6g}, expected {e[i_abs].item():.6g}); "
        f"max rel err {rel[i_rel].item():.3e} at {i_rel}; shape {tuple(a.shape)} [{describe(ctx)}]")


def non_finite(name: str, x: torch.Tensor, keep: torch.Tensor) -> str | None:
    """'got: 12 NaN, 0 inf of 320 compared elements, first at (1, 3, 0)', or None if all finite."""
    bad = ~x.isfinite() & keep
    if not bad.any():
        return None
    first = unravel(bad.flatten().nonzero()[0, 0], bad.shape)
    return (f"{name}: {int((x.isnan() & keep).sum())} NaN, {int((x.isinf() & keep).sum())} inf of "
            f"{int(keep.sum())} compared elements, first at {first}")


def unravel(flat_index: torch.Tensor, shape) -> tuple[int, ...]:
    idx, out = int(flat_index), []
    for n in reversed(shape):
        out.append(idx % n)
        idx //= n
    return tuple(reversed(out))
