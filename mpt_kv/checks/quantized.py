"""The value checks' bound for a declared quantized KV cache (`mpt_kv.QuantizedKV`, layouts.py).

A session whose `cache_layout()` is a QuantizedKV attends over dequantized K/V: its cached-path
logits and its cached K/V are one quantization step from a full-precision cache's. That error
is added to the dtype's calibrated bound (compare.TOLERANCES): `widened(tol, session)` returns
`atol + q.atol + (rtol + q.rtol) x max|expected|`, with q from `QUANTIZED` per storage dtype and
compared quantity ("logits" or "kv"). A session that declares no quantized cache gets `tol`
itself: the bf16/fp32 bounds of every other target are unchanged. The uncached forward reads no
cache and is never widened.

The bounds come from `python -m mpt_kv.checks.quantized` (docs/calibration.md, "Quantized
caches"): P1 and P2 over drawn cases on a CORRECT per-token quantizer (the design
`quantized_kv_int8`, and its fp8 twin) as the baseline, and on two wrong ones (the scale of the
previous position reused: `quantized_kv_wrong_scale`; a decode token quantized with another
row's scale) as the must-kill; bound = 2 x the worst correct error, checked to be well below
the wrong ones' smallest worst error.
"""

from __future__ import annotations

import argparse
import sys

import torch

from mpt_kv.checks.compare import Tolerance
from mpt_kv.targets.layouts import QuantizedKV, layout_of

# (storage dtype, "logits" | "kv") -> the quantization's share of the bound, added to the dtype's.
# Calibrated (docs/calibration.md, "Quantized caches"): rtol = 2 x the worst err / max|expected| of a
# correct per-token quantizer over the drawn cases; the comment gives that worst and the smallest
# worst of the wrong-scale and wrong-row quantizers, both as a fraction of max|expected|.
QUANTIZED: dict[tuple[str, str], Tolerance] = {
    ("int8", "logits"): Tolerance(1e-4, 0.08, ("int8", "logits")),                    # worst 0.0384
    ("int8", "kv"): Tolerance(1e-4, 0.02, ("int8", "kv")),                            # worst 0.0079 (1 step: 1/127)
    ("float8_e4m3fn", "logits"): Tolerance(1e-4, 0.3, ("float8_e4m3fn", "logits")),   # worst 0.136
    ("float8_e4m3fn", "kv"): Tolerance(1e-4, 0.15, ("float8_e4m3fn", "kv")),          # worst 0.071
}
# The granularities calibrated: a per-token scale. A coarser one (per head, per tensor) puts a
# larger step on every small element; its bound is not measured, so it is refused (fail closed).
CALIBRATED_SCALES = ("token",)


def quantized_layout(session) -> QuantizedKV | None:
    layout = layout_of(session)
    return layout if isinstance(layout, QuantizedKV) else None


def widened(tol: Tolerance, *sessions) -> Tolerance:
    """`tol`, plus the calibrated quantization bound if any of `sessions` declares a quantized
    cache (call it after the prefill: a session describes its cache once it has one)."""
    layout = next((q for q in map(quantized_layout, sessions) if q is not None), None)
    if layout is None:
        return tol
    kind = "kv" if tol.key[1].startswith("kv") else "logits"
    name = str(layout.dtype).replace("torch.", "")
    if layout.scales not in CALIBRATED_SCALES or (name, kind) not in QUANTIZED:
        raise ValueError(f"no calibrated bound for a quantized KV cache of {layout.describe()}: calibrated are "
                         f"scales {CALIBRATED_SCALES} of {sorted({d for d, _ in QUANTIZED})} "
                         "(python -m mpt_kv.checks.quantized, docs/calibration.md 'Quantized caches')")
    q = QUANTIZED[(name, kind)]
    return Tolerance(tol.atol + q.atol, tol.rtol + q.rtol, (tol.key[0], f"{tol.key[1]}+{name}/{layout.scales}"))


# --- the calibration ---------------------------------------------------------------------------------------

