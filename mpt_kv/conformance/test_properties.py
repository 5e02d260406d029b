"""P0-P4 on every target, device, dtype and cache path, each against its oracle.

The oracle of P0 is the reference; of P1 the target's own uncached forward; of P2 its own
concat path; in bf16 each path is compared with the same target run in fp32 from the
bf16-rounded weights. P3 is structural (storage identity), P4 behavioural (a returned tensor is
not modified by later calls). Inputs are drawn by hypothesis, plus fixed edge cases (long
sequences to max_seq_len 2048, head dim 128, prompts around the 128 bucket) and a run under
graphs (HPU or CUDA graphs; on CPU a stand-in with one output buffer per shape). Each test
runs one check of `mpt_kv.checks.registry`, the same functions a project's own tests run
through `mpt_kv.parametrize_with_checks`; targets, devices and dtypes come from the plugin.
"""

from mpt_kv.checks import index
from mpt_kv.checks.registry import parametrize_with_checks


@parametrize_with_checks(checks=index.of_runs("case"))  # P0-P4: the index's drawn-case checks
def test_property(check, target, device, dtype):
    check(target, device, dtype)
