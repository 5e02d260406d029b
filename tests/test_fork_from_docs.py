"""A fork of an optimum-habana port written from docs/families.md alone ("Writing a fork of a port").

examples/forks/gpt_neox_views_fork.py is optimum-habana 1.21.2's GPT-NeoX port with the seed bug class
put back: at the prefill the cached V is a view of `query_key_value`'s output (the port's
`value.contiguous()` dropped). The documented checks family-P3 and family-memory pass on the
original port and fail on the fork, naming the fused module and the bytes it pins, which are
computed here by hand from the family's tiny config.
"""

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mpt_kv import PropertyFailure, TargetUnavailable
from mpt_kv.families import FAMILIES
from mpt_kv.checks.family import CHECKS
from mpt_kv.families.models import build
from mpt_kv.families.gaudi import fork_loader, gaudi_runner

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the fork must be importable (docs: sys.path, PYTHONPATH)
    sys.path.insert(0, str(ROOT))

FAMILY, VARIANT, FORK_MODULE = "gpt_neox", "mha", "examples.forks.gpt_neox_views_fork"
CHECKED = ("family-P3", "family-memory")
# The checks' prefill: a left-padded batch of 2 whose longest prompt is 6 tokens on the concat path;
# the static path prefills the prompt right-padded to the session's max_len, 16. (Neither length is
# in docs/families.md; the failure messages name them: "2 x 6 tokens", "(2, 6, 96)", "(2, 16, 96)".)
TOKENS = {"concat": 6, "static": 16}
BATCH = 2
FP32 = 4  # bytes per element: the checks run fp32


@pytest.fixture(scope="module")
def port_installed():
    try:
        gaudi_runner(FAMILIES[FAMILY], VARIANT)  # a Family, not its name (the checks take either)
    except TargetUnavailable as e:
        if str(e).startswith("optimum-habana is not installed"):  # docs: the only message that means absent
            pytest.skip(str(e))
        raise


@pytest.fixture(scope="module")
def fork(port_installed):
    family = FAMILIES[FAMILY]
    return replace(family, gaudi=replace(family.gaudi, load=fork_loader(FAMILY, FORK_MODULE)))


@pytest.mark.parametrize("path", ["concat", "static"])
def test_the_original_port_passes_p3_and_memory(port_installed, path):
    for check in CHECKED:
        CHECKS[check]("optimum-habana", FAMILY, VARIANT, path)  # raises PropertyFailure where it does not hold


def by_hand(path):
    """The bytes the fork pins, from the tiny config (hidden_size 32, 2 layers, 4 heads of 8)."""
    config = build(FAMILY, VARIANT, 0)[0].config
    hidden, layers, tokens = config.hidden_size, config.num_hidden_layers, BATCH * TOKENS[path]
    # query_key_value's output: batch x tokens x 3 * hidden fp32 = 2 x 6 x 96 x 4 = 4608 bytes a layer
    # (static: 2 x 16 x 96 x 4 = 12288); the cached V in it: 2 x 6 x 32 x 4 = 1536 (static 4096);
    # pinned beyond the cache: the q and k thirds, 2 x 6 x 64 x 4 = 3072 a layer (static 8192).
    fused = tokens * 3 * hidden * FP32
    value = tokens * hidden * FP32
    pinned = fused - value
    # family-memory: the storages the cache reaches are, per layer, the fused output (V's storage) and
    # K's own (2 x 6 x 32 x 4 = 1536): 2 x (4608 + 1536) = 12288; the analytic K/V is 2 layers x (K, V)
    # x 1536 = 6144; the excess 6144 = 2 layers x 3072 (static: 32768, 16384, +16384).
    analytic = layers * 2 * tokens * hidden * FP32
    assert analytic == FAMILIES[FAMILY].kv_bytes_per_token(config, torch.float32) * tokens
    held = layers * (fused + tokens * hidden * FP32)
    return dict(fused=fused, value=value, pinned=pinned, layers=layers, analytic=analytic, held=held,
                shape=f"({BATCH}, {TOKENS[path]}, {3 * hidden})")


