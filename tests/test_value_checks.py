"""The value checks (P0, P1, P2, P4) kill the bug classes of issues 11 and 12, each written here as
a small bad target, and pass the designs they must pass.

- the copy rule: a target that returns one output buffer per shape (as a CUDA or HPU graph
  replay does) is checked on copies; without them `assert_close` refuses to compare;
- P4: that target fails unless it declares `graph_outputs=True`; declared, it passes P1, P2, P4,
  and a cache bug inside it is still caught;
- state kept between generations (a mask buffer not refilled, a position counter not reset):
  caught in generation 2 or 3, never in the first;
- a bool mask misread: caught with a bool mask, invisible with an integer one;
- length and width classes (a sliding window past 16 positions, a decode fast path for
  head_dim >= 32, a position computed in bf16, an off-by-one at the 128 boundary, a bug at the
  last slot at max_seq_len): caught by the edge cases every run has, passed by a case that does
  not reach them (so the kill is the edge case's doing).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings

from mpt_kv.checks import graphs, results
from mpt_kv.checks import properties as P
from mpt_kv.checks.compare import AliasedComparison, PropertyFailure, assert_close, shares_memory, tolerance
from mpt_kv.checks.strategies import EDGE_CASES, cases
from mpt_kv.model.cache import ConcatCache, StaticCache
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.model.reference import Attention, ReferenceMPT
from mpt_kv.targets.reference import ReferenceRunner, ReferenceSession
from mpt_kv.targets.reference import build as reference

SMALL = P.Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=16), (5, 3), 4, seed=1)


def bad_target(name, model=ReferenceMPT, session=ReferenceSession):
    """A factory like a user's: the reference with one piece swapped."""

    class Runner(ReferenceRunner):
        model_class = model

        def session(self, path, max_len, bucket=None):
            return session(self.model, path, max_len, bucket, self.sync)

    Runner.name = name

    def build(cfg, state_dict, device, dtype):
        return Runner(cfg, state_dict, device, dtype)

    return build


def check(prop, build, case, dtype=torch.float32, path="static", bucket=None):
    """Run P0, P1, P2 or P4 on `build`'s target the way the conformance tests do."""
    sd = random_state_dict(case.cfg, seed=case.seed)
    runner = build(case.cfg, sd, torch.device("cpu"), dtype)
    twin = P.fp32_twin(getattr(build, "inner", build), case.cfg, sd, "cpu", dtype)  # a run under graphs: the bare target
    c = P.Context(runner.name, "cpu", dtype, case, path, bucket, fp32=twin)
    if prop == "P0":
        return P.check_oracle(runner, reference(case.cfg, P.rounded_state_dict(sd, dtype), torch.device("cpu"),
                                                torch.float32), c)
    return {"P1": P.check_cached_equals_uncached, "P2": P.check_static_equals_concat,
            "P4": P.check_outputs_not_reused}[prop](runner, c)


# --- the copy rule and P4 ---------------------------------------------------------------------------
def graph_style(build, declared):
    def wrapped(*args):
        return graphs.StaticOutputs(build(*args), declared=declared)

    wrapped.inner = build
    return wrapped


class StaleStaticCache(StaticCache):
    def update(self, layer, k, v, token_idx=None, cache_idx=None):
        if self.prefilled[layer]:
            ck, cv = self.kv[layer]
            return ck[:, :, :cache_idx] if cache_idx else ck, cv[:, :, :cache_idx] if cache_idx else cv  # new k, v never written
        return super().update(layer, k, v, token_idx, cache_idx)


class StaleModel(ReferenceMPT):
    def new_cache(self, path, batch, max_len=None, fill=None):
        cache = super().new_cache(path, batch, max_len, fill)
        if path == "static":
            cache.__class__ = StaleStaticCache
        return cache


def test_assert_close_refuses_tensors_that_share_memory():
    x = torch.randn(2, 3, 8)
    assert shares_memory(x, x[:, 1:]) and not shares_memory(x, x.clone())
    with pytest.raises(AliasedComparison, match=r"P1 decode logits: refusing to compare two tensors that share memory"
                                                r".*target=t, step=3"):
        assert_close(x[:, -1], x[:, -1], tolerance(torch.float32, "logits:static"), "P1 decode logits",
                     {"target": "t", "step": 3})


