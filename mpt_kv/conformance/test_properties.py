"""P0-P3 on every target, device, dtype and cache path, each against its oracle.

The oracle of P0 is the reference; of P1 the target's own uncached forward; of P2 its own
concat path; P3 is structural (storage identity). Inputs are drawn by hypothesis. Each test
runs one check of `mpt_kv.checks.registry`, the same functions a project's own tests run
through `mpt_kv.parametrize_with_checks`; targets, devices and dtypes come from the plugin.
"""

from mpt_kv.checks.registry import parametrize_with_checks


@parametrize_with_checks(checks=["P0", "P1", "P2", "P3"])
def test_property(check, target, device, dtype):
    check(target, device, dtype)
