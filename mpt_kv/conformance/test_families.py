"""The family checks (family-P0 ... family-memory of the index, `mpt_kv.checks.family`) on every
implementation of every family variant of the registry, on every path the implementation has, on
every device and dtype of the run: tiny configs, each against transformers' model in fp32 on CPU.

One case per (family target, check, device, dtype): a family target is an implementation of one
family variant (`mpt_kv.targets.FamilyTarget`, named `<implementation>/<family>/<variant>`: a matrix
row per target and path), its checks the family checks of its cells (`mpt_kv.checks.registry.applies`:
the paths the implementation has, family-P0 not for transformers itself, its oracle; family-P2 on the
static paths). The cases are made by the rule every check's cases are made by
(`mpt_kv.checks.registry.parametrize_with_checks`: the check and the target, the property marker, the
id); the plugin gives `device` and `dtype` as it gives the MPT cases (`mpt_kv.plugin.parametrize`:
every device kind of the run with its marker, so `-m cpu` and `-m hpu` select family cases and the
gate counts them; fp32 and bf16, or --dtype). Each runs through the run layer like every MPT check
(`check(target, device, dtype)`), and a failure upstream ships is a known failure of the one rule
(`mpt_kv/findings/family_known_failures.json`, applied by the plugin as for the MPT targets: a strict
xfail of only the PropertyFailure its pattern finds).

Which implementations run follows the run's targets, as for MPT (`mpt_kv.plugin.options`): the
built-in transformers and optimum-habana, or with `--only-targets` only those named with `--target`
(`--target optimum-habana --only-targets` runs the optimum-habana ports alone). An implementation
whose package is not installed gets no case, and the summary says why
(`mpt_kv.plugin.parametrize.generated_targets`), unless the run names it (then an error); one that
is installed but has no port of a family, or cannot run on the case's device, is unsupported with the
reason; anything else is an error.
"""

import pytest
import torch

from mpt_kv.checks.registry import CHECKS, applies, is_family, parametrize_with_checks
from mpt_kv.families.implementations import IMPLEMENTATIONS, family_targets
from mpt_kv.plugin.parametrize import family_declarations, generated_targets, require_package


def cases(implementations):
    """The (check, target) cells of the implementations' family targets: parametrize_with_checks'
    marker (None where there is none), which the plugin completes with `device` and `dtype`."""
    targets = family_targets(implementations)
    checks = [c for c in CHECKS.values() if is_family(c)]
    if not any(applies(c, t) for t in targets for c in checks):
        return None
    # a port loaded under the CPU stand-in is labelled cpu+standin in the report (mpt_kv.plugin.outcomes)
    return parametrize_with_checks(targets, checks=checks)


def pytest_generate_tests(metafunc):
    """The run's implementations (its targets), as a parametrize marker of `check` and `target`: the
    plugin then leaves `target` alone and gives `device` and `dtype` (mpt_kv.plugin.parametrize)."""
    if metafunc.definition.name != "test_family":
        return
    selected = [i for i in IMPLEMENTATIONS if i in generated_targets(metafunc.config)] + family_declarations(metafunc.config)
    mark = cases(selected)
    if mark is None:  # e.g. --only-targets with a user's target alone: one skip saying why (no property: no
        # case); a run of this module alone has no target, which the gate refuses (mpt_kv.plugin.gate.no_target)
        why = f"no family implementation ({', '.join(IMPLEMENTATIONS)}) among this run's targets"
        mark = pytest.mark.parametrize("check, target, device, dtype", [pytest.param(
            None, None, "cpu", torch.float32, id="no-family-implementation",
            marks=[pytest.mark.skip(reason=why), pytest.mark.no_target(why)])])
    metafunc.definition.add_marker(mark)


def test_family(request, check, target, device, dtype):
    require_package(request.config, target.implementation_name)
    check(target, device, dtype)
