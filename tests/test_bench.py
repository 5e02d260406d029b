"""Benchmarks of a decode step and a whole generation per target, device and cache path
(pytest-benchmark, memory allocated and peak in `extra_info`), the `bench` command's files and
errors, and `greedy_generate` against an uncached oracle.

Quick and noise-proof for CI: a tiny model, fixed rounds, and no assertion on any time.
Track a change: `pytest tests/test_bench.py --benchmark-autosave`, change, then
`pytest tests/test_bench.py --benchmark-compare` (extra_info is saved with each run).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mpt_kv import devices
from mpt_kv.cli import bench
from mpt_kv.memory import analytic
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.model.generate import greedy_generate
from mpt_kv.targets import PATHS, build

CFG = ModelConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=64)
BATCH, PROMPT, NEW = 2, 8, 8
PEDANTIC = dict(rounds=3, iterations=1, warmup_rounds=1)
GRAPH_WARMUP = 2  # decode steps before timing: HPU graphs are captured on the first call of a shape



@pytest.fixture
def runner(target, device, path):
    r = build(target, CFG, random_state_dict(CFG), device, torch.float32)
    r.require(path)
    return bench.prepare_for_device(r, device.type)


def record_memory(benchmark, trace: bench.MemoryTrace, allocated: int, peak: int, **where):
    benchmark.extra_info.update(memory_allocated_bytes=allocated, max_memory_allocated_bytes=peak,
                                weights_bytes=trace.weights, **where)


def at_least_the_cache(trace: bench.MemoryTrace, what: str) -> None:
    """A meter that silently reads 0 must not pass: the cache of the last step is resident."""
    cache = analytic.kv_cache_bytes(bench.shape_of(CFG), BATCH, PROMPT + NEW - 1, 4)
    assert trace.steps[-1][0] >= trace.weights + cache, (
        f"{what}: memory allocated after the last step reads {trace.steps[-1][0]} bytes, less than the "
        f"weights {trace.weights} + the KV cache of {PROMPT + NEW - 1} positions {cache}")


@pytest.mark.parametrize("path", PATHS)
def test_decode_step(benchmark, runner, target, device, path):
    ids, mask = bench.prompt(CFG, BATCH, PROMPT, device)
    trace = bench.measure_memory(runner, device.type, path, ids, mask, NEW)
    at_least_the_cache(trace, f"{target}/{path} on {device}")
    record_memory(benchmark, trace, *trace.steps[-1], target=target, path=path, device=str(device),
                  batch=BATCH, cache_len=PROMPT + NEW - 1)

    steps = GRAPH_WARMUP + PEDANTIC["warmup_rounds"] + PEDANTIC["rounds"]
    session = runner.session(path, PROMPT + steps)
    token = torch.zeros(BATCH, 1, dtype=torch.long, device=device)
    with torch.inference_mode():
        session.prefill(ids, mask)
        for _ in range(GRAPH_WARMUP):
            session.decode(token)

        def decode_step():
            logits = session.decode(token)
            devices.sync(device.type)
            return logits

        logits = benchmark.pedantic(decode_step, **PEDANTIC)
    assert logits.shape == (BATCH, CFG.vocab_size)


@pytest.mark.parametrize("path", PATHS)
def test_generation(benchmark, runner, target, device, path):
    ids, mask = bench.prompt(CFG, BATCH, PROMPT, device)
    trace = bench.measure_memory(runner, device.type, path, ids, mask, NEW)
    at_least_the_cache(trace, f"{target}/{path} on {device}")
    record_memory(benchmark, trace, trace.allocated, trace.peak, target=target, path=path, device=str(device),
                  batch=BATCH, max_input=PROMPT, max_new=NEW)

    def generate():
        tokens = greedy_generate(runner.session(path, PROMPT + NEW), ids, mask, NEW)
        devices.sync(device.type)
        return tokens

    tokens = benchmark.pedantic(generate, **PEDANTIC)
    assert tokens.shape == (BATCH, NEW)


@pytest.mark.parametrize("path", PATHS)
def test_greedy_generate_matches_uncached_argmax(target, device, path):
    """Oracle: each token is the argmax of the target's own uncached forward over the prompt and
    the tokens generated so far; on_step sees every step in order."""
    r = build(target, CFG, random_state_dict(CFG, seed=1), device, torch.float32)
    r.require(path)
    ids, mask = bench.prompt(CFG, BATCH, PROMPT, device, seed=1)
    seen = []
    tokens = greedy_generate(r.session(path, PROMPT + NEW), ids, mask, NEW, lambda i, t: seen.append((i, t.clone())))
    assert [i for i, _ in seen] == list(range(NEW))
    with torch.inference_mode():
        for i in range(NEW):
            want = r.logits(ids, mask)[:, -1].argmax(-1)
            assert torch.equal(tokens[:, i], want), (
                f"{target}/{path} on {device}: token {i} is {tokens[:, i].tolist()}, the uncached argmax "
                f"{want.tolist()} (B={BATCH} prompt={PROMPT})")
            assert torch.equal(seen[i][1], want)
            ids = torch.cat([ids, want[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)


# --- the bench command ---------------------------------------------------------------------

CONFIGS = [(2, 8, 4), (1, 4, 6), (3, 5, 3)]
TARGETS = ["reference", "transformers"]


def bench_args(out, *extra):
    b, i, n = CONFIGS[0]
    args = ["--model", "tiny", "--batch-size", str(b), "--max-input-tokens", str(i), "--max-new-tokens", str(n),
            "--repeat", "1", "--warmup", "0", "--out", str(out), "--quiet"]
    for c in CONFIGS[1:]:
        args += ["--config", ",".join(map(str, c))]
    for t in TARGETS:
        args += ["--target", t]
    return args + list(extra)


def test_bench_command_writes_table_json_markdown_png(tmp_path, capsys):
    assert bench.main(bench_args(tmp_path)) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    data = json.loads((tmp_path / "bench.json").read_text())
    # a path a target lacks (transformers 4.x: static) is skipped with its reason, not dropped
    skipped = {(s["target"], s["path"]) for s in data["skipped"] if s["reason"]}
    expected = {(t, p, *c) for t in TARGETS for p in PATHS for c in CONFIGS if (t, p) not in skipped}
    assert ("reference", "static") not in skipped, data["skipped"]

    rows = data["rows"]
    got = {(r["target"], r["path"], r["batch"], r["max_input"], r["max_new"]) for r in rows}
    assert got == expected and len(rows) == len(expected), f"json rows {sorted(got)}, expected {sorted(expected)}"
    for r in rows:
        where = f"{r['target']}/{r['path']} B={r['batch']} in={r['max_input']} new={r['max_new']}"
        assert r["throughput"] > 0 and r["allocated"] > 0, where
        assert r["max_allocated"] >= r["allocated"], f"{where}: peak {r['max_allocated']} < allocated {r['allocated']}"
        assert len(r["memory_steps"]) == r["max_new"], f"{where}: {len(r['memory_steps'])} memory readings"
        assert (r["analytic_min"] is not None) == (r["path"] == "static"), where
    assert {e["batch"] for e in data["ratios"]} == {c[0] for c in CONFIGS}
    assert data["meta"]["model"] == "tiny" and data["meta"]["device"] == "cpu"

    table = [line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    for column in ("batch size", "max input tokens", "max new tokens", "throughput (tokens/s)",
                   "memory allocated (MB)", "max memory allocated (MB)"):
        assert column in head, f"markdown header {head} lacks {column!r}"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert len(cells) == len(expected) and all(len(c) == len(head) for c in cells)
    assert {(c[0], int(c[1]), int(c[2]), int(c[3])) for c in cells} == {(f"{t}/{p}", *c) for t, p, *c in expected}
    assert sum(line.startswith(("reference/", "transformers/")) for line in stdout.splitlines()) == len(expected)

    if importlib.util.find_spec("matplotlib") is None:  # an optional extra: said, not crashed
        assert "matplotlib is not installed" in captured.err
        assert not (tmp_path / "bench_memory.png").exists()
        return
    png = (tmp_path / "bench_memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


@pytest.mark.parametrize("extra,words", [
    (["--batch-size", "0"], ["--batch-size 0", ">= 1"]),
    (["--max-new-tokens", "60"], ["8 + max new 60 = 68", "max_seq_len 64", "'tiny'"]),
    (["--config", "2,50,50"], ["100", "max_seq_len 64"]),
    (["--config", "2,8"], ["'2,8'", "BATCH,MAX_INPUT,MAX_NEW"]),
    (["--model", "mpt-99b"], ["mpt-99b"]),
    (["--target", "nosuch"], ["'nosuch'", "reference"]),
    (["--target", "mpt_kv.no_such_module:build"], ["mpt_kv.no_such_module", "cannot"]),
])
def test_bench_command_rejects_bad_config(tmp_path, capsys, extra, words):
    with pytest.raises(SystemExit) as e:
        bench.main(bench_args(tmp_path, *extra))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    for w in words:
        assert w in err, f"error message lacks {w!r}: {err}"
    assert not (tmp_path / "bench.json").exists()
