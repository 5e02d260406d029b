"""Issue 19's bad inputs, one case per row: each raises the error class given, with a message
that names the value (and the limit, where there is one), before any work, allocation or write.
Rows the suite accepts on purpose say so in `test_accepted_on_purpose`. The runners' rows run
on every target the plugin parametrizes (reference, transformers, optimum-habana where installed).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys

import pytest
import torch

import mpt_kv
from mpt_kv import Capabilities
from mpt_kv.checks import properties as P
from mpt_kv.checks.registry import CHECKS
from mpt_kv.cli import bench, killmatrix, memory, run
from mpt_kv.outputs import dir_problem, file_problem
from mpt_kv.errors import InputError, TargetBroken, TargetUnavailable, UnknownName, Unsupported
from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.model.reference import ReferenceMPT
import mpt_kv.targets.layouts
from mpt_kv.targets import build
from mpt_kv.targets.wrappers import GaudiStyleRunner

CFG = ModelConfig(d_model=8, n_heads=2, n_layers=2, vocab_size=16, max_seq_len=8)
HUGE = dict(d_model=65536, n_heads=64, n_layers=64, vocab_size=50432, max_seq_len=2048)  # ~13 TB of fp32 weights


@functools.lru_cache(maxsize=1)
def model() -> ReferenceMPT:
    return ReferenceMPT(CFG).load_hf_state_dict(random_state_dict(CFG)).eval()


def prompt(batch=2, length=3):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (batch, length), generator=g), torch.ones(batch, length, dtype=torch.long)


def forward_with_mask(mask):
    return model()(prompt(2, 3)[0], mask)


def static_after_prefill(length=5, cache_len=8):
    cache = model().new_cache("static", 2, cache_len)
    model()(*prompt(2, length), cache)
    return cache


def static_decode(token_idx=None, cache_idx=None, mask=None, cache=None):
    cache = cache or static_after_prefill()
    mask = torch.ones(2, cache.max_len if cache_idx is None else int(cache_idx), dtype=torch.long) if mask is None else mask
    return model()(torch.zeros(2, 1, dtype=torch.long), mask, cache, token_idx, cache_idx)


def future_only_mask():
    """Decode at token_idx 6 (slot 5): each row's only 1 on slot 7, a slot after this step."""
    mask = torch.zeros(2, 8, dtype=torch.long)
    mask[:, 7] = 1
    return mask


def concat_with(layer1):
    """A concat cache of 3 positions in layer 0 whose layer 1 is `layer1(cache)`."""
    cache = model().new_cache("concat", 2)
    model()(*prompt(2, 3), cache)
    cache.kv[1] = layer1(cache)
    return model()(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), cache)


def state_dict_with_head(head):
    sd = random_state_dict(CFG)
    sd["lm_head.weight"] = head(sd["transformer.wte.weight"])
    return ReferenceMPT(CFG).load_hf_state_dict(sd)


def reference_session(*args):
    return build("reference", CFG, random_state_dict(CFG), "cpu", torch.float32).session(*args)


def cli(main, *argv):
    """A CLI's usage error: SystemExit 2 with the message on stderr (returned by the test)."""
    return main(list(argv))


