"""The cache operations (Session.extend, crop, reorder; docs/operations.md): the Session's input
checks, the reference's static position rule, the programs' oracle, the ops checks' verdicts on
targets that lack an operation, and the number of input shapes fed on (fake) HPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpt_kv.catalogue.assembly import runner_factory
from mpt_kv.catalogue.variants import VARIANTS
from mpt_kv.checks import operations, programs
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.checks.properties import Case, Context
from mpt_kv.checks.registry import CHECKS
from mpt_kv.errors import InputError, Unsupported
from mpt_kv.model.config import ModelConfig, random_state_dict
from mpt_kv.targets import Capabilities
from mpt_kv.targets.reference import build
from mpt_kv.targets.wrappers import transformers_major
from plugin_testing import HANG_S

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(d_model=16, n_heads=2, n_layers=2, vocab_size=32, max_seq_len=16)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def runner():
    return build(CFG, random_state_dict(CFG, seed=0), CPU, torch.float32)


def prefilled(runner, path="concat", max_len=12, bucket=None):
    session = runner.session(path, max_len, bucket)
    ids = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    session.prefill(ids, torch.ones(2, 5, dtype=torch.int64))
    return session


@pytest.mark.parametrize("call, message", [
    (lambda s: s.extend(torch.zeros(2, 8, dtype=torch.long)), r"extend of 8 tokens at position 5 ends at 13, beyond "
                                                               r"the cache length max_len=12"),
    (lambda s: s.extend(torch.zeros(3, 2, dtype=torch.long)), r"extend tokens shape \(3, 2\): expected \(2, k\)"),
    (lambda s: s.extend(torch.zeros(2, 0, dtype=torch.long)), r"extend tokens shape \(2, 0\)"),
    (lambda s: s.extend(torch.zeros(2, 2)), r"extend tokens dtype torch.float32: expected an integer dtype"),
    (lambda s: s.extend(torch.full((2, 2), 32)), r"extend tokens: token id out of range \[0, 32\)"),
    (lambda s: s.crop(0), r"crop to n=0: expected an int in 1..5"),
    (lambda s: s.crop(6), r"crop to n=6: expected an int in 1..5"),
    (lambda s: s.crop(2.0), r"crop to n=2.0"),
    (lambda s: s.reorder(torch.tensor([0, 1], dtype=torch.int32)), r"reorder index torch.int32: expected a "
                                                                   r"torch.int64 tensor"),
    (lambda s: s.reorder(torch.tensor([0, 1, 1])), r"reorder index shape \(3,\): expected \(2,\)"),
    (lambda s: s.reorder(torch.tensor([0, 2])), r"reorder index out of range \[0, 2\): min 0, max 2"),
])
@pytest.mark.parametrize("path", ["concat", "static"])
def test_operations_reject_bad_input_before_the_target_sees_it(runner, path, call, message):
    session = prefilled(runner, path)
    kv = [(k.clone(), v.clone()) for k, v in session.kv()]
    with pytest.raises(InputError, match=message):
        call(session)
    assert session.written == 5
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kv, session.kv())), "cache touched"


def test_operations_before_prefill_are_input_errors(runner):
    session = runner.session("concat", 8)
    for call in (lambda: session.extend(torch.zeros(1, 2, dtype=torch.long)), lambda: session.crop(1),
                 lambda: session.reorder(torch.tensor([0]))):
        with pytest.raises(InputError, match="before prefill"):
            call()


def test_a_static_decode_behind_the_written_positions_is_an_input_error(runner):
    """A decode at token_idx=1 after a 5-token prefill used to overwrite prompt slot 0 in silence."""
    session = prefilled(runner, "static")
    slot0 = session.kv()[0][0][:, :, 0].clone()
    with pytest.raises(InputError, match=r"token_idx=1 writes slot 0, but the static cache holds 5 positions .* "
                                         r"must start at token_idx = 6"):
        runner.model(torch.zeros(2, 1, dtype=torch.long), session.mask, session.cache, torch.tensor([1]))
    assert torch.equal(session.kv()[0][0][:, :, 0], slot0)
    session.crop(1)  # a crop makes it legitimate
    runner.model(torch.zeros(2, 1, dtype=torch.long), session.mask, session.cache, torch.tensor([2]))


@pytest.mark.parametrize("path, bucket", [("concat", None), ("static", None), ("static", 4)])
def test_extend_crop_and_reorder_follow_the_history(runner, path, bucket):
    """One program by hand against the uncached forward, through the check's own code."""
    case = Case(CFG, (5, 3), 7, seed=3)
    program = programs.Program(case, (programs.Op("extend", 4), programs.Op("crop", 2), programs.Op("reorder", index=(1, 1)),
                                      programs.Op("extend", 3), programs.Op("decode")))
    c = Context("reference", "cpu", torch.float32, case, path, bucket)
    operations.check_program_cached(runner, c, program)
    operations.check_program_aliasing(runner, c, program)
    if path == "static":
        operations.check_program_static_concat(runner, c, program)