@pytest.mark.parametrize("path", ["concat", "static"])
def test_the_fork_fails_p3_and_memory_naming_query_key_value_and_the_bytes(fork, path):
    want = by_hand(path)
    for check in CHECKED:
        with pytest.raises(PropertyFailure) as failure:
            CHECKS[check](gaudi_runner, fork, VARIANT, path)
        message = str(failure.value)
        assert f"family={FAMILY}" in message and f"path={path}" in message and "step=prefill" in message, message
        layers = re.findall(
            r"layer (\d+) (key|value) \([\d, ]+\) is a view of (\S+)'s output (\([\d, ]+\)): its storage holds (\d+) bytes, "
            r"the cached tensors in it (\d+): (\d+) bytes pinned beyond the cache", message)
        assert [(int(i), kv) for i, kv, *_ in layers] == [(i, "value") for i in range(want["layers"])], message
        for i, _, module, shape, holds, cached, pinned in layers:
            assert module.endswith(f"layers.{i}.attention.query_key_value"), message
            assert (shape, int(holds), int(cached), int(pinned)) == (
                want["shape"], want["fused"], want["value"], want["pinned"]), message
        if check == "family-memory":
            excess = re.search(r"distinct storages hold (\d+) bytes, the family's analytic K/V for "
                               r"(\d+) x (\d+) tokens (\d+): \+(\d+) bytes", message)
            assert excess, message
            assert tuple(map(int, excess.groups())) == (
                want["held"], BATCH, TOKENS[path], want["analytic"], want["layers"] * want["pinned"]), message


@pytest.mark.parametrize("check", CHECKED)
def test_the_fork_named_optimum_habana_fails_after_the_port_passed_in_one_process(fork, check):
    """The fork is a Family copy under the port's name: the runner cache is keyed by the Family
    object, so the name "optimum-habana" builds the fork's own runner, not the port's cached one."""
    CHECKS[check]("optimum-habana", FAMILY, VARIANT, "concat")
    with pytest.raises(PropertyFailure, match=r"layer 0 value \([\d, ]+\) is a view of \S+query_key_value's output"):
        CHECKS[check]("optimum-habana", fork, VARIANT, "concat")


# --- the same fork as a target of its own: mpt_kv.FamilyModel (docs/targets.md, "A model of another family") -----

def test_the_fork_declared_as_a_target_is_told_apart_from_the_port(port_installed):
    """Declared with fork_of="optimum-habana", the fork inherits the port's shipped entries (its k-token
    extend's crash: an xfail on the fork too) and nothing covers its own bug (the port passes P3): it fails,
    naming the fused module. The port's own cases keep their entries."""
    from mpt_kv import CHECKS as REGISTRY, FamilyModel, KnownFailure, KnownFailures

    fork = FamilyModel(FAMILY, module=FORK_MODULE, fork_of="optimum-habana", name="neox-fork")
    known = KnownFailures()
    with pytest.raises(KnownFailure) as inherited:
        REGISTRY["family-P1/concat"](fork, known_failures=known)
    assert inherited.value.entry.origin == f"optimum-habana/{FAMILY}/{VARIANT}", inherited.value.entry
    with pytest.raises(PropertyFailure, match=r"layer 0 value \([\d, ]+\) is a view of \S+query_key_value's output"):
        REGISTRY["family-P3/concat"](fork, known_failures=known)
    with pytest.raises(KnownFailure):  # the port's own entry, by its name
        REGISTRY["family-P1/concat"](f"optimum-habana/{FAMILY}/{VARIANT}", known_failures=known)
    REGISTRY["family-P3/concat"](f"optimum-habana/{FAMILY}/{VARIANT}", known_failures=known)


def test_a_fork_under_the_ports_name_takes_none_of_its_entries(fork):
    """The route above (a Family copy with the fork's loader, named optimum-habana): its cases carry the
    port's name, but the port's entries were measured on the port, so none applies (fail closed)."""
    from mpt_kv import CHECKS as REGISTRY, FamilyTarget, KnownFailures

    with pytest.raises(PropertyFailure, match="the implementation's extend raised RuntimeError"):
        REGISTRY["family-P1/concat"](FamilyTarget("optimum-habana", fork, VARIANT, ("concat", "static", "static+reuse")),
                                     known_failures=KnownFailures())
