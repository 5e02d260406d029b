"""Reach: the knobs the default run's cases take (mpt_kv/checks/reach.py), the state a model keeps
after its generations (model_state.model_state_problem), and known failures pinned to one check."""

import json

import pytest
import torch

from mpt_kv.checks import ceilings as C
from mpt_kv.checks import reach, registry
from mpt_kv.checks.model_state import model_state_tensors
from mpt_kv.checks.strategies import EDGE_CASES
from mpt_kv.model.config import random_state_dict
from mpt_kv.findings import entries as known_failures
from mpt_kv.targets import build
from plugin_testing import HANG_S


@pytest.fixture(scope="module")
def drawn():
    """The default CI run's draws (derandomized ci profile, fp32 and bf16), no model run."""
    return registry.drawn_records("ci")


def by_property(records, prop):
    return [r for r in records if r["check"].split("/")[0] == prop]


# knobs each property's drawn and fixed cases must vary (a knob left at one value is a range no
# bug past it can be seen in); static-shape runs one fixed case by design
VARIED = {
    "P0": ("batch", "padding", "n_layers", "n_heads", "head_dim", "d_model", "prompt_len", "new_tokens", "max_seq_len",
           "mask_dtype", "dtype", "clip_qkv", "alibi_bias_max", "layer_norm_epsilon", "vocab_size"),
    "P1": ("batch", "padding", "n_layers", "n_heads", "head_dim", "d_model", "prompt_len", "new_tokens", "max_seq_len",
           "bucket", "path", "mask_dtype", "dtype", "clip_qkv", "alibi_bias_max", "layer_norm_epsilon", "vocab_size"),
    "P2": ("batch", "padding", "n_layers", "n_heads", "head_dim", "prompt_len", "new_tokens", "bucket", "mask_dtype",
           "clip_qkv", "alibi_bias_max", "layer_norm_epsilon", "vocab_size"),
    "P3": ("batch", "padding", "n_layers", "n_heads", "head_dim", "prompt_len", "new_tokens", "bucket", "path",
           "mask_dtype", "clip_qkv", "alibi_bias_max", "vocab_size"),
    "P4": ("batch", "n_layers", "n_heads", "prompt_len", "new_tokens", "bucket", "path", "alibi_bias_max"),
    "memory": ("batch", "padding", "prompt_len", "new_tokens", "bucket", "path", "dtype"),
}


@pytest.mark.parametrize("prop", list(VARIED))
def test_the_default_run_varies_every_knob(drawn, prop):
    summary = reach.summarize(by_property(drawn, prop))
    stuck = {k: summary[k]["overall"]["values"] for k in VARIED[prop] if summary[k]["overall"]["distinct"] < 2}
    assert not stuck, f"{prop}: the default run leaves these knobs at one value: {stuck}"


def test_the_default_run_reaches_the_issue_ranges(drawn):
    """Issue 17's table: batch 8 with unequal padding, 6 layers, 32 heads, prompts past 64 and 128
    in P3 and memory, alibi_bias_max other than 8 in P0 (edge case) and drawn in P1-P4."""
    s = {p: reach.summarize(by_property(drawn, p)) for p in VARIED}
    for prop in ("P0", "P1", "P2", "P3", "P4"):
        assert s[prop]["batch"]["overall"]["max"] >= 8 and s[prop]["n_layers"]["overall"]["max"] >= 6, prop
        assert s[prop]["n_heads"]["overall"]["max"] == 32 or prop == "P4", prop  # P4 (output reuse): no edge cases
    padded_8 = [r for r in drawn if r["knobs"].get("batch", 0) >= 8 and r["knobs"]["padding"] > 0]
    assert {r["check"].split("/")[0] for r in padded_8} >= {"P0", "P1", "P2", "P3", "memory"}
    for prop in ("P3", "memory"):
        assert s[prop]["prompt_len"]["overall"]["max"] > 128, prop
    assert any(64 < r["knobs"]["prompt_len"] <= 128 for r in by_property(drawn, "P3"))
    assert {r["knobs"]["alibi_bias_max"] for r in by_property(drawn, "P0") if "/" not in r["check"]} == {8}
    assert 16 in s["P0"]["alibi_bias_max"]["overall"]["values"]
    for prop in ("P1", "P2", "P3", "P4"):
        drawn_only = {r["knobs"]["alibi_bias_max"] for r in by_property(drawn, prop) if r["check"].count("/") <= 1}
        assert len(drawn_only) > 1, (prop, drawn_only)