def test_programs_refuse_to_crop_into_the_prompt():
    with pytest.raises(ValueError, match="crops into the prompt"):
        programs.Program(Case(CFG, (4,), 4), (programs.Op("decode"), programs.Op("crop", 2)))


@pytest.mark.parametrize("variant, check, message", [
    ("extend_without_causal_chunk_mask", "ops-P1/concat", r"ops-P1 extend \d logits"),
    ("reorder_keys_only", "ops-P1/static", r"ops-P1 decode logits"),
    ("crop_leaves_mask_ahead", "ops-P2/static", r"ops-P2 static mask after step \d+ \(crop -\d\): \d+ slots past"),
])
def test_ops_checks_kill_variants_for_the_right_reason(variant, check, message):
    with pytest.raises(PropertyFailure, match=message):
        CHECKS[check](VARIANTS[variant].build, "cpu", torch.float32)


def test_a_whole_cache_reorder_is_a_finding_with_its_mpt7b_bytes():
    with pytest.raises(PropertyFailure, match=r"a whole-cache copy: \d+ bytes above the per-layer bound .* at MPT-7B "
                                              r"bf16, .*batch 128, 128 \+ 128 tokens: 16.00 GiB"):
        CHECKS["ops-memory/concat/reorder"](VARIANTS["reorder_through_whole_cache_copy"].build, "cpu", torch.float32)


NO_OPS = Capabilities({op: f"no {op} here" for op in programs.OPERATIONS})
no_operations = runner_factory("no_operations", capabilities=NO_OPS)
no_reorder = runner_factory("no_reorder", capabilities=Capabilities({"reorder": "greedy only"}))


def test_a_target_without_operations_is_unsupported_never_a_pass():
    for check in ("ops-P1/concat", "ops-P2/static", "ops-P3/static", "ops-memory/concat/reorder"):
        with pytest.raises(Unsupported, match="no_operations: .*no (extend|reorder) here"):
            CHECKS[check](no_operations, "cpu", torch.float32)


def test_a_target_without_reorder_runs_the_other_operations():
    notes = CHECKS["ops-P1/concat"](no_reorder, "cpu", torch.float32)
    assert any("declares unsupported: reorder (greedy only): not drawn" in n for n in notes), notes
    with pytest.raises(Unsupported, match="greedy only"):
        CHECKS["ops-memory/static/reorder"](no_reorder, "cpu", torch.float32)


def test_optimum_habanas_own_reorder_is_what_the_gaudi_session_calls():
    pytest.importorskip("transformers")
    from mpt_kv.targets import gaudi_generation as G

    try:
        fn = G.optimum_habana_function("_temporary_reorder_cache")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"optimum-habana not installed: {e}")
    assert "optimum/habana/transformers/generation/utils.py" in fn.source
    past = ((torch.arange(4.0).reshape(2, 1, 2, 1), torch.zeros(2, 1, 2, 1)),)

    class NoReorderModel:  # GaudiMptForCausalLM 1.21.2: no _reorder_cache
        pass

    with pytest.raises(AttributeError, match="_reorder_cache"):
        G.temporary_reorder_cache(NoReorderModel(), past, torch.tensor([1, 0]))


