"""`python -m mpt_kv checks` (mpt_kv/cli/checks.py): the index of checks as the README's table."""

import subprocess
import sys

import pytest

from mpt_kv.checks import index
from mpt_kv.checks.registry import CHECKS
from mpt_kv.cli import checks as cli
from plugin_testing import HANG_S


def test_the_readmes_table_is_the_index():
    """README.md's block is what the command prints: a row added to the index without the table
    regenerated fails here (python -m mpt_kv checks --update-docs)."""
    run = subprocess.run([sys.executable, "-m", "mpt_kv", "checks", "--check"], capture_output=True, text=True,
                         timeout=HANG_S)
    assert run.returncode == 0, run.stderr


def test_every_property_of_the_index_is_a_row_and_has_checks():
    rows = cli.table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == list(index.NAMES)
    for p in index.PROPERTIES:
        assert [c for c in CHECKS.values() if c.property == p.name], f"{p.name}: no check id"


def test_a_stale_table_is_found_and_rewritten(tmp_path, capsys):
    doc = tmp_path / "README.md"
    doc.write_text("# r\n\n<!-- checks:begin -->\nstale\n<!-- checks:end -->\nafter\n")
    assert cli.main(["--check", "--doc", str(doc)]) == 1
    assert "stale: run python -m mpt_kv checks --update-docs" in capsys.readouterr().err
    assert cli.main(["--update-docs", "--doc", str(doc)]) == 0
    assert cli.main(["--check", "--doc", str(doc)]) == 0
    assert "| `ops-static-storage` static buffers stay through operations |" in doc.read_text()


@pytest.mark.parametrize("argv, message", [
    (["--doc", "x.md"], "--doc is only read with --update-docs or --check"),
    (["--check", "--doc", "/nonexistent/README.md"], "No such file"),
    (["--ids", "--check"], "not allowed with argument"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
