"""Memory on every target, cache path and config of `CONFIGS` (mpt_kv/checks/ceilings.py): the
analytic properties hold (retained = KV cache to the byte on cpu, decode transients bounded,
nothing leaks) and nothing exceeds its stored ceiling (the project's ceilings folder: ini
`mpt_kv_ceilings_dir`, default <rootdir>/mpt_kv_ceilings; see docs/targets.md)."""

from mpt_kv.checks import index
from mpt_kv.checks.registry import parametrize_with_checks


@parametrize_with_checks(checks=index.of_runs("memory"))
def test_memory_ceilings(check, target, device, dtype):
    check(target, device, dtype)