# the two lines of a release before 1.20 that the cache operations go through (1.18.1 generation/utils.py)
BEFORE_1_20 = """
class GaudiGenerationMixin:
    def _beam_search(self, model_kwargs, beam_idx):
        model_kwargs["past_key_values"] = self._temporary_reorder_cache(model_kwargs["past_key_values"], beam_idx)

    def _assisted_decoding(self, outputs, new_cache_size):
        outputs.past_key_values = _crop_past_key_values(self, outputs.past_key_values, new_cache_size)
"""


def test_a_release_before_1_20_is_driven_by_its_own_generation_code(tmp_path, monkeypatch):
    """Before 1.20 beam search calls the model's own _temporary_reorder_cache and assisted decoding
    crops with transformers' _crop_past_key_values: the Gaudi session follows the installed file."""
    pytest.importorskip("transformers")
    from mpt_kv.targets import gaudi_generation as G

    import transformers.generation.candidate_generator as candidate_generator

    (tmp_path / "utils.py").write_text(BEFORE_1_20)
    monkeypatch.setattr(G, "generation_utils_path", lambda: tmp_path / "utils.py")
    crops = []  # transformers <4.4x's function, gone from the installed one: a stand-in that records its call
    monkeypatch.setattr(candidate_generator, "_crop_past_key_values",
                        lambda model, past, max_length: crops.append((model, past, max_length)) or "cropped",
                        raising=False)
    past = tuple((torch.arange(6.0).reshape(1, 1, 3, 2) + layer, torch.zeros(1, 1, 3, 2)) for layer in range(2))

    class Model:  # a GenerationMixin-style reorder
        calls = []

        def _temporary_reorder_cache(self, past_key_values, beam_idx):
            self.calls.append(beam_idx.tolist())
            return past_key_values

    model = Model()
    assert G.assisted_crop(past, 2, model=model) == "cropped" and crops == [(model, past, 2)]
    with pytest.raises(TypeError, match="pass model="):
        G.assisted_crop(past, 2)
    assert G.temporary_reorder_cache(model, past, torch.tensor([0])) is past and model.calls == [[0]]


HPU_SCRIPT = """
import json, torch
from mpt_kv.checks.registry import CHECKS
out = {}
for check in ("ops-P1/static",):  # the static path: the prompt padded to the cache length
    notes = CHECKS[check]("reference", "hpu", torch.float32)
    out[check] = [n for n in notes if "shapes fed" in n]
print(json.dumps(out))
"""