def test_undeclared_output_buffer_fails_p4():
    with pytest.raises(PropertyFailure, match=r"P4 output reuse: the logits \(2, 5, 64\) returned by the uncached "
                                              r"forward were modified by the later uncached forward of other tokens.*"
                                              r"declare Capabilities\(graph_outputs=True\).*target=shared-buffer"):
        check("P4", graph_style(bad_target("shared-buffer"), declared=False), SMALL)


def test_fresh_outputs_pass_p4_without_a_note():
    assert check("P4", reference, SMALL) == []


@pytest.mark.parametrize("prop", ["P1", "P2", "P4"])
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_declared_graph_outputs_pass(prop, precision):
    notes = check(prop, graph_style(reference, declared=True), SMALL, precision)
    if prop == "P4":
        assert any("as declared" in n for n in notes), notes


def test_cache_bug_behind_graph_outputs_is_caught():
    """The reason for the copy rule: without it P1's cached and uncached logits here are one buffer."""
    with pytest.raises(PropertyFailure, match=r"P1 decode logits vs full forward differ"):
        check("P1", graph_style(bad_target("stale-graph", StaleModel), declared=True), SMALL)


def test_without_copies_the_comparison_is_refused(monkeypatch):
    """Seen failing the other way: with the copy rule switched off, a graph-style target's concat and
    static prefill logits are one buffer, and assert_close says so instead of passing."""
    monkeypatch.setattr(results, "snapshot", lambda t: t)
    with pytest.raises(AliasedComparison, match=r"P2 static vs concat logits: refusing.*target=reference.*step=prefill"):
        check("P2", graph_style(reference, declared=True), SMALL)


# --- state kept between generations -------------------------------------------------------------------
class MaskBufferSession(ReferenceSession):
    """Keeps one (B, max_seq_len) mask buffer on the model for every static generation and 'refills'
    it by writing this prompt's ones: ones of the last generation stay where this one pads."""

    def _prefill(self, input_ids, attention_mask):
        logits = super()._prefill(input_ids, attention_mask)
        if self.path == "static":
            B, M = self.mask.shape[0], self.model.cfg.max_seq_len
            buf = self.model.__dict__.get("mask_buffer")
            if buf is None or buf.shape[0] != B or buf.dtype != self.mask.dtype:
                buf = self.model.__dict__["mask_buffer"] = torch.zeros(B, M, dtype=self.mask.dtype)
            buf[:, :self.max_len][self.mask.bool()] = 1
            self.mask = buf[:, :self.max_len]
        return logits


class CounterModel(ReferenceMPT):
    """Concat path positions from a counter of tokens fed, kept on the model and never reset."""

    seen = 0

    def _positions(self, T, cache, token_idx, cache_idx):
        if isinstance(cache, ConcatCache):
            start, self.seen = self.seen, self.seen + T
            return start, cache.length() + T
        return super()._positions(T, cache, token_idx, cache_idx)


@pytest.mark.parametrize("build,path", [
    pytest.param(bad_target("mask-buffer-kept", session=MaskBufferSession), "static", id="mask-buffer-not-refilled"),
    pytest.param(bad_target("position-counter-kept", CounterModel), "concat", id="position-counter-kept"),
])
def test_state_kept_between_generations_is_caught_in_a_later_generation(build, path):
    with pytest.raises(PropertyFailure, match=r"P1 .* differ.*generation=[23]/3"):
        check("P1", build, SMALL, path=path)
    first_only = P.Case(SMALL.cfg, SMALL.prompt_lens, SMALL.new_tokens, seed=1)
    runner = build(first_only.cfg, random_state_dict(first_only.cfg, seed=1), torch.device("cpu"), torch.float32)
    P.p1_generation(P.copied(runner), None, P.Context("x", "cpu", torch.float32, first_only, path))  # gen 1 alone passes


# --- a bool mask misread --------------------------------------------------------------------------------
class BoolMaskInvertedModel(ReferenceMPT):
    """Takes a bool mask as True = masked (MPT's convention inside attention) instead of True = token."""

    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            inverted = ~attention_mask  # a row left with nothing to attend would be an InputError, not a wrong answer
            attention_mask = inverted | ~inverted.any(1, keepdim=True)
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


