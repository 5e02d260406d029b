"""Tensor comparison that tells a reviewer what broke: where, by how much, in which context."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def bound(self, expected: torch.Tensor) -> torch.Tensor:
        return self.atol + self.rtol * expected.abs()


# Logits of the test models reach |20|. fp32: the cached and uncached paths differ only in the
# order of float sums (measured max 1.1e-5, see README "Tolerances"). bf16 has 8 bits of
# mantissa: one rounding of a logit near 20 is 0.06, and the paths round at different places.
TOLERANCES = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.bfloat16: Tolerance(atol=0.15, rtol=0.03),
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
    err = (a - e).abs()
    bad = ~(err <= tol.bound(e))  # NaN counts as bad
    if where is not None:
        keep = where.detach().cpu().expand_as(err)
        err, bad = err.where(keep, torch.zeros_like(err)), bad & keep
    if not bad.any():
        return
    err = torch.nan_to_num(err, nan=float("inf"))
    i_abs = unravel(err.argmax(), err.shape)
    rel = err / e.abs().clamp_min(1e-12)
    i_rel = unravel(rel.argmax(), rel.shape)
    raise PropertyFailure(
        f"{what} differ at {int(bad.sum())} of {bad.numel()} elements (tolerance atol={tol.atol}, rtol={tol.rtol}): "
        f"max abs err {err[i_abs].item():.3e} at {i_abs} (got {a[i_abs].item():.6g}, expected {e[i_abs].item():.6g}); "
        f"max rel err {rel[i_rel].item():.3e} at {i_rel}; shape {tuple(a.shape)} [{describe(ctx)}]")


def unravel(flat_index: torch.Tensor, shape) -> tuple[int, ...]:
    idx, out = int(flat_index), []
    for n in reversed(shape):
        out.append(idx % n)
        idx //= n
    return tuple(reversed(out))
