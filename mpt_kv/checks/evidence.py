"""What shows a target keeps a cache on a path (the green-run rule reads it: `mpt_kv.plugin.gate`): after a
prefill on a tiny model the cache's storages hold at least the analytic K/V bytes of the prefilled tokens, and a
second read returns the same storages. The run layer (`mpt_kv.checks.running.run`) records it for every check
of a target's path, once per target, device, dtype, path and bucket; `r` is its `Run` (not imported here:
the run layer imports this module)."""

from __future__ import annotations

import torch

from mpt_kv.checks import family_driver
from mpt_kv.checks.accounting import expected_kv_bytes, itemsize
from mpt_kv.checks.storages import storage_key
from mpt_kv.checks.strategies import STATIC_SHAPE_CASE
from mpt_kv.errors import Unsupported
from mpt_kv.targets.layouts import QuantizedKV, layout_of, storage_tensors

_evidence: dict = {}


def cache_evidence(r) -> dict:
    """{"shown": bool, "why": str}: whether the target keeps a cache on this path, once per target,
    device, dtype, path and bucket (a prefill on a tiny model). Shown when, after a prefill, the cache's
    storages (a declared layout's own: pools, codes and scales; else `kv()`'s) hold at least the analytic
    K/V bytes of the prefilled tokens, and a second read returns the same storages. A target whose
    "cache" keeps only the token ids and recomputes K and V at every call gives right values: the value
    checks pass it, and only this says it checked no cache. A family target: the family's analytic K/V
    (`mpt_kv.checks.family_driver.cache_evidence`)."""
    key = (r.target, str(r.device), r.dtype, r.check.path, r.check.bucket)
    try:
        if key in _evidence:
            return _evidence[key]
    except TypeError:  # an unhashable target: measured every time
        key = None
    try:
        if r.on_family:
            evidence = family_driver.cache_evidence(*r.family_case("cache-evidence"))
        else:
            evidence = mpt_cache_evidence(r)
    except (Exception, Unsupported) as e:  # noqa: BLE001  no evidence: the gate says why, the check's verdict stands
        evidence = {"shown": False, "why": f"the prefill that shows the cache raised {type(e).__name__}: {e}"}
    if key is not None:
        _evidence[key] = evidence
    return evidence


def mpt_cache_evidence(r) -> dict:
    case = r.without_clip(STATIC_SHAPE_CASE)  # a shape the static-shape check compiles anyway (HPU)
    runner = r.runner(case, r.features(case))
    ids, mask = case.inputs(r.device)
    with torch.inference_mode():
        session = runner.session(r.check.path, case.total_len, r.check.bucket)
        session.prefill(ids, mask)
        layout = layout_of(session)

        def stored() -> list[torch.Tensor]:
            if isinstance(layout, QuantizedKV):
                return [t for _, _, t in layout_of(session).stored()]
            return [t for pair in storage_tensors(session) for t in pair if torch.is_tensor(t)]

        first = stored()
        again = stored()  # `first` still alive: a recomputed tensor cannot take its storage's address
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in first}
    held = sum(storages.values())
    analytic = expected_kv_bytes(layout, case.cfg, case.batch, session.written, itemsize(r.dtype))
    where = (f"after a prefill of {case.batch} x {session.written} tokens on {r.check.path}"
             f"{f' (bucket {r.check.bucket})' if r.check.bucket else ''}, {str(r.dtype).replace('torch.', '')}:")
    if held < analytic:
        return {"shown": False, "why": f"{where} the cache's storages hold {held} bytes, less than the analytic K/V "
                                       f"of the prefilled tokens ({analytic} bytes): no cache is kept"}
    if set(storages) != {storage_key(t) for t in again}:
        return {"shown": False, "why": f"{where} a second read of the cache returned other storages than the "
                                       "first: K/V made at each read (recomputed from the tokens?), not kept"}
    return {"shown": True, "why": f"{where} the cache's storages hold {held} bytes (analytic K/V {analytic}), the "
                                  "same at a second read"}