def test_bool_mask_misread_is_caught_with_a_bool_mask_only():
    build = bad_target("bool-mask-inverted", BoolMaskInvertedModel)
    with pytest.raises(PropertyFailure, match=r"P0 uncached logits vs reference differ.*mask=bool"):
        check("P0", build, P.Case(SMALL.cfg, (5, 3), 4, seed=1, mask_dtype=torch.bool))
    check("P0", build, P.Case(SMALL.cfg, (5, 3), 4, seed=1, mask_dtype=torch.int32))


# --- lengths and widths: killed by the edge cases every run has ----------------------------------------
class WindowModel(ReferenceMPT):
    """Decode attends the last 16 keys only (a sliding window where MPT has none)."""

    def forward(self, input_ids, attention_mask=None, cache=None, token_idx=None, cache_idx=None):
        if cache is not None and input_ids.shape[1] == 1 and attention_mask.shape[1] > 16:
            attention_mask = attention_mask.clone()
            attention_mask[:, :-16] = 0
        return super().forward(input_ids, attention_mask, cache, token_idx, cache_idx)


class FastPathAttention(Attention):
    """A one-token decode path taken for head_dim >= 32 that forgets ALiBi."""

    def forward(self, x, mask, bias, cache, layer, token_idx, cache_idx):
        if x.shape[1] == 1 and self.cfg.head_dim >= 32:
            bias = torch.zeros_like(bias)
        return super().forward(x, mask, bias, cache, layer, token_idx, cache_idx)


class FastPathModel(ReferenceMPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        for block in self.transformer.blocks:
            block.attn.__class__ = FastPathAttention


def static_cache_model(update):
    """The reference whose static decode step goes through `update(cache, layer, k, v, token_idx, cache_idx)`."""

    class Cache(StaticCache):
        def update(self, layer, k, v, token_idx=None, cache_idx=None):
            if not self.prefilled[layer]:
                return super().update(layer, k, v, token_idx, cache_idx)
            return update(self, super().update, layer, k, v, token_idx, cache_idx)

    class Model(ReferenceMPT):
        def new_cache(self, path, batch, max_len=None, fill=None):
            cache = super().new_cache(path, batch, max_len, fill)
            if path == "static":
                cache.__class__, cache.max_seq_len = Cache, self.cfg.max_seq_len
            return cache

    Model.__name__ = update.__name__
    return Model


def bf16_position(cache, update, layer, k, v, token_idx, cache_idx):
    dtype = cache.kv[layer][0].dtype  # the position computed in the model's dtype: bf16 rounds 257 to 256
    slot = (token_idx - 1).to(dtype).long().clamp(max=cache.max_len - 1)  # (271 rounds up to 272: past the end)
    return update(layer, k, v, slot + 1, cache_idx)


def late_at_128(cache, update, layer, k, v, token_idx, cache_idx):
    at_boundary = (int(token_idx) - 1) % 128 == 0 and int(token_idx) > 1  # positions 128, 256, ...
    return update(layer, k, v, token_idx + 1 if at_boundary else token_idx, cache_idx)


def last_slot_skipped(cache, update, layer, k, v, token_idx, cache_idx):
    if int(token_idx) == cache.max_seq_len:  # the last slot is never written
        ck, cv = cache.kv[layer]
        return (ck[:, :, :cache_idx], cv[:, :, :cache_idx]) if cache_idx else (ck, cv)
    return update(layer, k, v, token_idx, cache_idx)


# (bad target, dtype, path, the edge case that must kill it, a case that does not reach the bug)
LENGTH_CLASSES = [
    pytest.param(WindowModel, torch.float32, "concat", "head-dim-128", SMALL, id="sliding-window-past-16"),
    pytest.param(FastPathModel, torch.float32, "static", "head-dim-128", SMALL, id="decode-fast-path-head-dim-32"),
    pytest.param(FastPathModel, torch.float32, "static", "bucket-128",  # head_dim 32 exactly
                 P.Case(ModelConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=64, max_seq_len=32), (5, 3), 4),
                 id="decode-fast-path-head-dim-32-at-32"),
    pytest.param(static_cache_model(bf16_position), torch.bfloat16, "static", "long-generation", SMALL,
                 id="position-in-bf16"),
    pytest.param(static_cache_model(late_at_128), torch.float32, "static", "bucket-128", SMALL,
                 id="off-by-one-at-128"),
    pytest.param(static_cache_model(last_slot_skipped), torch.float32, "static", "max-seq-len-2048", SMALL,
                 id="last-slot-at-max-seq-len"),
]