ROWS = [
    # --- ModelConfig: every field checked where it enters --------------------------------------
    pytest.param(lambda: ModelConfig(clip_qkv=math.nan), InputError, r"clip_qkv=nan: must be a finite number > 0", id="clip_qkv-nan"),
    pytest.param(lambda: ModelConfig(layer_norm_epsilon=math.nan), InputError, r"layer_norm_epsilon=nan: must be a finite",
                 id="layer_norm_epsilon-nan"),
    pytest.param(lambda: ModelConfig(alibi_bias_max=0), InputError, r"alibi_bias_max=0: must be a finite number > 0",
                 id="alibi_bias_max-0"),
    pytest.param(lambda: ModelConfig(alibi_bias_max=-8), InputError, r"alibi_bias_max=-8: must be", id="alibi_bias_max-negative"),
    pytest.param(lambda: ModelConfig(layer_norm_epsilon=-1), InputError, r"layer_norm_epsilon=-1: must be a finite number > 0",
                 id="layer_norm_epsilon-negative"),
    pytest.param(lambda: ModelConfig(d_model=32.0), InputError, r"d_model=32.0 \(float\): must be an int >= 1", id="float-size"),
    pytest.param(lambda: ModelConfig(n_layers=True), InputError, r"n_layers=True \(bool\): must be an int", id="bool-size"),
    pytest.param(lambda: ModelConfig(max_seq_len=2 ** 31), InputError,
                 r"max_seq_len=2147483648 exceeds 16777216 \(2\*\*24\)", id="max_seq_len-2**31"),
    pytest.param(lambda: random_state_dict(ModelConfig(**HUGE)), InputError,
                 r"random_state_dict: .*d_model=65536.* needs about \d+\.\d GiB of cpu memory .* but only \d+\.\d GiB is free",
                 id="random_state_dict-too-big"),
    pytest.param(lambda: ReferenceMPT(ModelConfig(**HUGE)), InputError,
                 r"ReferenceMPT: .* needs about \d+\.\d GiB .* only \d+\.\d GiB is free", id="ReferenceMPT-too-big"),
    # --- masks ------------------------------------------------------------------------------------
    pytest.param(lambda: forward_with_mask(torch.tensor([[1, 2, 1], [1, 1, 1]])), InputError,
                 r"attention_mask values \[2\]: expected 0 \(padding\) or 1", id="mask-2"),
    pytest.param(lambda: forward_with_mask(torch.tensor([[1, -1, 1], [1, 1, 1]])), InputError,
                 r"attention_mask values \[-1\]: expected 0", id="mask--1"),
    pytest.param(lambda: forward_with_mask(torch.tensor([[0, 0, -10000], [0, -10000, 0]])), InputError,
                 r"attention_mask values \[-10000\]: .*an additive mask \(0 / -10000\)", id="mask-additive"),
    pytest.param(lambda: static_decode(torch.tensor([6]), mask=future_only_mask()), InputError,
                 r"attention_mask rows \[0, 1\] mask every one of the 6 positions up to the current one", id="mask-only-future"),
    # --- caches -------------------------------------------------------------------------------------
    pytest.param(lambda: concat_with(lambda c: None), InputError, r"cache layers hold \[3, 0\] positions", id="concat-layer1-None"),
    pytest.param(lambda: concat_with(lambda c: tuple(t[:, :, :2] for t in c.kv[0])), InputError,
                 r"cache layers hold \[3, 2\] positions", id="concat-layer1-shorter"),
    pytest.param(lambda: model().new_cache("static", 2, max_len=0), InputError, r"static cache length max_len=0 must be >= 1",
                 id="new_cache-max_len-0"),
    pytest.param(lambda: model().new_cache("static", 2, max_len=4.0), InputError, r"max_len=4.0 \(float\)", id="new_cache-float"),
    pytest.param(lambda: StaticCache(1, 0, 2, 4, 4, torch.float32, "cpu"), InputError, r"StaticCache batch=0 must be >= 1",
                 id="StaticCache-batch-0"),
    pytest.param(lambda: state_dict_with_head(lambda w: w[:, :4]), InputError,
                 r"lm_head.weight shape \(16, 4\): expected \(16, 8\)", id="lm_head-shape"),
    pytest.param(lambda: state_dict_with_head(lambda w: w + 1), InputError,
                 r"lm_head.weight differs from transformer.wte.weight \(max abs difference 1.000e\+00\): MPT ties them",
                 id="lm_head-untied"),
    # --- token_idx / cache_idx ------------------------------------------------------------------------
    pytest.param(lambda: static_decode(torch.tensor([6, 7])), InputError, r"token_idx shape \(2,\): expected one position",
                 id="token_idx-vector"),
    pytest.param(lambda: static_decode(torch.tensor([6.0])), InputError, r"token_idx dtype torch.float32", id="token_idx-float"),
    pytest.param(lambda: static_decode(torch.tensor([True])), InputError, r"token_idx dtype torch.bool", id="token_idx-bool"),
    pytest.param(lambda: static_decode(6), InputError, r"token_idx=6 \(int\): expected a 1-element integer tensor", id="token_idx-int"),
    pytest.param(lambda: static_decode("6"), InputError, r"token_idx='6' \(str\)", id="token_idx-str"),
    pytest.param(lambda: static_decode(torch.tensor([6]), 8.5), InputError, r"cache_idx=8.5 \(float\)", id="cache_idx-float"),
    pytest.param(lambda: model()(torch.zeros(2, 3, dtype=torch.uint8)), InputError,
                 r"input_ids dtype torch.uint8: expected .*torch.int64 or torch.int32", id="uint8-ids"),
    # --- sessions -------------------------------------------------------------------------------------
    pytest.param(lambda: reference_session("static", 6.0), InputError, r"max_len=6.0 \(float\): must be an int in 1..max_seq_len=8",
                 id="session-float-length"),
    pytest.param(lambda: reference_session("static", 6, 2.5), InputError, r"bucket=2.5: .*an int size >= 1", id="session-float-bucket"),
    pytest.param(lambda: reference_session("concat", 6).prefill(prompt()[0], None), InputError,
                 r"prefill attention_mask is None: pass the \(2, 3\) mask", id="prefill-mask-None"),
    pytest.param(lambda: reference_session("paged", 6), InputError,
                 r"unknown cache path 'paged': expected one of \('concat', 'static'\)", id="session-paged"),
    # --- the public API -------------------------------------------------------------------------------
    pytest.param(lambda: Capabilities(graph_outputs="no"), TypeError, r"graph_outputs='no' \(str\): must be True or False",
                 id="Capabilities-graph_outputs-str"),
    pytest.param(lambda: Capabilities("bf16"), TypeError, r"unsupported='bf16' \(str\): give a mapping feature -> reason",
                 id="Capabilities-str"),
    pytest.param(lambda: Capabilities(["bf16"]), TypeError, r"unsupported=\['bf16'\] \(list\): give a mapping", id="Capabilities-list"),
    pytest.param(lambda: mpt_kv.parametrize_with_checks("reference"), TypeError,
                 r"targets='reference' is one str, not a list: pass targets=\[\"reference\"\]", id="parametrize-targets-str"),
    pytest.param(lambda: mpt_kv.parametrize_with_checks(["reference"], checks="P1"), TypeError,
                 r"checks='P1' is one str, not a list: pass checks=\[\"P1\"\]", id="parametrize-checks-str"),
    pytest.param(lambda: CHECKS["P1"], KeyError, r"unknown check id 'P1': 'P1' is a property.*P1/concat, P1/static",
                 id="CHECKS-property"),
    pytest.param(lambda: CHECKS["P1/statc"], KeyError, r"unknown check id 'P1/statc': closest ids: P1/static", id="CHECKS-typo"),
    pytest.param(lambda: CHECKS["static-shape/static"]("reference", "cpu", torch.float16), ValueError,
                 r"dtype torch.float16: the suite supports fp32, bf16 only", id="CHECKS-float16"),
    # --- the CLIs: every usage error before any work ------------------------------------------------------
    pytest.param(lambda: cli(run.main, "--report", "/proc/x.json"), SystemExit, r"--report /proc/x.json: /proc/x.json cannot be written",
                 id="run-report-proc"),
    pytest.param(lambda: cli(killmatrix.main, "--json", "/proc/x.json"), SystemExit, r"--json /proc/x.json: .* cannot be written",
                 id="killmatrix-json-proc"),
    pytest.param(lambda: cli(killmatrix.main, "--markdown", ""), SystemExit, r"--markdown : an empty path", id="killmatrix-markdown-empty"),
    pytest.param(lambda: cli(killmatrix.main, "--json", "/tmp"), SystemExit, r"--json /tmp: /tmp is a folder", id="killmatrix-json-dir"),
    pytest.param(lambda: cli(bench.main, "--out", "/proc/x"), SystemExit, r"--out /proc/x: /proc/x cannot be written", id="bench-out-proc"),
    pytest.param(lambda: cli(memory.main, "--max-new-tokens", "0"), SystemExit, r"--max-new-tokens must be >= 1 .*got 0",
                 id="memory-max-new-0"),
    pytest.param(lambda: cli(killmatrix.main, "--device", "cpu:3"), SystemExit,
                 r"--device cpu:3 is not available here: cpu is one device", id="killmatrix-cpu:3"),
    # --- issue 38: nothing the user did not name is written; an adapter's mistake named at construction -------------
    pytest.param(lambda: cli(__import__("mpt_kv.cli.findings", fromlist=["main"]).main, "--repro", ""), SystemExit,
                 r"--repro: an empty path \(''\) names no file or folder", id="findings-repro-empty"),
    pytest.param(lambda: __import__("mpt_kv").CallableRunner(torch.nn.Linear(1, 1), cfg=ModelConfig(), logits=None,
                                                             new_cache=len, step=len, kv=len),
                 TypeError, r"CallableRunner logits=None: expected a callable", id="callable-runner-logits-None"),
    pytest.param(lambda: __import__("mpt_kv").QuantizedKV(torch.int8, "token", codes=5), TypeError,
                 r"QuantizedKV\(codes=5\): expected a list of per-layer \(key, value\) pairs", id="quantized-kv-codes-5"),
]