def test_on_hpu_programs_feed_few_input_shapes():
    """Every new input shape is a graph compile on HPU: the fake HPU (tests/fakes/hpu) runs the ops
    checks on the hpu device and each stays within programs.HPU_SHAPE_BUDGET distinct shapes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "fakes" / "hpu")]),
           "MPT_KV_FAKE_HPU": "cpu", "CI": "true", "OMP_NUM_THREADS": "1"}  # tiny tensors: one thread
    done = subprocess.run([sys.executable, "-c", HPU_SCRIPT], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    for check, notes in found.items():
        assert len(notes) == 1, notes
        count = int(notes[0].split("distinct input shapes")[0].rsplit(":", 1)[1])
        assert 3 <= count <= programs.HPU_SHAPE_BUDGET, f"{check}: {notes[0]}"
        assert "extend (2, 8)" in notes[0] and "extend (2, 3)" not in notes[0], notes[0]


def test_ops_checks_record_their_reach_and_the_shapes_fed():
    from mpt_kv.checks.registry import RunContext, running

    records = []
    with running(RunContext(record=lambda name, value: records.append((name, value)))):
        CHECKS["ops-P1/static"]("reference", "cpu", torch.float32)
    reach = [v for name, v in records if name == "mpt_kv_reach"]
    assert {v["check"] for v in reach} == {"ops-P1/static"}
    ops = [v["knobs"] for v in reach if "operation" in v["knobs"]]
    assert {k["operation"] for k in ops} == {"extend", "crop", "reorder"}
    assert {8, 5} <= {k["tokens_per_call"] for k in ops if k["operation"] == "extend"}
    # each program's case too: batch, heads, padding (the reach table's ops columns)
    cases = [v["knobs"] for v in reach if "batch" in v["knobs"]]
    assert {3, 2} <= {k["batch"] for k in cases} and all({"n_heads", "padding", "path"} <= set(k) for k in cases)
    shapes = [v for name, v in records if name == "mpt_kv_ops_shapes"]
    assert len(shapes) == 1 and shapes[0]["target"] == "reference" and shapes[0]["shapes"] >= 4, shapes


def test_the_packaged_known_failures_name_the_operations_findings():
    """Each pattern is checked against the real failure in the ohabana env (transformers 4.55.4,
    optimum-habana 1.21.2) and the cpu env (transformers 5.24), where the shipped test xfails it."""
    from mpt_kv.findings import entries as KF

    ops = [(e.target, e.property, e.path, e.bucket, str(e.when.get(e.target, "")))
           for e in KF.load() if e.property.startswith("ops-")]
    # SpecifierSet's canonical order; the ranges the findings' standalone repros measured
    before_1_20, seed, since_1_7 = "<1.20,>=1.11.1", "<1.13,>=1.7.3", "<1.20,>=1.7.3"
    assert ops == [
        ("optimum-habana", "ops-P1", "static", True, "<=1.21.2,>=1.14.1"),  # the cache_idx NaN
        ("optimum-habana", "ops-P1", None, None, "<=1.21.2,>=1.20.0"),      # beam search's _reorder_cache, k-token calls
        ("optimum-habana", "ops-P2", None, None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P3", None, None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-memory", None, None, "<=1.21.2,>=1.20.0"),
        ("transformers", "ops-P3", "concat", None, ">=4.56"),               # DynamicLayer.crop slices
        ("transformers", "ops-P3", "concat", None, "<4.56"),                # the prefill's views of mixed_qkv
        ("optimum-habana", "ops-P3", None, None, seed),                     # the seed bug
        ("optimum-habana", "ops-P1", "static", None, before_1_20),          # static k-token crash
        ("optimum-habana", "ops-P2", "static", None, before_1_20),
        ("optimum-habana", "ops-P3", "static", None, "<1.20,>=1.13"),
        ("optimum-habana", "ops-P3", "concat", None, "<1.20,>=1.13"),       # _crop_past_key_values slices
        ("optimum-habana", "ops-memory", "concat", None, since_1_7),        # MptForCausalLM._reorder_cache
        ("optimum-habana", "ops-memory", "static", None, since_1_7),
        ("transformers", "ops-memory", "concat", None, "<4.54,>=4.32.0"),   # the same, on transformers' side
        ("transformers", "ops-static-storage", "static", None, "<=5.24.0,>=5.12.1"),  # StaticLayer reorders anew
        ("optimum-habana", "ops-static-storage", "static", None, "<=1.21.2,>=1.20.0"),
        ("transformers", "ops-retained", "concat", None, ">=4.32.0"),        # the crop slices: the tail kept
        ("optimum-habana", "ops-retained", None, None, "<=1.21.2,>=1.20.0"),  # no reorder, no crop
        ("optimum-habana", "ops-retained", "concat", None, since_1_7),       # _crop_past_key_values slices
        ("transformers", "ops-P1", "static", None, "<=5.23.0,>=5.3.0"),      # StaticLayer has no crop
        ("transformers", "ops-P2", "static", None, "<=5.23.0,>=5.3.0"),
        ("transformers", "ops-P3", "static", None, "<=5.23.0,>=5.3.0"),
        ("transformers", "ops-retained", "static", None, "<=5.23.0,>=5.3.0"),
        ("optimum-habana", "ops-static-storage", "static", None, since_1_7),  # _reorder_cache: new buffers
        # llm-foundry (its own env, transformers 4.51), measured by its repros over every minor
        ("llm-foundry", "ops-P3", "concat", None, "<=0.22.0,>=0.3.0"),          # the prefill's views of Wqkv
        ("llm-foundry", "ops-memory", "concat", None, "<=0.22.0,>=0.3.0"),      # its _reorder_cache: a whole copy
        ("llm-foundry", "ops-memory", "concat", None, "<=0.22.0,>=0.5.0"),      # assisted extend raises
        ("llm-foundry", "ops-P1", "concat", None, "<=0.22.0,>=0.3.0"),          # ... and feeds the last token only
        ("llm-foundry", "ops-retained", "concat", None, "<=0.22.0,>=0.3.0"),    # the crop cuts the key's head_dim
        # the k-token causal mask at the speculative and corner programs' first extend, once the beam
        # program's crash stopped hiding them (each fixed program runs whatever the others did)
        ("optimum-habana", "ops-P1", "concat", None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P1", "static", None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P1", "static", True, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P2", "static", None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P3", "concat", None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-P3", "static", None, "<=1.21.2,>=1.20.0"),
        ("optimum-habana", "ops-static-storage", "static", None, "<=1.21.2,>=1.20.0"),
    ], ops


def crop_raising(exc: BaseException):
    """The reference, except that its session's crop raises `exc`."""
    assembled = runner_factory(f"crop_raises_{type(exc).__name__}")

    def build_(cfg, state_dict, device, dtype):
        runner = assembled(cfg, state_dict, device, dtype)
        open_session = runner.session

        def session(*args, **kwargs):
            s = open_session(*args, **kwargs)

            def crop(n):
                raise exc
            s._crop = crop
            return s
        runner.session = session
        return runner
    return build_