@pytest.mark.parametrize("model,precision,path,edge,unreached", LENGTH_CLASSES)
def test_length_and_width_classes_are_killed_by_the_edge_cases(model, precision, path, edge, unreached):
    build = bad_target(model.__name__, model)
    case = EDGE_CASES[edge]
    with pytest.raises(PropertyFailure, match=r"P1 (decode|prefill) logits vs .* differ|NaN/inf"):
        check("P1", build, case, precision, path)
    check("P1", build, unreached, precision, path)  # the bug is there, the short case does not reach it


def test_edge_cases_reach_the_lengths_and_widths():
    """What the classes above need, in every run (not only when hypothesis draws it)."""
    edges = list(EDGE_CASES.values())
    assert any(c.total_len == c.cfg.max_seq_len == 2048 for c in edges), "the last slot at max_seq_len 2048"
    assert any(c.prompt_len < 128 and c.total_len > 257 for c in edges), "decode steps across positions 128 and 256"
    assert any(c.prompt_len < 128 < c.total_len for c in edges if c.new_tokens <= 4), "a bucket boundary in a short decode"
    assert {c.cfg.head_dim for c in edges} >= {32, 128}
    assert any(c.cfg.n_heads & (c.cfg.n_heads - 1) for c in edges) and any(c.cfg.n_heads == 4 for c in edges)
    assert {c.mask_dtype for c in edges} == set(P.MASK_DTYPES)


def test_ci_draws_pass_16_positions_and_wide_heads():
    """The derandomized CI draws (6 per test) include cases past 16 positions and head dims >= 32."""
    drawn = []

    @settings(settings.get_profile("ci"), max_examples=6)
    @given(case=cases("cpu"))
    def draw(case):
        drawn.append(case)

    draw()
    assert any(c.total_len > 16 for c in drawn), [c.describe() for c in drawn]
    assert any(c.cfg.head_dim >= 32 for c in drawn), [c.describe() for c in drawn]


# --- generations and layouts --------------------------------------------------------------------------
@pytest.mark.parametrize("case", [SMALL, *EDGE_CASES.values(), P.Case(SMALL.cfg, (1,), 1)],
                         ids=["small", *EDGE_CASES, "one-token"])
def test_generations_are_longer_then_shorter_with_other_padding(case):
    first, longer, shorter = case.generations()
    assert first is case and {longer.batch, shorter.batch} == {case.batch}
    assert longer.prompt_len >= case.prompt_len and longer.total_len <= case.cfg.max_seq_len
    assert longer.prompt_len > case.prompt_len or case.total_len == case.cfg.max_seq_len or case.prompt_len == 1
    assert shorter.prompt_len <= case.prompt_len and shorter.total_len <= case.cfg.max_seq_len
    pads = lambda c: [c.prompt_len - n for n in c.prompt_lens]  # noqa: E731
    if case.batch > 1 and case.prompt_len > 1:
        assert pads(longer) != pads(case) and pads(shorter) != pads(case)
    assert len({case.seed, longer.seed, shorter.seed}) == 3


# --- the calibration ------------------------------------------------------------------------------------
def test_measuring_records_instead_of_failing():
    from mpt_kv.checks.compare import measuring

    tol = tolerance(torch.float32, "logits:static")
    with measuring() as records:
        assert_close(torch.ones(3) * 2, torch.ones(3), tol, "x", {})  # 1.0 off: far over the bound, recorded
    assert records[0]["key"] == ("float32", "logits:static") and records[0]["err"] == 1.0 and records[0]["frac"] > 1e3
    with pytest.raises(PropertyFailure):
        assert_close(torch.ones(3) * 2, torch.ones(3), tol, "x", {})


