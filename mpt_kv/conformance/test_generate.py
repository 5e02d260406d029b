"""The generate checks (`generate/<path>/<mode>` of the index, `mpt_kv.checks.generate`): each implementation's
own `generate`, run as users run it (greedy, beam search, assisted decoding by prompt lookup and with a draft
model; the dynamic cache, concat, and the static one), every forward call it makes observed and judged by the
rules the direct drive applies (docs/generate.md). Beside the direct drive: both are columns of the matrix.

MPT targets: the run's targets (the plugin's `target` parameter), every mode on concat and static. Family
targets: every built-in family implementation among the run's targets, as mpt_kv/conformance/test_families.py
takes them, on the cells `mpt_kv.checks.registry.generate_applies` gives (one tiny config per family, greedy and
beam, prompt lookup where the family has local windows; on optimum-habana's ports also its reuse_cache and
each recipe documented for the family, greedy and beam). float32 and cpu only: a generate cell of another dtype or device is
not generated (the drive judges generate's tokens against the oracle's greedy ones, on the cpu meter).
"""

import pytest
import torch

from mpt_kv.checks import index
from mpt_kv.checks.registry import CHECKS, PLAIN_GENERATE_PATHS, applies, parametrize_with_checks
from mpt_kv.families.habana_standin import device_label
from mpt_kv.families.implementations import IMPLEMENTATIONS, family_targets, users_attention
from mpt_kv.plugin.options import dtype_names
from mpt_kv.plugin.parametrize import family_declarations, generated_kinds, generated_targets, require_package

GENERATE = [c for c in CHECKS.values() if index.by_name(c.property).runs == "generate"]


def family_cases(implementations):
    """transformers' families with the attention implementation from_pretrained picks (`users_attention`:
    sdpa where the model class has it): generate as users run it; the other attention's cells are the
    direct drive's (test_families)."""
    for target in family_targets(implementations):
        if target.attention is not None and target.attention != users_attention(target.family_name, target.variant):
            continue
        for check in GENERATE:
            if applies(check, target):
                yield pytest.param(check, target, "cpu", torch.float32, marks=[pytest.mark.property(check.property)],
                                   id=f"float32-{device_label(target, 'cpu')}-{target.implementation_label}-"
                                      f"{target.family_name}-{target.variant}-{check.id}")


def pytest_generate_tests(metafunc):
    """float32 on cpu for the MPT targets' cells (the plugin parametrizes their targets); the family targets'
    cells as the families' module takes its implementations."""
    config = metafunc.config
    if metafunc.definition.name == "test_generate":
        fp32 = [pytest.param(torch.float32, id="fp32")] if "fp32" in dtype_names(config) else []
        metafunc.definition.add_marker(pytest.mark.parametrize("dtype", fp32 or [pytest.param(None, id="no-fp32", marks=pytest.mark.skip(
            reason="the generate drive runs float32 only: --dtype excludes it"))]))
        cpu = [pytest.param("cpu", marks=pytest.mark.cpu, id="cpu")] if "cpu" in generated_kinds(config) else []
        metafunc.definition.add_marker(pytest.mark.parametrize("device", cpu or [pytest.param(None, id="no-cpu", marks=pytest.mark.skip(
            reason="the generate drive runs on cpu only: --device excludes it"))], indirect=True))
    if metafunc.definition.name == "test_generate_family":
        selected = [i for i in IMPLEMENTATIONS if i in generated_targets(config)] + family_declarations(config)
        params = list(family_cases(selected))
        if not params:
            why = f"no family implementation ({', '.join(IMPLEMENTATIONS)}) among this run's targets"
            params = [pytest.param(None, None, "cpu", torch.float32, id="no-family-implementation",
                                   marks=[pytest.mark.skip(reason=why), pytest.mark.no_target(why)])]
        metafunc.definition.add_marker(pytest.mark.parametrize("check, target, device, dtype", params))


# generate/<path>/<mode> on generate's own two paths: optimum-habana's (reuse_cache, its recipes) are its ports'
@parametrize_with_checks(checks=[c.id for c in GENERATE if c.path in PLAIN_GENERATE_PATHS])
def test_generate(check, target, device, dtype):
    check(target, device, dtype)


def test_generate_family(request, check, target, device, dtype):
    require_package(request.config, target.implementation_name)
    check(target, device, dtype)