def test_summarize_ranges_per_check_and_overall():
    records = [{"check": "P1/concat", "knobs": {"batch": 2, "clip_qkv": None}},
               {"check": "P1/concat", "knobs": {"batch": 8, "clip_qkv": 0.5}},
               {"check": "P3/static", "knobs": {"batch": 3, "mask_dtype": "bool"}}]
    s = reach.summarize(records)
    assert s["batch"]["overall"] == {"cases": 3, "distinct": 3, "values": [2, 3, 8], "min": 2, "max": 8}
    assert s["batch"]["by_check"]["P1/concat"]["max"] == 8 and s["batch"]["by_check"]["P3/static"]["min"] == 3
    assert s["clip_qkv"]["overall"]["values"] == [0.5, None] and "P3/static" not in s["clip_qkv"]["by_check"]
    assert list(s) == ["batch", "mask_dtype", "clip_qkv"]  # table order (reach.KNOBS)
    with pytest.raises(ValueError, match="expected"):
        reach.summarize([{"knobs": {}}])


def test_table_lines_show_the_run_beside_the_reference_model():
    records = [{"check": "P0", "knobs": {"n_heads": h, "alibi_bias_max": 8}} for h in (1, 2, 3, 4, 32)]
    records += [{"check": "memory/concat/B2", "knobs": {"n_heads": 4, "alibi_bias_max": 8}}]
    lines = reach.table_lines(reach.summarize(records), reach.load_reference_model())
    assert lines[0] == "| knob | this run | mpt-7b | P0 | memory |"
    assert "| n_heads | 1-32 (5) | 32 | 1-32 (5) | 4 (1) |" in lines
    assert "| alibi_bias_max | 8 (1) | 8 | 8 (1) | 8 (1) |" in lines
    assert reach.table_lines({}) == ["reach: no case recorded its knobs (nothing ran?)"]


def test_the_reference_model_is_mpt_7b_by_default_and_a_project_can_name_its_own(tmp_path):
    mpt7b = reach.load_reference_model()
    assert mpt7b["name"] == "mpt-7b"
    assert {k: mpt7b["values"][k] for k in ("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size",
                                            "alibi_bias_max", "clip_qkv", "layer_norm_epsilon")} == dict(
        d_model=4096, n_heads=32, n_layers=32, max_seq_len=2048, vocab_size=50432, alibi_bias_max=8, clip_qkv=None,
        layer_norm_epsilon=1e-5)
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"name": "mine", "values": {"n_heads": 64}}))
    assert reach.load_reference_model(own)["values"] == {"n_heads": 64}
    own.write_text(json.dumps({"name": "mine", "values": {"heads": 64}}))
    with pytest.raises(ValueError, match="unknown knobs"):
        reach.load_reference_model(own)


def test_the_cli_prints_a_reports_reach_and_refuses_an_empty_one(tmp_path, capsys):
    report = tmp_path / "conformance.json"
    report.write_text(json.dumps({"reach": [{"check": "P0", "knobs": {"batch": 8}}]}))
    assert reach.main([str(report)]) == 0
    assert "| batch | 8 (1) | 2, 16, 128 | 8 (1) |" in capsys.readouterr().out
    report.write_text(json.dumps({"reach": []}))
    assert reach.main([str(report)]) == 1


# --- the state a model keeps after its generations ------------------------------------------------------

