"""Tensor comparison that tells a reviewer what broke: where, by how much, in which context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * max|expected|: relative to the tensor's scale, not
    per element, because a rounding difference upstream moves every logit by about as much,
    small logits included."""

    atol: float
    rtol: float

    def bound(self, expected: torch.Tensor) -> float:
        return self.atol + self.rtol * expected.detach().abs().max().item()


# Measured over 150 drawn cases x every decode step (README "Tolerances"): the cached and
# uncached paths of the reference differ by at most 3.8e-6 x scale in fp32 and 0.016 x scale
# in bf16 (8-bit mantissa, rounded at different places). Bounds keep a margin of 13x and 3x;
# a stale or misplaced cache entry moves logits by a large fraction of their scale.
TOLERANCES = {
    torch.float32: Tolerance(atol=1e-5, rtol=5e-5),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=0.05),
}
# Cached keys and values (P2), same measurement: at most 6.3e-6 x scale in fp32; in bf16 up
# to 0.078 absolute where clip_qkv keeps K/V small (0.07 x scale), so bf16 gets a floor.
TOLERANCES_KV = {
    torch.float32: Tolerance(atol=1e-5, rtol=5e-5),
    torch.bfloat16: Tolerance(atol=0.05, rtol=0.1),
}


class PropertyFailure(AssertionError):
    """A property does not hold; the message carries the whole context."""


def describe(ctx: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in ctx.items() if v is not None)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, what: str, ctx: dict,
                 where: torch.Tensor | None = None) -> None:
    """Fail with the largest absolute and relative error and their index, unless within `tol`.
    `where` (broadcastable bool) restricts the comparison, e.g. to non-padding positions."""
    if actual.shape != expected.shape:
        raise PropertyFailure(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)} [{describe(ctx)}]")
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    keep = torch.ones_like(e, dtype=torch.bool) if where is None else where.detach().cpu().expand_as(e)
    # NaN/inf fail on their own, even where both sides agree: they come from the inputs or
    # weights, and a comparison against them proves nothing (nor does a NaN error bound)
    nonfinite = [r for r in (non_finite(n, x, keep) for n, x in (("got", a), ("expected", e))) if r]
    if nonfinite:
        raise PropertyFailure(f"{what}: NaN/inf appeared ({'; '.join(nonfinite)}); shape {tuple(a.shape)} [{describe(ctx)}]")
    bound = tol.bound(e.where(keep, torch.zeros_like(e)))
    err = (a - e).abs().where(keep, torch.zeros_like(e))
    bad = ~(err <= bound)  # NaN counts as bad
    if not bad.any():
        return
    err = torch.nan_to_num(err, nan=float("inf"))
    i_abs = unravel(err.argmax(), err.shape)
    rel = err / e.abs().clamp_min(1e-12)
    i_rel = unravel(rel.argmax(), rel.shape)
    raise PropertyFailure(
        f"{what} differ at {int(bad.sum())} of {int(keep.sum())} elements (bound {bound:.3e} = "
        f"{tol.atol} + {tol.rtol} x max|expected|): "
        f"max abs err {err[i_abs].item():.3e} at {i_abs} (got {a[i_abs].item():.6g}, expected {e[i_abs].item():.6g}); "
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
