"""Memory on every target, cache path and config of `CONFIGS` (mpt_kv/checks/ceilings.py): the
analytic properties hold (retained = KV cache to the byte on cpu, decode transients bounded,
nothing leaks) and nothing exceeds its stored ceiling."""

from __future__ import annotations

import functools
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from mpt_kv.checks import ceilings as C
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.model.config import random_state_dict
from mpt_kv.targets import build

PATHS = [pytest.param("concat", None, id="concat"), pytest.param("static", None, id="static"),
         pytest.param("static", 8, id="static-bucket8")]


@functools.cache
def runner(target, device, dtype, cfg):
    return build(target, cfg, random_state_dict(cfg), device, dtype)


@functools.cache
def _stored(path: Path, kind: str, update: bool):
    try:
        return C.load_baseline(path, kind)
    except C.BaselineError as e:
        if update and not path.exists():
            return {}  # --update-ceilings creates it
        return e


def stored_ceilings(config, kind: str) -> tuple[Path, dict]:
    path = C.baseline_path(kind, config.getoption("ceilings_dir"))
    entries = _stored(path, kind, config.getoption("update_ceilings"))
    if isinstance(entries, C.BaselineError):
        pytest.fail(str(entries), pytrace=False)
    return path, entries


# --- every target, path and config ------------------------------------------------------------------

@pytest.mark.property("memory")
@pytest.mark.parametrize("config", C.CONFIGS, ids=lambda c: c.id)
@pytest.mark.parametrize("path,bucket", PATHS)
def test_memory_ceilings(target, device, dtype, path, bucket, config, request, record_property):
    file, entries = stored_ceilings(request.config, device.type)
    r = runner(target, device, dtype, config.cfg)
    r.require(path, "bucket" if bucket else None)
    m = C.measure(r, config.case(), path, device, dtype, bucket, target=target)
    # recorded before any check: the report and --update-ceilings see failing cases too
    record_property("mpt_kv_memory", {**asdict(m), "problems": len(m.problems), "torch": str(torch.__version__)})
    if m.problems:
        raise PropertyFailure("\n".join(m.problems))
    if request.config.getoption("update_ceilings"):
        return  # the controller merges the measurements into the file at the end of the run
    failures, notes = C.compare(m, entries, file)
    for n in notes:
        record_property("mpt_kv_note", n)
    if failures:
        raise PropertyFailure("\n".join(failures) + f" [{m.target}, {m.device}, {m.dtype}, {path}, {config.id}]")
