"""The suite's sensitivity: every known-bad variant (mpt_kv/variants.py) is killed by the check
it names, the unmodified reference passes every check, and the kill-matrix command says
"survived" and exits non-zero when a variant gets through."""

import json

import pytest
import torch

from mpt_kv.catalogue import killmatrix as KM
from mpt_kv.cli import killmatrix as killmatrix_cli
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.targets import resolve
from mpt_kv.catalogue.variants import COLUMNS, VARIANTS, Variant, no_change



@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_is_killed_by_its_expected_check(name):
    variant = VARIANTS[name]
    missing = {c: KM.CHECKS[c].unavailable() for c in variant.killed_by if KM.CHECKS[c].unavailable()}
    if len(missing) == len(variant.killed_by):
        pytest.skip(f"{name}: every expected killer is unavailable here ({missing}); the kill matrix reports it as a survivor")
    for check in variant.killed_by:
        if check in missing:
            continue
        cell = KM.run_column(KM.CHECKS[check], variant.build, name, torch.device("cpu"), torch.float32, {})
        assert cell.killed, (f"{name} ({variant.bug}) survived {check}, the check expected to kill it: "
                             f"a missing or weak test (cases: {[c.describe() for c in KM.CASES]})")


def test_reference_passes_every_check():
    matrix = KM.run_matrix([], list(KM.CHECKS))
    failed = {c: cell.detail for c, cell in matrix["reference"].items() if cell.result not in ("pass", "n/a")}
    assert not failed, f"the unmodified reference fails checks of the kill matrix: {failed}"


def test_catalogue_is_documented_and_usable_as_targets():
    assert len(VARIANTS) >= 12
    for name, v in VARIANTS.items():
        assert v.bug and v.origin and v.killed_by, f"{name}: bug, origin and expected killers must be filled in"
        assert set(v.killed_by) <= set(COLUMNS), f"{name}: unknown columns {set(v.killed_by) - set(COLUMNS)}"
        assert resolve(f"mpt_kv.catalogue.variants:{name}") is v.build, f"--target mpt_kv.catalogue.variants:{name} does not resolve"


def test_cli_reports_a_survivor_and_exits_nonzero(tmp_path, capsys):
    # P0 alone cannot see K/V views: the variant survives and the command must say so
    out = tmp_path / "m.json"
    rc = killmatrix_cli.main(["--variant", "kv_views_of_mixed_qkv", "--check", "P0", "--json", str(out)])
    assert rc == 1, capsys.readouterr()
    assert "kv_views_of_mixed_qkv SURVIVED" in capsys.readouterr().err
    cells = json.loads(out.read_text())["variants"]["kv_views_of_mixed_qkv"]["cells"]
    assert cells["P0"]["result"] == "survived"


def test_cli_reports_a_harmless_variant_as_survivor(monkeypatch, capsys):
    monkeypatch.setitem(VARIANTS, "no_change", Variant("no_change", "nothing: the reference", "-", (), no_change))
    rc = killmatrix_cli.main(["--variant", "no_change"])
    text = capsys.readouterr()
    assert rc == 1, text.out
    assert "no_change SURVIVED every check" in text.err
    row = next(line for line in text.out.splitlines() if line.startswith("no_change"))
    assert "killed" not in row, row


def test_cli_exits_zero_when_every_variant_is_killed(tmp_path, capsys):
    md = tmp_path / "m.md"
    rc = killmatrix_cli.main(["--variant", "kv_swapped_in_static_decode", "--variant", "only_v_cloned",
                  "--check", "P1", "--check", "P3", "--markdown", str(md)])
    assert rc == 0, capsys.readouterr()
    table = md.read_text()
    assert "| `kv_swapped_in_static_decode` |" in table and "killed*" in table


def test_cli_refuses_when_the_reference_fails(monkeypatch, capsys):
    def always_fails(runner, reference, c):
        raise PropertyFailure("a check that fails every model")

    monkeypatch.setitem(KM.CHECKS, "P0", KM.Check("P0", ((None, None),), always_fails))
    rc = killmatrix_cli.main(["--variant", "softmax_in_bf16", "--check", "P0"])
    assert rc == 2
    assert "the reference fails P0" in capsys.readouterr().err
