"""The index of checks (mpt_kv/checks/index.py): each property named once, and what reads it finds
what it needs there: a function that imports, a driver for how its cases come, a catalogue variant
that its kill-matrix column kills, no torch import."""

import subprocess
import sys

import pytest

from mpt_kv.catalogue.variants import COLUMNS, VARIANTS
from mpt_kv.checks import index, running
from plugin_testing import HANG_S


@pytest.mark.parametrize("prop", index.PROPERTIES, ids=index.NAMES)
def test_each_property_names_a_function_and_a_driver(prop):
    assert callable(running.function_of(prop)), prop.function
    assert prop.runs in running.DRIVERS, f"{prop.name}: no driver for runs={prop.runs!r}"
    assert set(prop.paths) <= {"", *index.ALL_PATHS, *index.FAMILY_PATHS}, prop.paths


@pytest.mark.parametrize("column", COLUMNS)
def test_each_kill_matrix_column_has_a_variant_it_must_kill(column):
    assert [v for v in VARIANTS.values() if column in v.killed_by], f"no must-kill variant names column {column}"


def test_the_index_is_the_one_list_of_properties():
    from mpt_kv.findings import entries as known_failures
    from mpt_kv.plugin import gate, report

    assert tuple(report.PROPERTY_NAMES) == index.NAMES
    assert set(gate.CACHE_PROPERTIES) | set(gate.NOT_CACHE_PROPERTIES) == set(index.NAMES)
    assert set(known_failures.PROPERTIES) == {p.name for p in index.PROPERTIES if not p.family}
    assert COLUMNS == index.COLUMNS


def test_the_index_and_the_plugin_import_no_torch():
    """The plugin reads the index before an xdist worker's card is pinned (PyTorch >= 2.5 initialises
    device backends at import); so the known-failure rule, the stored ceilings and the hypothesis
    profiles it reads are torch-free too."""
    code = ("import sys, mpt_kv.checks.index, mpt_kv.plugin, mpt_kv.versions, mpt_kv.findings.entries, "
            "mpt_kv.findings.patterns, mpt_kv.checks.stored_ceilings, mpt_kv.checks.profiles; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr


def test_an_unknown_property_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown property 'P9': the index has P0, P1"):
        index.by_name("P9")
