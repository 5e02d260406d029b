"""Cache operations beyond greedy one-token decoding, on every target, device, dtype and cache path:
drawn programs of decodes, k-token extends (assisted decoding's verification, chunked prefill),
crops (rejected candidates) and reorders (beam search), each checked after every operation.

ops-P1 against the target's own uncached forward over each row's surviving history; ops-P2 its
static path against its concat path after the same program; ops-P3 the storage of the cached K/V
after crops and reorders; ops-static-storage the static cache's buffers staying where a captured
graph replays into them; ops-memory the transient of one reorder and of one k-token extend
(mpt_kv/checks/operations.py, docs/operations.md). Each test runs one check of
`mpt_kv.checks.registry`, as test_properties.py does.
"""

from mpt_kv.checks import index
from mpt_kv.checks.registry import parametrize_with_checks


@parametrize_with_checks(checks=index.of_runs("program", "operation"))  # ops-*: the index's program checks
def test_operation(check, target, device, dtype):
    check(target, device, dtype)