@pytest.mark.parametrize("bad, error, match", ROWS)
def test_bad_input_is_a_clear_error(bad, error, match, capsys):
    with pytest.raises(error) as e:
        bad()
    message = capsys.readouterr().err if error is SystemExit else str(e.value)
    if error is SystemExit:
        assert e.value.code == 2, message
    assert re.search(match, message), f"{message!r} does not match {match!r}"


# --- no partial update: nothing is written before the whole update is validated ------------------------
@pytest.mark.parametrize("token_idx, cache_idx", [
    pytest.param(torch.tensor([6]), 8.5, id="cache_idx-8.5"),
    pytest.param(torch.tensor([6, 7]), None, id="token_idx-vector"),
    pytest.param(torch.tensor([6.0]), None, id="token_idx-float"),
    pytest.param(6, None, id="token_idx-int"),
])
def test_a_rejected_step_leaves_every_layer_of_the_cache_as_it_was(token_idx, cache_idx):
    cache = static_after_prefill()
    before = [(k.clone(), v.clone()) for k, v in cache.kv]
    with pytest.raises(InputError):
        static_decode(token_idx, cache_idx, cache=cache)
    for layer, ((k, v), (k0, v0)) in enumerate(zip(cache.kv, before)):
        assert torch.equal(k, k0) and torch.equal(v, v0), f"layer {layer} was written by a rejected step"


# --- every runner's prefill reads masks the same way (check_prompt) -----------------------------------------
@pytest.fixture
def runner(target, device):
    return build(target, CFG, random_state_dict(CFG), device, torch.float32)


@pytest.mark.parametrize("path", ["concat", "static"])
@pytest.mark.parametrize("values, match", [
    pytest.param([1, 2], r"attention_mask values \[2\]", id="2"),
    pytest.param([1, -1], r"attention_mask values \[-1\]", id="-1"),
    pytest.param([0, -10000], r"attention_mask values \[-10000\]: .*additive", id="additive"),
])
def test_every_runner_refuses_a_mask_that_is_not_0_1(runner, device, path, values, match):
    runner.require(path)
    ids, mask = prompt(2, 4)
    mask[0, :2] = torch.tensor(values)
    session = runner.session(path, 6)
    with pytest.raises(InputError, match=match):
        session.prefill(ids.to(device), mask.to(device))
    assert session.written == 0