def quantizers():
    """name -> (target factory, storage dtype, correct?): the correct per-token quantizer in int8
    and fp8, and the two wrong ones the bound must kill."""
    from mpt_kv.catalogue import designs, variants

    return {"int8 correct": (designs.quantized_kv_int8, "int8", True),
            "fp8 correct": (designs.quantized_kv_fp8, "float8_e4m3fn", True),
            "int8 wrong scale": (variants.quantized_kv_wrong_scale, "int8", False),
            "int8 wrong row": (variants.quantized_kv_wrong_row, "int8", False)}


def measure(factory, case) -> dict[str, float]:
    """Worst err / max|expected| per quantity kind ("logits", "kv") of P1 (concat and static paths)
    and P2 on one case, fp32, every comparison recorded (compare.measuring) instead of judged;
    "token": 1.0 where a greedy token differed beyond a near-tie (P1 raises that even while
    measuring, under the calibrated bound), else 0.0."""
    from mpt_kv.checks import properties as P
    from mpt_kv.checks.compare import PropertyFailure, measuring
    from mpt_kv.model.config import random_state_dict

    runner = P.copied(factory(case.cfg, random_state_dict(case.cfg, seed=case.seed), torch.device("cpu"),
                              torch.float32))
    worst = {"logits": 0.0, "kv": 0.0, "token": 0.0}
    runs = [("concat", lambda c: P.p1_generation(runner, None, c)), ("static", lambda c: P.p1_generation(runner, None, c)),
            ("static", lambda c: P.p2_generation(runner, None, c))]
    for path, check in runs:
        c = P.Context("calibration", "cpu", torch.float32, case, path)
        with measuring() as measured:
            try:
                check(c)
            except PropertyFailure:  # a greedy token beyond a near-tie: the steps before it were recorded
                worst["token"] = 1.0
        for m in measured:
            if "uncached" in m["key"][1]:
                continue
            kind = "kv" if m["key"][1].startswith("kv") else "logits"
            worst[kind] = max(worst[kind], m["err"] / max(m["scale"], 1e-30))
    return worst


def calibrate(cases: int) -> dict[str, dict[str, float]]:
    from mpt_kv.checks.strategies import RandomPicks, case_from

    out = {}
    drawn = [case_from(RandomPicks(i)) for i in range(cases)]
    for name, (factory, _, _) in quantizers().items():
        per_case = [measure(factory, case) for case in drawn]
        out[name] = {kind: [w[kind] for w in per_case] for kind in ("logits", "kv", "token")}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv.checks.quantized", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200, help="drawn cases (strategies.case_from(RandomPicks(i)))")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    result = calibrate(a.cases)
    print(f"{a.cases} drawn cases, fp32, P1 (concat, static) and P2; worst err / max|expected| over every compared "
          "tensor of a case (logits of the cached paths; cached K/V)")
    print("| quantizer | quantity | worst | median of the per-case worst | smallest per-case worst | bound rtol | "
          "cases within the bound |")
    print("|---|---|---|---|---|---|---|")
    for name, (_, dtype, _) in quantizers().items():
        for kind, values in result[name].items():
            if kind == "token":
                continue
            v = sorted(values)
            bound = QUANTIZED[(dtype, kind)]
            within = sum(x <= bound.rtol for x in v)
            print(f"| {name} | {kind} | {v[-1]:.3e} | {v[len(v) // 2]:.3e} | {v[0]:.3e} | {bound.rtol:g} | "
                  f"{within}/{len(v)} |")
        print(f"| {name} | greedy token beyond a near-tie | {int(sum(result[name]['token']))} of {a.cases} cases "
              "| | | | |")
        over = sum(t > 0 or any(result[name][k][i] > QUANTIZED[(dtype, k)].rtol for k in ("logits", "kv"))
                   for i, t in enumerate(result[name]["token"]))
        print(f"| {name} | any (a case P1 or P2 fails under the bound) | {over} of {a.cases} cases | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