def test_calibration_frontier_keeps_the_worst_for_any_bound():
    from mpt_kv.cli.calibrate import frontier

    points = [(1.0, 10.0), (0.5, 10.0), (2.0, 100.0), (0.1, 1.0), (1.5, 50.0)]
    kept = frontier(points)
    assert kept == [(0.1, 1.0), (1.0, 10.0), (1.5, 50.0), (2.0, 100.0)]
    for atol, rtol in [(0.0, 0.01), (1e-3, 0.1), (1.0, 0.0)]:
        assert max(e / (atol + rtol * s) for e, s in kept) == max(e / (atol + rtol * s) for e, s in points)


def test_calibration_runs_resumes_and_reports(tmp_path, capsys):
    from mpt_kv.cli import calibrate

    args = ["run", "--target", "reference", "--cases", "6", "--shard", "5/6", "--out", str(tmp_path)]
    assert calibrate.main(args) == 0
    assert calibrate.main(args) == 0  # resumed: nothing left to run
    files = list(tmp_path.glob("*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 1
    assert calibrate.main(["report", str(files[0])]) == 0
    out = capsys.readouterr().out
    assert "0 cases done, 1 to go" in out and "1 cases done, 0 to go" in out
    assert "| float32 | logits:static |" in out and "| bfloat16 | logits:uncached |" in out


def test_calibration_file_names_are_safe_for_artifact_uploaders(tmp_path, capsys):
    """A target spec's ':' (refused by CI artifact uploaders) never reaches a file name; the target
    itself is kept inside the records."""
    from mpt_kv.cli import calibrate

    spec = "mpt_kv.catalogue.designs:stacked_kv"
    assert calibrate.main(["run", "--target", spec, "--cases", "2", "--shard", "1/2", "--out", str(tmp_path)]) == 0
    (file,) = tmp_path.glob("*.jsonl")
    assert ":" not in file.name and file.name.startswith("mpt_kv.catalogue.designs_stacked_kv-")
    assert json.loads(file.read_text().splitlines()[0])["target"] == spec
    assert "1/1" in capsys.readouterr().err  # the progress of an hour-long run, on stderr


def test_calibration_on_cuda_runs_under_its_tf32_and_sdpa_backend_and_records_them(fake_cuda, tmp_path, capsys,
                                                                                   monkeypatch):
    """`calibrate run --device cuda` (here the fake GPU of tests/fakes/cuda): the cases run with TF32 and the
    sdpa backend asked for, each record and the file name carry them, `report` keeps them apart, and the
    process's settings are put back after."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

    from mpt_kv.cli import calibrate

    seen = []
    real = calibrate.run_case

    def watched(*args):
        seen.append((torch.backends.cuda.matmul.allow_tf32, list(_cur_sdpa_kernel_backends()), args[3]))
        return real(*args)

    monkeypatch.setattr(calibrate, "run_case", watched)
    before = torch.backends.cuda.matmul.allow_tf32
    args = ["run", "--target", "reference", "--cases", "6", "--shard", "5/6", "--device", "cuda", "--tf32", "on",
            "--sdpa-backend", "math", "--out", str(tmp_path)]
    assert calibrate.main(args) == 0
    assert seen == [(True, [SDPBackend.MATH], "cuda")]
    assert torch.backends.cuda.matmul.allow_tf32 == before
    (file,) = tmp_path.glob("*.jsonl")
    assert "-cuda-tf32on-sdpamath-" in file.name
    record = json.loads(file.read_text())
    assert {k: record["versions"][k] for k in ("device", "tf32", "sdpa")} == {"device": "cuda", "tf32": "on",
                                                                             "sdpa": "math"}
    assert calibrate.main(["report", str(file)]) == 0
    assert "| reference on cuda (TF32 on, sdpa math) | " in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--tf32", "on"], "--tf32 and --sdpa-backend are cuda's conditions; --device cpu has neither"),
    (["--device", "cuda", "--tf32", "off"], "--device cuda"),
])
def test_calibration_conditions_where_they_do_not_apply_are_usage_errors(tmp_path, capsys, args, message):
    from mpt_kv.cli import calibrate

    with pytest.raises(SystemExit) as e:
        calibrate.main(["run", "--target", "reference", "--cases", "1", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