def test_every_runner_names_the_known_paths(runner):
    with pytest.raises(InputError, match=r"unknown cache path.*'paged'.*concat.*static"):
        runner.session("paged", 6)


class DesignCache:
    """A design's own cache (docs/targets.md, "Building one from the reference's pieces"): no
    ConcatCache or StaticCache, just the `update` attention calls; here the prompt attends over its
    own k, v, as the reference's static prefill does."""

    def __init__(self):
        self.layers = []

    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        self.layers.append(layer)
        return k, v


def test_a_design_cache_with_update_is_accepted_and_used():
    ids, mask = prompt(2, 3)
    cache = DesignCache()
    torch.testing.assert_close(model()(ids, mask, cache), model()(ids, mask), rtol=0, atol=0)
    assert cache.layers == list(range(CFG.n_layers))


@pytest.mark.parametrize("cache", [pytest.param([], id="list"), pytest.param({}, id="dict"),
                                   pytest.param((None, None), id="tuple")])
def test_an_object_without_the_cache_interface_is_refused(cache):
    """A dict's builtin update is not the interface: it is refused like a list, before any layer runs."""
    with pytest.raises(InputError, match=rf"cache is a {type(cache).__name__}: expected a ConcatCache or StaticCache "
                                         r".*a callable update\(layer, k, v, token_idx, cache_idx\)"):
        model()(*prompt(2, 3), cache)
    with pytest.raises(InputError, match=rf"cache is a {type(cache).__name__}: expected"):  # a cached call's token_idx
        model()(*prompt(2, 3), cache, torch.tensor([3]))


# --- accepted on purpose (documented in the README's "Bad input") ---------------------------------------------
def test_accepted_on_purpose():
    """int32 ids and masks and a bool mask are legitimate (optimum-habana and transformers pass
    them); a NaN fill for a static cache is the hazards tests' poison; cache_idx as an int is
    optimum-habana's protocol."""
    ids, mask = prompt(2, 3)
    assert model()(ids.int(), mask.int()).shape == (2, 3, CFG.vocab_size)
    assert model()(ids, mask.bool()).shape == (2, 3, CFG.vocab_size)
    assert torch.isnan(model().new_cache("static", 2, 4, fill=math.nan).kv[0][0]).all()
    cache = static_after_prefill(length=5)
    assert static_decode(torch.tensor([6]), 8, cache=cache).shape == (2, 1, CFG.vocab_size)
    assert file_problem("/tmp/mpt-kv-never-made/x/y.json") is None and dir_problem("/tmp/mpt-kv-never-made/z") is None
    assert not os.path.exists("/tmp/mpt-kv-never-made"), "the check left the folders it made behind"


# --- the CLIs: parse first, a factory that fails, help, progress ----------------------------------------------
def test_run_refuses_an_unknown_option_before_building_any_target(monkeypatch):
    monkeypatch.setattr(run, "describe_machine", lambda *a: pytest.fail("a target was built before parsing"))
    assert run.main(["--frobnicate", "--report", "/tmp/mpt-kv-never-written.json"]) == 4  # pytest's usage error


FACTORIES = '''
def raises(cfg, sd, device, dtype):
    raise RuntimeError("boom in the factory")

def returns_none(cfg, sd, device, dtype):
    return None
'''