def test_a_crashing_operation_fails_the_property_with_the_exception_named():
    with pytest.raises(PropertyFailure, match=r"the target's crop raised RuntimeError: boom at step \d+"):
        CHECKS["ops-P1/concat"](crop_raising(RuntimeError("boom")), "cpu", torch.float32)


@pytest.mark.parametrize("exc", [ImportError("cannot import name 'DynamicLayer'"),
                                 NotImplementedError("AdapterSession has no _crop_cache")])
def test_an_adapters_import_error_or_missing_operation_is_an_error_not_a_property_failure(exc):
    with pytest.raises(type(exc), match=str(exc)):
        CHECKS["ops-P1/concat"](crop_raising(exc), "cpu", torch.float32)


def transformers_model_with_reorder(keys_only: bool):
    """A transformers-style target whose model defines its own `_reorder_cache`, as transformers'
    beam search calls it before the cache's `reorder_cache` (generation/utils.py)."""
    from transformers import MptForCausalLM

    from mpt_kv import TransformersRunner

    class OwnReorder(MptForCausalLM):
        def _reorder_cache(self, past, beam_idx):
            for layer in past.layers:
                layer.keys = layer.keys.index_select(0, beam_idx)
                if not keys_only:
                    layer.values = layer.values.index_select(0, beam_idx)
            return past

    def build(cfg, state_dict, device, dtype):
        model = OwnReorder(cfg.to_hf())
        model.load_state_dict(state_dict)
        return TransformersRunner(model.to(device, dtype).eval(), device, name=f"own_reorder_keys_only_{keys_only}",
                                  capabilities=Capabilities({"static": "a concat-only model"}))
    return build


@pytest.mark.skipif(transformers_major() < 5, reason="a 5.x Cache's layers (.keys/.values) in the test model")
def test_a_models_own_reorder_cache_is_what_beam_search_calls():
    CHECKS["ops-P1/concat"](transformers_model_with_reorder(keys_only=False), "cpu", torch.float32)
    with pytest.raises(PropertyFailure, match=r"ops-P1 decode logits"):
        CHECKS["ops-P1/concat"](transformers_model_with_reorder(keys_only=True), "cpu", torch.float32)