@pytest.mark.parametrize("target", ["mpt_kv.catalogue.variants:attention_probabilities_kept"])
def test_state_kept_on_the_model_fails_with_its_name_and_bytes(target):
    case = C.CONFIGS[1].case()
    runner = build(target, case.cfg, random_state_dict(case.cfg), "cpu", torch.float32)
    m = C.measure(runner, case, "static", "cpu", torch.float32)
    kept = [p for p in m.problems if "per-generation state kept on the model" in p]
    assert kept and "model.transformer.blocks.0.attn.last_probabilities (2, 4, 1, 32) float32 keeps 1024 bytes" in kept[0]


def test_the_reference_keeps_nothing_on_the_model():
    case = C.CONFIGS[1].case()
    runner = build("reference", case.cfg, random_state_dict(case.cfg), "cpu", torch.float32)
    assert C.measure(runner, case, "concat", "cpu", torch.float32).problems == []
    weights = {C.storage_key(t) for t in [*runner.model.parameters(), *runner.model.buffers()]}
    assert model_state_tensors(runner, weights) == []  # weights and registered buffers only


# --- known failures pinned to one check -----------------------------------------------------------------

def test_a_known_failure_with_a_check_covers_that_check_only(tmp_path):
    entries = known_failures.load()
    alibi = known_failures.match("transformers", "P0", None, entries, None, "P0/alibi-bias-max-16")
    assert alibi is not None and alibi.check == "P0/alibi-bias-max-16" and "line 320" in alibi.reason
    assert known_failures.match("transformers", "P0", None, entries, None, "P0") is None
    assert known_failures.match("transformers", "P0", None, entries, None) is None  # check unknown: no xfail
    bad = tmp_path / "kf.json"
    bad.write_text(json.dumps([{"target": "t", "property": "P0", "check": "P1/concat", "pattern": "a P0 finding, quoted", "reason": "r"}]))
    with pytest.raises(known_failures.KnownFailuresError, match="not a check of property 'P0'"):
        known_failures.load(bad)


def test_the_alibi_edge_case_is_the_only_p0_case_off_8():
    assert [name for name, c in EDGE_CASES.items() if c.cfg.alibi_bias_max != 8] == ["alibi-bias-max-16"]