@pytest.mark.parametrize("factory, match", [
    ("raises", r"target badfactories:raises does not build on cpu: RuntimeError: boom in the factory"),
    ("returns_none", r"target badfactories:returns_none does not build on cpu: TypeError: .*returned NoneType"),
])
def test_bench_target_whose_factory_fails_is_a_usage_error(tmp_path, monkeypatch, capsys, factory, match):
    (tmp_path / "badfactories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        bench.main(["--target", f"badfactories:{factory}", "--out", str(tmp_path / "out"), "--quiet"])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("main", [memory.main, bench.main], ids=["memory", "bench"])
def test_help_does_not_stop_mid_sentence(main, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())  # usage, then the description paragraph
    assert description.endswith((".", ")")), description


def test_killmatrix_prints_a_line_per_row_to_stderr(capsys):
    from mpt_kv.catalogue.designs import DESIGNS
    from mpt_kv.catalogue.variants import VARIANTS

    design, variant = next(iter(DESIGNS.values())), next(iter(VARIANTS.values()))
    rows, variants = killmatrix.with_progress([design], [variant], 0.0)
    assert "rows; reference first" in capsys.readouterr().err
    for row in (*rows, *variants):
        row.build(CFG, random_state_dict(CFG), torch.device("cpu"), torch.float32)
        row.build(CFG, random_state_dict(CFG), torch.device("cpu"), torch.float32)  # one line per row, not per build
    err = capsys.readouterr().err.splitlines()
    assert err == [f"killmatrix: [2/3] must-pass design {design.name} ({err[0].rsplit('(', 1)[1]}",
                   f"killmatrix: [3/3] must-kill variant {variant.name} ({err[1].rsplit('(', 1)[1]}"], err


def test_bench_prints_a_line_per_config_without_a_terminal(capsys):
    runners = {"reference": build("reference", CFG, random_state_dict(CFG), "cpu", torch.float32)}
    configs = [bench.BenchConfig(1, 2, 2), bench.BenchConfig(2, 2, 2)]
    progress = bench.progress_bar(1, quiet=False)  # capsys: stderr is not a terminal
    rows = bench.run(CFG, configs, runners, [("reference", "static")], "cpu", torch.float32, 1, 0, 0, progress)
    assert len(rows) == 2
    err = capsys.readouterr().err
    assert "bench: config 1/2 B=1 in=2 new=2" in err and "bench: config 2/2 B=2 in=2 new=2" in err, err


# --- notes say whether anything is wrong ------------------------------------------------------------------
def test_a_near_tie_note_says_it_is_not_a_failure():
    c = P.Context("t", "cpu", torch.float32, P.Case(CFG, (3,), 1, seed=0))
    oracle = torch.tensor([[1.0, 0.99, 0.0]])
    tol = type("Tol", (), {"bound": lambda self, x: 0.01})()
    P.check_token(torch.tensor([[1]]), oracle, tol, c, step=2)
    assert len(c.notes) == 1 and c.notes[0].startswith("near-tie (not a failure) at step 2, row 0: the cached path "
                                                       "chose token 1, the oracle's top token 0 is 1.00e-02 higher, "
                                                       "within 2 x the bound (2.00e-02), so the greedy choice may "
                                                       "legitimately differ"), c.notes


def test_the_p4_graphs_note_names_the_suites_stand_in_not_the_target():
    notes = CHECKS["P4/static/graphs"]("reference", "cpu", "fp32")
    assert notes and all("as declared by the suite's CPU graph stand-in (graphs.StaticOutputs" in n for n in notes), notes
    assert not any("the target (its Capabilities" in n for n in notes), notes


# --- issue 25: bad inputs by class, each a clear error before any work --------------------------------------
def expect(bad, error, match):
    with pytest.raises(error) as e:
        bad()
    assert re.search(match, str(e.value)), f"{type(e.value).__name__}: {e.value!s} does not match {match!r}"
    return e.value


def without(key, sd=None):
    sd = dict(sd or random_state_dict(CFG))
    del sd[key]
    return sd


def with_value(key, value):
    return {**random_state_dict(CFG), key: value}


def load(sd):
    return ReferenceMPT(CFG).load_hf_state_dict(sd)


def build_reference(device="cpu", dtype=torch.float32, sd=None):
    return build("reference", CFG, random_state_dict(CFG) if sd is None else sd, device, dtype)


WQKV = "transformer.blocks.0.attn.Wqkv.weight"


@pytest.mark.parametrize("bad, match", [
    pytest.param(lambda: CHECKS["static-shape/static"]("reference", "xyz", "fp32"),
                 r"device 'xyz' \(str\): expected a str or torch.device of kind cpu, cuda, hpu", id="CHECKS-device-xyz"),
    pytest.param(lambda: CHECKS["static-shape/static"]("reference", 0, "fp32"), r"device 0 \(int\)", id="CHECKS-device-int"),
    pytest.param(lambda: CHECKS["static-shape/static"]("reference", "meta", "fp32"), r"device 'meta' \(str\)",
                 id="CHECKS-device-meta"),
    pytest.param(lambda: build_reference("xyz"), r"device 'xyz' \(str\)", id="build-device-xyz"),
    pytest.param(lambda: build_reference(torch.device("meta")), r"device device\(type='meta'\)", id="build-device-meta"),
    pytest.param(lambda: build_reference(dtype="fp32x"), r"dtype 'fp32x': the suite supports fp32, bf16 only",
                 id="build-dtype-str"),
    pytest.param(lambda: build_reference(dtype=torch.int32), r"dtype torch.int32: the suite supports", id="build-dtype-int32"),
    pytest.param(lambda: build_reference(dtype=1), r"dtype 1: the suite supports", id="build-dtype-int"),
    pytest.param(lambda: load(None), r"state_dict is NoneType: expected a dict .*for ModelConfig\(d_model=8", id="sd-None"),
    pytest.param(lambda: load(without("transformer.norm_f.weight")),
                 r"state_dict keys: missing \['transformer.norm_f.weight'\], unexpected \[\] .*ModelConfig\(d_model=8",
                 id="sd-missing-key"),
    pytest.param(lambda: load(with_value("transformer.blocks.2.attn.Wqkv.weight", torch.zeros(24, 8))),
                 r"missing \[\], unexpected \['transformer.blocks.2.attn.Wqkv.weight'\] \(of 15 keys for ModelConfig\(",
                 id="sd-extra-key"),
    pytest.param(lambda: load(with_value(WQKV, torch.zeros(24, 4))),
                 rf"{WQKV} shape \(24, 4\): expected \(24, 8\) for ModelConfig\(d_model=8", id="sd-wrong-shape"),
    pytest.param(lambda: load(with_value(WQKV, torch.zeros(24, 8, device="meta"))),
                 rf"state_dict\['{WQKV}'\] is a torch.float32 tensor on meta: expected a floating tensor with data",
                 id="sd-meta-tensor"),
    pytest.param(lambda: load(with_value(WQKV, torch.zeros(24, 8, dtype=torch.long))),
                 r"is a torch.int64 tensor on cpu", id="sd-int-tensor"),
    pytest.param(lambda: build_reference(sd=without(WQKV)), rf"missing \['{WQKV}'\]", id="build-sd-missing-key"),
])
def test_bad_device_dtype_or_state_dict_is_an_input_error(bad, match):
    expect(bad, InputError, match)


TARGET_MODULES = {
    "badfactories25": FACTORIES + "\nNOT_A_FACTORY = 3\n\ndef one_argument(cfg):\n    return None\n",
    "badsyntax25": "def build(cfg, sd, device, dtype)\n    return None\n",
}


@pytest.fixture
def target_modules(tmp_path, monkeypatch):
    for name, text in TARGET_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))


