"""mpt-kv's conformance checks on tinympt, in our own test suite. `pytest -m hpu` runs them on
Gaudi, `pytest -m cpu` here; known failures and memory ceilings are configured in pyproject.toml."""

import mpt_kv

from tinympt.mpt_kv_target import build


@mpt_kv.parametrize_with_checks([build])
def test_mpt_kv(check, target, device, dtype):
    check(target, device, dtype)
