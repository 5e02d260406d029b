"""`python -m mpt_kv findings --derive SOURCE NEW` (mpt_kv/findings/derive.py): a new generate mode's failed cell
gets an entry only where a known entry's pattern finds its own message; anything else is listed, never guessed."""

import json

import pytest

from mpt_kv.cli.findings import main
from mpt_kv.findings import entries as known_entries
from mpt_kv.findings.derive import derive

GREEDY = {"target": "mine", "property": "generate", "path": "concat", "check": "generate/concat/greedy",
          "pattern": r"views of transformer\.blocks\.\d+\.attn\.Wqkv's output",
          "reason": "the prefill's K/V are views of Wqkv's output", "upstream": "mine/modeling.py:12"}
VIEWS = ("generate/concat/multi-turn call 0 (prefill): the cache it returned layer 0 key (2, 3, 6, 8) and layer 0 "
         "value (2, 3, 6, 8) are views of transformer.blocks.0.attn.Wqkv's output (2, 6, 72)")


def result(check, message, target="mine", outcome="failed"):
    return {"target": target, "check": check, "path": check.split("/")[1], "dtype": "float32", "device": "cpu",
            "bucket": None, "outcome": outcome, "message": message}


def test_a_cell_gets_the_source_modes_entry_only_where_its_pattern_finds_the_cells_message(tmp_path):
    path = tmp_path / "known.json"
    path.write_text(json.dumps([GREEDY]))
    entries = known_entries.load(path)
    results = [result("generate/concat/multi-turn", VIEWS),
               result("generate/concat/multi-turn", "RuntimeError: shape '[2, 1, 1, 10]' is invalid", target="mine"),
               result("generate/static/multi-turn", VIEWS),  # no greedy entry of the static path
               result("generate/concat/greedy", VIEWS),      # not the new mode's cell
               result("generate/concat/multi-turn", VIEWS, outcome="passed")]
    derived, unexplained = derive(results, "greedy", "multi-turn", entries, {str(path): [GREEDY]})

    assert [(e["check"], e["path"]) for e in derived] == [("generate/concat/multi-turn", "concat")]
    assert derived[0]["upstream"] == GREEDY["upstream"] and derived[0]["reason"].endswith(GREEDY["reason"])
    assert [(r["check"], r["message"][:12]) for r in unexplained] == [
        ("generate/concat/multi-turn", "RuntimeError"), ("generate/static/multi-turn", VIEWS[:12])]
    # what it derived is an entry of the file's format that explains the cell
    path.write_text(json.dumps([GREEDY, *derived]))
    loaded = known_entries.load(path)[1]
    assert loaded.check == "generate/concat/multi-turn" and loaded.pattern.search(VIEWS)


def test_the_command_exits_1_on_a_cell_no_entry_explains_and_2_on_bad_input(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"results": [result("generate/concat/multi-turn", "RuntimeError: boom",
                                                      target="nobody's")]}))
    assert main(["--derive", "greedy", "multi-turn", "--report", str(report)]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == [] and "unexplained: nobody's generate/concat/multi-turn: RuntimeError: boom" in err
    report.write_text(json.dumps({"results": [result("generate/concat/multi-turn", "", outcome="passed")]}))
    assert main(["--derive", "greedy", "multi-turn", "--report", str(report)]) == 0
    for argv, message in [(["--derive", "greedy", "sampled", "--report", str(report)], "'sampled' is no generate mode"),
                          (["--derive", "greedy", "multi-turn"], "needs at least one --report"),
                          (["--report", str(report)], "--report is only read with --derive")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