def one_argument(cfg):
    return None


@pytest.mark.parametrize("bad, error, match", [
    pytest.param(lambda: mpt_kv.targets.resolve_target("badfactories25:NOT_A_FACTORY"), TargetUnavailable,
                 r"target 'badfactories25:NOT_A_FACTORY': badfactories25.NOT_A_FACTORY is a int, not a factory",
                 id="spec-not-callable"),
    pytest.param(lambda: mpt_kv.targets.resolve_target(":build"), TargetUnavailable,
                 r"target ':build': expected 'package.module:factory', both parts non-empty", id="spec-no-module"),
    pytest.param(lambda: mpt_kv.targets.resolve_target("os.path:"), TargetUnavailable, r"both parts non-empty",
                 id="spec-no-factory"),
    pytest.param(lambda: mpt_kv.targets.resolve_target("badsyntax25:build"), TargetUnavailable,
                 r"target 'badsyntax25:build': importing badsyntax25 raised SyntaxError", id="spec-SyntaxError"),
    pytest.param(lambda: mpt_kv.targets.resolve_target("badfactories25:one_argument"), TypeError,
                 r"target badfactories25:one_argument: the factory 'one_argument'\(cfg\) cannot be called as "
                 r"build\(cfg, state_dict, device, dtype\)", id="spec-wrong-signature"),
    pytest.param(lambda: mpt_kv.targets.resolve_target(one_argument), TypeError,
                 r"the factory 'one_argument'\(cfg\) cannot be called", id="factory-wrong-signature"),
    pytest.param(lambda: build("badfactories25:raises", CFG, random_state_dict(CFG), "cpu", torch.float32), TargetBroken,
                 r"target badfactories25:raises does not build on cpu: RuntimeError: boom in the factory",
                 id="factory-raises"),
    pytest.param(lambda: build("os.path:join", CFG, random_state_dict(CFG), "cpu", torch.float32), TargetBroken,
                 r"target os.path:join does not build on cpu: TypeError: ", id="os.path:join"),
    pytest.param(lambda: GaudiStyleRunner(model(), "cpu", capabilities={"bf16": "fp32 only"}, cfg=CFG), TypeError,
                 r"capabilities=\{'bf16': 'fp32 only'\} \(dict\): pass a mpt_kv.Capabilities", id="Capabilities-dict"),
    pytest.param(lambda: mpt_kv.parametrize_with_checks(["reference"], expected_failed_checks=["P0"]), TypeError,
                 r"expected_failed_checks=\['P0'\] \(list\): give a mapping check id -> reason",
                 id="expected_failed_checks-list"),
])
def test_bad_target_spec_or_factory_is_one_clear_error(target_modules, bad, error, match):
    expect(bad, error, match)


def concat_cache(length=3):
    cache = model().new_cache("concat", 2)
    model()(*prompt(2, length), cache)
    return cache


def paged(lengths):
    pool = torch.zeros(4, CFG.n_heads, 2, CFG.head_dim)
    return mpt_kv.targets.layouts.PagedLayout([(pool, pool.clone())], torch.tensor([[0, 1], [2, 3]]), 2, lengths)