def test_the_docs_reach_table_is_the_default_runs_draws():
    """docs/reach.md's block is what `python -m mpt_kv reach --draw ci` prints: a stale table fails here
    (regenerate: python -m mpt_kv reach --update-docs). In a fresh process, as the command runs: the
    ops programs' draws in a process that ran other tests first can differ (measured: ops-P3's
    padding and prompt lengths after tests/test_bad_inputs.py). docs/families.md's block: below."""
    import subprocess
    import sys

    from mpt_kv import package_data

    run = subprocess.run([sys.executable, "-m", "mpt_kv", "reach", "--check", "--doc", str(package_data.REACH_DOC)],
                         capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr


def test_reach_update_docs_then_check(tmp_path, capsys):
    from mpt_kv.cli import reach as reach_cli

    doc = tmp_path / "reach.md"
    doc.write_text("# r\n\n<!-- reach:begin -->\nstale\n<!-- reach:end -->\nafter\n")
    assert reach_cli.main(["--check", "--doc", str(doc)]) == 1
    assert "stale: run python -m mpt_kv reach --update-docs" in capsys.readouterr().err
    assert reach_cli.main(["--update-docs", "--doc", str(doc)]) == 0
    assert reach_cli.main(["--check", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# r\n\n<!-- reach:begin -->\n| knob |") and text.endswith("<!-- reach:end -->\nafter\n")
    assert "ops-memory" in text.splitlines()[3]  # every check's column, the ops checks' included


@pytest.mark.parametrize("argv, message", [
    (["--doc", "x.md"], "--doc is only read with --update-docs or --check"),
    (["--check", "r.json"], "compare the default run's draws, not a report"),
    (["--check", "--doc", "/nonexistent/reach.md"], "No such file"),
])
def test_reach_cli_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    from mpt_kv.cli import reach as reach_cli

    with pytest.raises(SystemExit) as info:
        reach_cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# --- the family checks' reach: the design edges their programs reached, measured --------------------------------

# the edges docs/families.md claims, the check whose program is claimed to reach each, the families
CLAIMED = {
    (reach.WINDOW_PROMPT, "family-P1/concat"): {"gemma2", "gpt_neo"},
    (reach.WINDOW_DECODE, "family-P1/concat"): {"gpt_oss", "mistral"},
    (reach.WINDOW_EXTEND, "family-P1/concat"): {"gemma3"},
    (reach.WINDOW_CROP, "family-ops/concat"): {"gemma2", "gemma3", "gpt_oss", "gpt_neo", "mistral"},
    (reach.LATENT, "family-P1/concat"): {"deepseek_v2", "deepseek_v3"},
    (reach.EXPERTS, "family-P1/concat"): {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"},
}


def not_reached(records, claimed=CLAIMED) -> dict:
    """{(edge, check): the claimed families whose records do not have the edge}."""
    out = {}
    for (edge, check), families in claimed.items():
        reached = {r["knobs"][edge] for r in records if r["check"] == check and edge in r["knobs"]}
        if families - reached:
            out[(edge, check)] = sorted(families - reached)
    return out


@pytest.fixture(scope="module")
def family_program():
    """The run docs/families.md's block is made from (family-P1 and family-ops, transformers, concat), on
    runners built here (none another test built, perhaps under a patch)."""
    from mpt_kv.checks import family_driver

    family_driver.clear_caches()
    return registry_of_checks().family_program_records()


def registry_of_checks():
    from mpt_kv.checks import registry

    return registry


def test_the_family_programs_reach_every_edge_the_zoo_claims(family_program):
    assert not_reached(family_program) == {}
    for r in family_program:
        if r["check"] == "family-P1/concat" and reach.EXPERTS in r["knobs"]:
            k = r["knobs"]  # 2 of 4, seen by the routers themselves, and a cached call routes only its new tokens
            assert (k["experts_per_token"], k["experts"], k["routed_tokens_per_row"]) == (2, 4, 1), k
            assert k[reach.ROUTING] == k["family"]
    latent = [r["knobs"] for r in family_program if r["knobs"].get(reach.LATENT)]
    assert {(k["latent_rank"], k["head_dim"]) for k in latent} == {(4, 12)}


def test_the_docs_family_table_is_the_family_programs_run(family_program):
    """docs/families.md's block is what `python -m mpt_kv reach --update-docs` writes there: a stale one
    fails here (in this process: the family programs are deterministic, fixed prompts and weights, on
    runners of their own, measured the same in a fresh process and after the other tests)."""
    from mpt_kv import package_data
    from mpt_kv.cli import docblocks

    text, start, end = docblocks.read_block(package_data.FAMILIES_DOC, "family-reach")
    assert docblocks.is_current(text, start, end, "\n".join(reach.family_doc_lines(family_program)) + "\n"), (
        "the family checks' reach table in docs/families.md is stale: run python -m mpt_kv reach --update-docs")


@pytest.mark.optimum_habana
def test_the_remote_code_families_programs_reach_their_edges():
    """decilm has no transformers model: its port is the model (optimum-habana's env). Its edge, measured
    as the block's: its cache holds 4, 2 and 1 K/V heads in its three layers (read from the cached
    tensors). minicpm's port runs off an HPU through the kernel stand-in (its FusedSDPA): its latent,
    smaller than the head dim, is reached."""
    records = registry_of_checks().family_program_records(["minicpm", "decilm"], implementation="optimum-habana")
    assert not_reached(records, {(reach.MIXED_HEADS, "family-P1/concat"): {"decilm"},
                                 (reach.MIXED_HEADS, "family-ops/concat"): {"decilm"}}) == {}
    decilm = [r["knobs"] for r in records if r["knobs"].get("family") == "decilm"]
    assert {(k["kv_heads"], k["kv_heads_cached"]) for k in decilm} == {("4, 2, 1", "4, 2, 1")}
    assert not_reached(records, {(reach.LATENT, "family-P1/concat"): {"minicpm"}}) == {}


def test_a_shorter_program_leaves_the_window_edges_unreached(monkeypatch):
    """No decode steps before a 2-token cached call: gpt_oss's window (7) is crossed by that call (6 + 2),
    not by a decode, and gemma3's (9) never (6 + 2 + 1 positions): the claims test fails naming them."""
    from mpt_kv.checks import family_driver

    monkeypatch.setattr(family_driver, "STEPS", 0)
    monkeypatch.setattr(family_driver, "EXTEND", 2)
    records = registry_of_checks().family_program_records(["gpt_oss", "gemma3"], checks=("family-P1/concat",))
    claimed = {key: families & {"gpt_oss", "gemma3"} for key, families in CLAIMED.items()
               if key[1] == "family-P1/concat" and families & {"gpt_oss", "gemma3"}}
    assert not_reached(records, claimed) == {(reach.WINDOW_DECODE, "family-P1/concat"): ["gpt_oss"],
                                             (reach.WINDOW_EXTEND, "family-P1/concat"): ["gemma3"]}
    by_family = {r["knobs"]["family"]: r["knobs"] for r in records if "family" in r["knobs"]}
    assert by_family["gemma3"][reach.WINDOW_NEVER] == "gemma3" and by_family["gemma3"]["total_len"] == 9
    assert by_family["gpt_oss"][reach.WINDOW_EXTEND] == "gpt_oss"


def test_experts_are_the_routers_own_not_the_configs(monkeypatch):
    """Without the routers' hooks (no router found), no case says it routed 2 of 4: the config alone
    claims nothing."""
    from mpt_kv.checks import family_driver

    monkeypatch.setattr(family_driver, "router_modules", lambda model: [])
    records = registry_of_checks().family_program_records(["mixtral"], checks=("family-P1/concat",))
    assert not_reached(records, {(reach.EXPERTS, "family-P1/concat"): {"mixtral"}}) == {
        (reach.EXPERTS, "family-P1/concat"): ["mixtral"]}
    assert "experts" not in records[0]["knobs"]


def test_family_reach_follows_the_calls_and_the_caches_lengths():
    r = reach.FamilyReach({"family": "f", "path": "concat"}, windows=[4, None])
    kv = lambda held, written: [(0, (2, 2, held, 8)), (0, (2, 2, held, 8)), (1, (2, 2, written, 8))]  # noqa: E731
    r.calling("prefill", 3)
    r.called("prefill", 3, kv(3, 3))     # 3 positions: inside the window
    r.called("decode", 1, kv(3, 4))      # 4: the window is full, not crossed
    r.called("extend", 3, kv(3, 7))      # 7 > 4: crossed by the k-token call; the cache kept 3 of 7
    r.called("crop", 5, kv(3, 5))        # back from 7 (past the edge) to 5
    r.called("reorder", None, None)
    first, *ops = r.records(batch=2)
    assert first[reach.WINDOW_EXTEND] == first[reach.WINDOW_CROP] == first[reach.WINDOW_DROPPED] == "f"
    assert reach.WINDOW_PROMPT not in first and reach.WINDOW_DECODE not in first and reach.WINDOW_NEVER not in first
    assert (first["prompt_len"], first["total_len"], first["window"], first["window_tokens_held"]) == (3, 7, 4, 3)
    assert ops == [{"operation": "extend", "tokens_per_call": 3}, {"operation": "crop", "tokens_per_call": 1},
                   {"operation": "reorder", "tokens_per_call": 1}]
    # a cache that keeps the whole history: the window is crossed, no position dropped
    whole = reach.FamilyReach({"family": "f", "path": "concat"}, windows=[4, None])
    whole.called("prefill", 6, kv(6, 6))
    assert reach.WINDOW_DROPPED not in whole.records(2)[0] and whole.records(2)[0][reach.WINDOW_PROMPT] == "f"
    # routing: a cached call that routes the whole history is not "only its new tokens"
    moe = reach.FamilyReach({"family": "m"})
    moe.calling("decode", 1)
    moe.routed(tokens=2 * 7, experts=4, top_k=2)
    moe.called("decode", 1, None)
    knobs = moe.records(batch=2)[0]
    assert knobs[reach.EXPERTS] == "m" and reach.ROUTING not in knobs and knobs["routed_tokens_per_row"] == 7


def test_a_family_case_records_its_reach_through_the_run_layer():
    """`run` on a family target records "mpt_kv_reach" as an MPT case does: the family's knobs and edges."""
    from mpt_kv.checks import running
    from mpt_kv.checks.registry import CHECKS
    from mpt_kv.targets import FamilyTarget

    got = []
    with running.running(running.RunContext(record=lambda name, value: got.append((name, value)))):
        running.run(CHECKS["family-P1/concat"], FamilyTarget("transformers", "gemma2", "hybrid-window4"))
    records = [v for n, v in got if n == "mpt_kv_reach"]
    assert records[0]["check"] == "family-P1/concat"
    k = records[0]["knobs"]
    assert {key: k[key] for key in ("family", "implementation", "variant", "path", "dtype", "batch", "n_layers",
                                    "n_heads", "kv_heads", "head_dim", "prompt_len", "total_len", "window")} == dict(
        family="gemma2", implementation="transformers", variant="hybrid-window4", path="concat", dtype="float32",
        batch=2, n_layers=2, n_heads=4, kv_heads=2, head_dim=8, prompt_len=6, total_len=12, window=4)
    assert k[reach.WINDOW_PROMPT] == "gemma2" and records[1:] == [{"check": "family-P1/concat",
                                                                   "knobs": {"operation": "extend", "tokens_per_call": 3}}]


def test_the_cli_prints_the_family_table_under_the_mpt_one(tmp_path, capsys):
    report = tmp_path / "conformance.json"
    report.write_text(json.dumps({"reach": [
        {"check": "P0", "knobs": {"batch": 8}},
        {"check": "family-P1/concat", "knobs": {"family": "gemma2", "batch": 2, reach.WINDOW_PROMPT: "gemma2"}},
        {"check": "family-ops/concat", "knobs": {"family": "gpt_oss", "batch": 3}}]}))
    assert reach.main([str(report)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "| batch | 8 (1) | 2, 16, 128 | 8 (1) |" in out  # the MPT table without the family cases
    assert out[out.index("family checks:") + 1] == "| knob or edge | this run | family-P1 | family-ops |"
    assert "| family | gemma2, gpt_oss (2) | gemma2 (1) | gpt_oss (1) |" in out
    assert f"| {reach.WINDOW_PROMPT} | gemma2 (1) | gemma2 (1) | - |" in out


def test_reach_update_docs_keeps_the_family_block(tmp_path, capsys, monkeypatch, family_program):
    from mpt_kv.checks import registry
    from mpt_kv.cli import reach as reach_cli

    monkeypatch.setattr(registry, "family_program_records", lambda: family_program)  # the run is the fixture's

    doc = tmp_path / "families.md"
    doc.write_text("# f\n\n<!-- family-reach:begin -->\nstale\n<!-- family-reach:end -->\nafter\n")
    assert reach_cli.main(["--check", "--doc", str(doc)]) == 1
    assert "family checks' reach table in" in capsys.readouterr().err
    assert reach_cli.main(["--update-docs", "--doc", str(doc)]) == 0
    assert reach_cli.main(["--check", "--doc", str(doc)]) == 0
    lines = doc.read_text().splitlines()
    assert lines[3] == "| knob or edge | this run | family-P1 | family-ops |"
    assert not any(line.startswith(("| window_tokens_held", "| cached_width")) for line in lines)  # the cache's own
