"""The value checks' bound for a declared quantized KV cache (`mpt_kv.QuantizedKV`, layouts.py).

A session whose `cache_layout()` is a QuantizedKV attends over dequantized K/V: its cached-path
logits and its cached K/V are one quantization step from a full-precision cache's. That error
is added to the dtype's calibrated bound (compare.TOLERANCES): `widened(tol, session)` returns
`atol + q.atol + (rtol + q.rtol) x max|expected|`, with q from `QUANTIZED` per storage dtype and
compared quantity ("logits" or "kv"). A session that declares no quantized cache gets `tol`
itself: the bf16/fp32 bounds of every other target are unchanged. The uncached forward reads no
cache and is never widened.

The bounds come from `python -m mpt_kv calibrate quantized` (docs/calibration.md, "Quantized
caches"): P1 and P2 over drawn cases on a CORRECT per-token quantizer (the design
`quantized_kv_int8`, and its fp8 twin) as the baseline, and on two wrong ones (the scale of the
previous position reused: `quantized_kv_wrong_scale`; a decode token quantized with another
row's scale) as the must-kill; bound = 2 x the worst correct error, checked to be well below
the wrong ones' smallest worst error.
"""

from __future__ import annotations


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
                         "(python -m mpt_kv calibrate quantized, docs/calibration.md 'Quantized caches')")
    q = QUANTIZED[(name, kind)]
    return Tolerance(tol.atol + q.atol, tol.rtol + q.rtol, (tol.key[0], f"{tol.key[1]}+{name}/{layout.scales}"))