@pytest.mark.parametrize("bad, match", [
    pytest.param(lambda: concat_cache().crop(-1), r"ConcatCache.crop to n=-1: expected an int in 1..3", id="concat-crop--1"),
    pytest.param(lambda: concat_cache().crop(100), r"ConcatCache.crop to n=100: expected an int in 1..3",
                 id="concat-crop-100"),
    pytest.param(lambda: concat_cache().crop(2.5), r"ConcatCache.crop to n=2.5", id="concat-crop-float"),
    pytest.param(lambda: static_after_prefill().crop(6), r"StaticCache.crop to n=6: expected an int in 1..5",
                 id="static-crop-past-written"),
    pytest.param(lambda: static_after_prefill().crop(-1), r"StaticCache.crop to n=-1", id="static-crop--1"),
    pytest.param(lambda: concat_cache().reorder(torch.tensor([0, 2])),
                 r"ConcatCache.reorder index out of range \[0, 2\): min 0, max 2", id="concat-reorder-out-of-range"),
    pytest.param(lambda: concat_cache().reorder(torch.tensor([0.0, 1.0])),
                 r"ConcatCache.reorder index torch.float32: expected a torch.int64 tensor", id="concat-reorder-float"),
    pytest.param(lambda: static_after_prefill().reorder(torch.tensor([-1, 0])), r"StaticCache.reorder index out of range",
                 id="static-reorder-negative"),
    pytest.param(lambda: static_after_prefill().reorder(torch.tensor([0])),
                 r"StaticCache.reorder index shape \(1,\): expected \(2,\)", id="static-reorder-short"),
    pytest.param(lambda: model()(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), concat_cache(),
                                 None, 4), r"cache_idx=4 on a ConcatCache: only a StaticCache attends", id="concat-cache_idx"),
    pytest.param(lambda: StaticCache(2, 1, 1, 10 ** 8, 10 ** 4, torch.float32, "cpu"),
                 r"StaticCache of 2 layers x \(batch=1, n_heads=1, max_len=100000000, head_dim=10000\) needs about "
                 r"\d+\.\d GiB of cpu memory \(K and V in torch.float32\), but only \d+\.\d GiB is free",
                 id="static-too-big"),
    pytest.param(lambda: paged([2.5, 2]).lengths_list(), r"PagedLayout.lengths \[2.5, 2\]: \[2.5\] are not positions",
                 id="paged-lengths-float"),
    pytest.param(lambda: paged(torch.tensor([2.0, 2.0])).lengths_list(), r"PagedLayout.lengths \[2.0, 2.0\]",
                 id="paged-lengths-float-tensor"),
])
def test_bad_raw_cache_operation_is_an_input_error(bad, match):
    expect(bad, InputError, match)


def declaring_session(unsupported):
    """A prefilled session of transformers' MPT (it implements extend, crop and reorder) whose
    runner declares `unsupported`."""
    pytest.importorskip("transformers")
    runner = build("transformers", CFG, random_state_dict(CFG), "cpu", torch.float32)
    runner.capabilities = Capabilities(unsupported)
    session = runner.session("concat", 8)
    session.prefill(*prompt(2, 3))
    return session


@pytest.mark.parametrize("operation, call", [
    pytest.param("extend", lambda s: s.extend(torch.zeros(2, 2, dtype=torch.long)), id="extend"),
    pytest.param("crop", lambda s: s.crop(2), id="crop"),
    pytest.param("reorder", lambda s: s.reorder(torch.tensor([1, 0])), id="reorder"),
])
def test_a_session_operation_its_target_declares_unsupported_raises_unsupported(operation, call):
    session = declaring_session({operation: f"we do not implement {operation}"})
    written = session.written
    expect(lambda: call(session), Unsupported, rf"transformers: we do not implement {operation}")
    assert session.written == written, "the refused operation moved the session"


def entry_with_zero_kv_heads():
    import dataclasses

    from mpt_kv.families import FAMILIES

    llama = FAMILIES["llama"]
    return dataclasses.replace(llama, kv_heads=lambda c: 0).kv_bytes_per_token(llama.config("mha"), torch.float32)


def family_names():
    from mpt_kv.families import FAMILIES
    from mpt_kv.checks.family import CHECKS as FAMILY_CHECKS
    from mpt_kv.families.implementations import IMPLEMENTATIONS

    return FAMILIES, FAMILY_CHECKS, IMPLEMENTATIONS


@pytest.mark.parametrize("bad, error, match", [
    pytest.param(lambda: family_names()[0]["nosuch"], UnknownName, r"unknown family 'nosuch': known: mpt, falcon",
                 id="FAMILIES-nosuch"),
    pytest.param(lambda: family_names()[0]["lama"], UnknownName, r"unknown family 'lama': closest: llama", id="FAMILIES-typo"),
    pytest.param(lambda: family_names()[1]["family-P9"], UnknownName,
                 r"unknown family check id 'family-P9': closest: family-P4, family-P3", id="family-CHECKS-P9"),
    pytest.param(lambda: family_names()[2]["optimum-habanna"], UnknownName,
                 r"unknown implementation 'optimum-habanna': closest: optimum-habana", id="IMPLEMENTATIONS-typo"),
    pytest.param(lambda: __import__("mpt_kv.families.gaudi").families.gaudi.fork_loader("lama", "my_fork"), UnknownName,
                 r"unknown family 'lama': closest: llama", id="fork_loader-unknown-family"),
    pytest.param(lambda: CHECKS["P9"], UnknownName, r"unknown check id 'P9'", id="CHECKS-P9"),
    pytest.param(entry_with_zero_kv_heads, InputError, r"family entry llama: kv_heads\(config\)=0 must be >= 1",
                 id="entry-kv_heads-0"),
    pytest.param(lambda: family_names()[2]["optimum-habana"](family_names()[0]["llama"], "mha", frobnicate=1), InputError,
                 r"gaudi_runner: unknown options \['frobnicate'\]; it takes \['reuse_cache', 'recipe'\]", id="gaudi_runner-option"),
    pytest.param(lambda: family_names()[1]["family-P1"]("transformers", "llama", "mha", "concat", "fp16"), InputError,
                 r"dtype 'fp16': the suite supports fp32, bf16 only", id="family-check-dtype"),
])
def test_bad_family_name_or_entry_is_a_clear_error(bad, error, match):
    e = expect(bad, error, match)
    if isinstance(e, UnknownName):  # still a KeyError: `in`, `.get` and `except KeyError` keep working
        assert isinstance(e, KeyError) and not str(e).startswith(("'", '"')), str(e)



