"""family-P1 and family-P3 on transformers' implementation of every family of the registry
(`mpt_kv.families`), tiny configs, fp32, CPU, the concat path (the model's own DynamicCache).

Each case is a conformance case of target `transformers/<family>` (its variant in the `check`
field), so the matrix has a row per family. A failure upstream ships is data
(`mpt_kv/families/known_failures.json`): where its `when` holds, the case is a strict xfail that
only a PropertyFailure whose message its pattern finds satisfies; any other failure, or a pass,
fails the case.
"""

import pytest

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.families import variants
from mpt_kv.families.checks import CHECKS
from mpt_kv.families.known_failures import applying, load

KNOWN = load()


class NotTheKnownFailure(Exception):
    """A case with a known failure failed otherwise (not a PropertyFailure: the xfail must not take it)."""


def cases():
    for family, variant in variants():
        for prop in CHECKS:
            known = applying(family, variant, prop, KNOWN)
            marks = [pytest.mark.property(prop)]
            if known is not None:
                marks.append(pytest.mark.xfail(strict=True, raises=PropertyFailure,
                                               reason=f"{known.upstream}: {known.reason}"))
            yield pytest.param(f"transformers/{family}", f"{prop}/{variant}", family, variant, prop, known,
                               marks=marks, id=f"{family}-{variant}-{prop}")


# device, dtype and path are fixed (cpu, fp32, the concat path): parameters only so the matrix
# rows say so
@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("dtype", ["float32"])
@pytest.mark.parametrize("path", ["concat"])
@pytest.mark.parametrize("target, check, family, variant, prop, known", list(cases()))
def test_family(target, check, family, variant, prop, known, device, dtype, path):
    try:
        CHECKS[prop](family, variant)
    except PropertyFailure as e:
        if known is not None and not known.pattern.search(str(e)):
            raise NotTheKnownFailure(f"{target} {check} failed, but not as its known failure says "
                                     f"(pattern {known.pattern.pattern!r}, {known.upstream}): {e}") from e
        raise
