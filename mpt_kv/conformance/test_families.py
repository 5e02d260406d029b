"""The family checks (`mpt_kv.families.checks`) on every implementation of every family variant
of the registry, on every path the implementation has: tiny configs, fp32, CPU.

One case per (implementation, family variant, path, check): a conformance case of target
`<implementation>/<family>` (the matrix has a row per implementation, family and path), its
check `<check>/<variant>`. Paths: concat and static for every implementation, static+reuse for
optimum-habana (its reuse_cache). family-P0 (uncached, against transformers) sits in the concat
row and is not drawn for transformers itself; family-P2 (static = concat) in the static rows.

Which implementations run follows the run's targets, as for MPT (`mpt_kv.plugin.options`): the
built-in transformers and optimum-habana, or with `--only-targets` only those named with
`--target` (`--target optimum-habana --only-targets` runs the optimum-habana ports alone). An
implementation whose package is not installed gets no case, and the summary says why
(`mpt_kv.plugin.parametrize.generated_targets`), unless the run names it (then an error); one that is installed but has no port of a family (TargetUnavailable) is
unsupported with the reason; a feature it lacks is unsupported with its reason; anything else is
an error. A failure upstream ships is data (`mpt_kv/families/known_failures.json`): where its
`when` holds, the case is a strict xfail that only a PropertyFailure whose message its pattern
finds satisfies; any other failure, or a pass, fails the case.
"""

import pytest
import torch

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.checks.registry import one_thread
from mpt_kv.errors import TargetUnavailable, Unsupported
from mpt_kv.families import variants
from mpt_kv.families.checks import CHECKS
from mpt_kv.families.implementations import IMPLEMENTATIONS
from mpt_kv.families.known_failures import applying, load

KNOWN = load()
PATHS = {"transformers": ("concat", "static"), "optimum-habana": ("concat", "static", "static+reuse")}


class NotTheKnownFailure(Exception):
    """A case with a known failure failed otherwise (not a PropertyFailure: the xfail must not take it)."""


def drawn(implementation: str, path: str, prop: str) -> bool:
    """Which (path, check) cells exist: P0 is not a check of transformers itself (its oracle) and
    sits in the concat row; P2 compares static with concat, in the static rows."""
    if prop == "family-P0":
        return implementation != "transformers" and path == "concat"
    if prop == "family-P2":
        return path != "concat"
    return True


def check_entries_cover_cells(entries) -> None:
    """An entry about a cell the matrix does not have (P0 of transformers, P2 on concat, a path the
    implementation lacks) would never apply: an error naming it, not an entry silently unused."""
    for e in entries:
        if not any(drawn(e.implementation, p, e.property) for p in PATHS[e.implementation] if e.path in (None, p)):
            raise ValueError(f"family known failure {e.implementation} {e.family}/{e.variant} {e.property} path "
                             f"{e.path or 'any'}: the matrix has no such cell (paths of {e.implementation}: "
                             f"{PATHS[e.implementation]}; family-P0 only on concat and not for transformers; "
                             "family-P2 only on static paths)")


check_entries_cover_cells(KNOWN)


def cases(implementations):
    for implementation in implementations:
        for family, variant in variants():
            for path in PATHS[implementation]:
                for prop in CHECKS:
                    if not drawn(implementation, path, prop):
                        continue
                    known = applying(implementation, family, variant, prop, path, KNOWN)
                    marks = [pytest.mark.property(prop)]
                    if known is not None:
                        marks.append(pytest.mark.xfail(strict=True, raises=PropertyFailure,
                                                       reason=f"{known.upstream}: {known.reason}"))
                    yield pytest.param(f"{implementation}/{family}", f"{prop}/{variant}", implementation, family,
                                       variant, path, prop, known, marks=marks,
                                       id=f"{implementation}-{family}-{variant}-{path}-{prop}")


ARGNAMES = "target, check, implementation, family, variant, path, prop, known"


def pytest_generate_tests(metafunc):
    """The run's implementations (its targets), as a parametrize marker: the plugin then leaves
    `target` alone (mpt_kv.plugin.parametrize.explicitly_parametrized)."""
    if metafunc.definition.name != "test_family":
        return
    from mpt_kv.plugin.parametrize import generated_targets

    selected = [i for i in IMPLEMENTATIONS if i in generated_targets(metafunc.config)]
    params = list(cases(selected))
    if not params:  # e.g. --only-targets with a user's target alone: one skip saying why (no property: no
        # case); a run of this module alone has no target, which the gate refuses (mpt_kv.plugin.gate.no_target)
        why = f"no family implementation ({', '.join(IMPLEMENTATIONS)}) among this run's targets"
        params = [pytest.param("-", "-", None, None, None, None, None, None, id="no-family-implementation",
                               marks=[pytest.mark.skip(reason=why), pytest.mark.no_target(why)])]
    metafunc.definition.add_marker(pytest.mark.parametrize(ARGNAMES, params))


def run_case(config, target, check, implementation, family, variant, path, prop, known):
    """One case (module doc): skip, unsupported, error or the check's verdict."""
    from mpt_kv.plugin.options import named_targets
    from mpt_kv.plugin.parametrize import missing_package

    missing = missing_package(implementation)
    if missing:
        if implementation in named_targets(config):
            pytest.fail(f"target {implementation} is named with --target but {missing}", pytrace=False)
        pytest.skip(f"target {implementation} unavailable: {missing}")
    try:
        with one_thread(torch.device("cpu")):  # the zoo's tiny models: one intra-op thread is faster
            CHECKS[prop](implementation, family, variant, path)
    except TargetUnavailable as e:
        raise Unsupported(f"{target}: {e}") from e
    except PropertyFailure as e:
        if known is not None and not known.pattern.search(str(e)):
            raise NotTheKnownFailure(f"{target} {check} {path} failed, but not as its known failure says "
                                     f"(pattern {known.pattern.pattern!r}, {known.upstream}): {e}") from e
        raise


# device and dtype are fixed (cpu, fp32): parameters only so the matrix rows say so
@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("dtype", ["float32"])
def test_family(request, target, check, implementation, family, variant, path, prop, known, device, dtype):
    run_case(request.config, target, check, implementation, family, variant, path, prop, known)