def sweep(*argv):
    from mpt_kv.cli import sweep as sweep_cli

    return sweep_cli.main(list(argv))


def report(tmp_path, **fields):
    from mpt_kv.cli import report as report_cli

    result = {"target": "reference", "property": "P1", "outcome": "passed", "device": "cpu"}
    data = {"results": [{**result, **fields.pop("result", {})}], **fields}
    (tmp_path / "r.json").write_text(json.dumps(data))
    return report_cli.main([str(tmp_path / "r.json")])


def render_rows(tmp_path, rows):
    (tmp_path / "rows.json").write_text(json.dumps({"made": "by hand", "rows": rows}))
    return sweep("--render", "--out", str(tmp_path))


def reference_model(tmp_path, values):
    from mpt_kv.checks.reach import load_reference_model

    (tmp_path / "model.json").write_text(json.dumps({"name": "m", "values": values}))
    return load_reference_model(tmp_path / "model.json")


def only_targets_with_ini(value):
    from mpt_kv.plugin import options

    class Config:  # --only-targets given, the ini option as pytest's getini parses it
        def getoption(self, name):
            return True

        def getini(self, name):
            raise ValueError(f"invalid truth value {value!r}")
    return options.only_targets(Config())


SPEC = "transformers==4.55.4"


@pytest.mark.parametrize("bad, error, match", [
    pytest.param(lambda t: sweep(SPEC, "--out", "/proc/x"), SystemExit, r"--out /proc/x: /proc/x cannot be written",
                 id="sweep-out-proc"),
    pytest.param(lambda t: sweep(SPEC, "--out", __file__), SystemExit, r"--out .*test_bad_inputs.py: .* exists and is not a "
                 r"folder", id="sweep-out-file"),
    pytest.param(lambda t: sweep(SPEC, "--out", str(t), "--envs", "/proc/x"), SystemExit,
                 r"--envs /proc/x: /proc/x cannot be written", id="sweep-envs-proc"),
    pytest.param(lambda t: sweep(SPEC, "--timeout", "nan"), SystemExit, r"--timeout nan: give a positive number of seconds, a finite one",
                 id="sweep-timeout-nan"),
    pytest.param(lambda t: sweep("optimum-habana=1.2"), SystemExit,
                 r"'optimum-habana=1.2' is not a requirement \(.*\): give llm-foundry==X or optimum-habana==X or transformers==X",
                 id="sweep-spec-single-="),
    pytest.param(lambda t: render_rows(t, [{"package": "transformers", "version": "4.55.4"}]), SystemExit,
                 r"rows.json: row 0 has no 'pins', 'problem', 'seconds'", id="sweep-render-row-fields"),
    pytest.param(lambda t: report(t, result={"outcome": "banana"}), SystemExit,
                 r"r.json: result 0 has outcome 'banana': expected one of passed, failed, error, skipped, xfail, XPASS, "
                 r"unsupported", id="report-outcome-banana"),
    pytest.param(lambda t: report(t, memory="x"), SystemExit, r"r.json: field 'memory' is str \('x'\): expected list",
                 id="report-memory-str"),
    pytest.param(lambda t: report(t, absent_devices=["cuda"]), SystemExit,
                 r"field 'absent_devices' is list .*: expected dict", id="report-absent-list"),
    pytest.param(lambda t: report(t, result={"device": 0}), SystemExit, r"result 0 has device 0 \(int\): expected a str",
                 id="report-device-int"),
    pytest.param(lambda t: reference_model(t, {"batch": "lots"}), ValueError,
                 r"model.json: batch='lots': expected a number >= 0 or a list of them", id="reference-model-batch-str"),
    pytest.param(lambda t: reference_model(t, {"prompt_len": [128, None]}), ValueError,
                 r"prompt_len=\[128, None\]: expected a number", id="reference-model-list-None"),
    pytest.param(lambda t: only_targets_with_ini("maybe"), pytest.UsageError,
                 r"ini option mpt_kv_only_targets: invalid truth value 'maybe'; expected true or false",
                 id="ini-only-targets-maybe-with-flag"),
])
def test_bad_cli_input_is_a_usage_error_before_any_work(tmp_path, capsys, bad, error, match):
    with pytest.raises(error) as e:
        bad(tmp_path)
    if error is SystemExit:  # argparse's p.error and report's usage_error: exit 2, the line on stderr
        message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
        assert isinstance(e.value.code, str) or e.value.code == 2, (e.value.code, message)
    else:
        message = str(e.value)
    assert re.search(match, message), f"{message!r} does not match {match!r}"
    assert not os.path.exists("/proc/x")


def test_main_help_lists_every_command(capsys):
    from mpt_kv import cli

    assert cli.main(["--help"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert set(cli.COMMANDS) <= listed, f"not in python -m mpt_kv --help: {sorted(set(cli.COMMANDS) - listed)}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
