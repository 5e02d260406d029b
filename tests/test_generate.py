"""The generate drive and checks (mpt_kv/checks/generate_driver.py, mpt_kv/checks/generate.py), optimum-habana's
generate on CPU (mpt_kv/targets/gaudi_generate.py) and the generate catalogue (mpt_kv/catalogue/generate_catalogue.py):
each implementation's own `generate` runs, every call it makes is judged, and what would let a generate cell go
green without the generate half checked fails (docs/gate.md rows 99-104)."""

import torch
import pytest

from mpt_kv import CHECKS
from mpt_kv.catalogue import generate_catalogue
from mpt_kv.catalogue.generate_catalogue import GENERATE_COLUMNS, GENERATE_DESIGNS, GENERATE_VARIANTS
from mpt_kv.checks import generate_driver, index
from mpt_kv.checks.registry import applies
from mpt_kv.errors import KnownFailuresError, PropertyFailure, Unsupported
from mpt_kv.findings.patterns import compile_pattern
from mpt_kv.targets import FamilyTarget
from mpt_kv.versions import transformers_major

needs_5x = pytest.mark.skipif(generate_catalogue.unavailable() is not None,
                              reason=f"{generate_catalogue.unavailable()}")


def transformers_target(model_class):
    """An MPT target factory: transformers' MPT of `model_class` (a subclass with one change)."""
    from mpt_kv.targets.wrappers import TransformersRunner

    def build(cfg, state_dict, device, dtype):
        model = model_class(cfg.to_hf())
        model.load_state_dict(state_dict)
        return TransformersRunner(model.to(device, dtype).eval(), device, name="transformers+test")

    return build


# --- the drive runs the implementation's own generate ----------------------------------------------------------

@needs_5x
def test_the_drive_runs_transformers_own_generate(monkeypatch):
    """What runs is GenerationMixin's code: a _sample that raises is the cell's crash, named."""
    from transformers.generation.utils import GenerationMixin

    def broken(self, *args, **kwargs):
        raise RuntimeError("transformers' own _sample ran")

    monkeypatch.setattr(GenerationMixin, "_sample", broken)
    with pytest.raises(PropertyFailure, match="the implementation's generate raised RuntimeError: transformers' own "
                                              "_sample ran before its first call"):
        CHECKS["generate/concat/greedy"]("transformers", "cpu", torch.float32)


def test_each_mode_and_path_is_a_check_of_the_index():
    prop = index.by_name("generate")
    assert prop.runs == "generate" and prop.operations == generate_driver.MODES
    ids = [c for c in CHECKS if c.startswith("generate/")]
    assert ids == [f"generate/{p}/{m}" for p in index.GENERATE_PATHS for m in generate_driver.MODES]


def test_optimum_habanas_own_paths_are_its_ports_greedy_and_beam_only():
    """reuse_cache and the recipes' flags: the ports' cells (the recipe's variant), never an MPT target's."""
    llama_gqa = FamilyTarget("optimum-habana", "llama", "gqa", ("concat", "static", "static+reuse",
                                                                "static+reuse@flash-reuse", "static@flash-bucket"))
    assert applies(CHECKS["generate/static+reuse@flash-reuse/beam"], llama_gqa)
    assert applies(CHECKS["generate/static@flash-bucket/greedy"], llama_gqa)
    assert not applies(CHECKS["generate/static+reuse@flash-reuse/prompt-lookup"], llama_gqa)
    assert not applies(CHECKS["generate/static+reuse/greedy"], llama_gqa)  # not the first variant
    assert applies(CHECKS["generate/static+reuse/greedy"], FamilyTarget("optimum-habana", "llama", "mha",
                                                                       ("concat", "static", "static+reuse")))
    assert not applies(CHECKS["generate/static+reuse/greedy"], "optimum-habana")
    with pytest.raises(Unsupported, match="its ports'"):
        CHECKS["generate/static+reuse/greedy"]("transformers", "cpu", torch.float32)


def test_a_recipe_becomes_the_gaudi_generation_config_settings_run_generation_gives_it():
    from mpt_kv.recipes import RECIPES, TINY_BUCKET
    from mpt_kv.targets.gaudi_generate import recipe_settings

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    flash = recipe_settings(RECIPES["flash-bucket"], mask)
    assert flash["bucket_size"] == TINY_BUCKET and flash["bucket_internal"] and flash["use_flash_attention"]
    assert flash["flash_attention_recompute"] and flash["flash_attention_causal_mask"] and flash["trim_logits"]
    assert flash["flash_attention_fast_softmax"] and flash["valid_sequence_lengths"].tolist() == [2, 4]
    reuse = recipe_settings(RECIPES["reuse-trim-softmax"], mask)
    assert reuse["bucket_size"] == -1 and not reuse["bucket_internal"] and reuse["attn_softmax_bf16"]
    assert "valid_sequence_lengths" not in reuse and recipe_settings(None, mask) == {}


def test_a_family_gets_one_tiny_config_greedy_and_beam_and_prompt_lookup_where_it_has_windows():
    check = CHECKS["generate/concat/prompt-lookup"]
    assert applies(check, "transformers")  # every MPT target, every mode
    assert applies(check, FamilyTarget("transformers", "mistral", "gqa"))  # a window
    assert not applies(check, FamilyTarget("transformers", "llama", "mha"))  # no window
    assert not applies(CHECKS["generate/concat/draft"], FamilyTarget("transformers", "mistral", "gqa"))
    assert applies(CHECKS["generate/static/beam"], FamilyTarget("transformers", "llama", "mha"))
    assert not applies(CHECKS["generate/static/beam"], FamilyTarget("transformers", "llama", "gqa"))  # not the first
    assert applies(CHECKS["generate/static/beam"], FamilyTarget("optimum-habana", "llama", "mha"))  # the ports too


def test_a_port_cell_not_yet_told_apart_has_no_cell_and_names_a_real_one():
    """registry.GENERATE_NOT_YET: each key is a cell the matrix would have (no stale key hides nothing), and
    only those cells of the ports are left out."""
    from mpt_kv.checks.registry import GENERATE_NOT_YET
    from mpt_kv.families import FAMILIES

    assert GENERATE_NOT_YET
    for (name, check), reason in GENERATE_NOT_YET.items():
        implementation, family, variant = name.split("/")
        target = FamilyTarget(implementation, family, variant)
        assert not applies(CHECKS[check], target), (name, check)
        assert variant == next(iter(FAMILIES[family].variants)) and CHECKS[check].path in target.paths, (name, check)
        assert reason
    left_out = [(t.name, c.id) for f, fam in FAMILIES.items() if fam.gaudi is not None
                for t in [FamilyTarget("optimum-habana", f, next(iter(fam.variants)))]
                for c in CHECKS.values() if c.id.startswith("generate/") and c.path in t.paths and not applies(c, t)
                and c.operation != "chunked"  # GaudiGenerationMixin has no chunked prefill: no port cell
                and c.operation != "multi-turn"  # not driven on GaudiGenerationMixin yet (docs/generate.md)
                and (c.operation not in ("prompt-lookup", "draft") or (c.operation == "prompt-lookup" and fam.windows))]
    assert sorted(left_out) == sorted(GENERATE_NOT_YET)


@needs_5x
def test_a_chunked_prefill_is_judged_chunk_by_chunk_and_one_run_whole_is_an_error(monkeypatch):
    """generate/concat/chunked: each chunk a call of its own, judged over the prompt up to its end (the chunk's
    sequence rebuilt from the prompt); a generate that ignores prefill_chunk_size checked nothing of it: an
    error, never a pass."""
    from mpt_kv.checks import generate_flavours

    notes = CHECKS["generate/concat/chunked"]("transformers", "cpu", torch.float32)
    assert any("1 k-token calls" in n or "2 k-token calls" in n for n in notes), notes
    call = generate_flavours.call_generate

    def whole(model, ids, mask, mode, path, new_tokens, draft=None):
        return call(model, ids, mask, "greedy", path, new_tokens, draft)

    monkeypatch.setattr(generate_flavours, "call_generate", whole)
    with pytest.raises(RuntimeError, match="ran the prefill whole though asked for prefill_chunk_size=4"):
        CHECKS["generate/concat/chunked"]("transformers", "cpu", torch.float32)


@needs_5x
def test_a_multi_turn_chat_continues_the_cache_and_a_second_turn_from_scratch_is_an_error(monkeypatch):
    """generate/<path>/multi-turn: the second turn's first call receives the cache the first turn filled and is fed
    the reply and the first turn's last token; both turns' tokens are judged. A second generate that starts over
    (no cache handed to it) checked nothing of a continued cache: an error, never a pass."""
    from mpt_kv.checks import generate_flavours

    for path in ("concat", "static"):
        notes = CHECKS[f"generate/{path}/multi-turn"]("transformers", "cpu", torch.float32)
        assert any("generate made 8 calls: 1 k-token calls" in n for n in notes), notes

    def from_scratch(model, ids, mask, path, new_tokens):
        kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                      eos_token_id=generate_flavours.unreachable_eos(model))
        first = model.generate(ids, attention_mask=mask, **kwargs)
        ids2 = torch.cat([first, torch.tensor([list(generate_flavours.REPLY)] * ids.shape[0])], dim=1)
        mask2 = torch.cat([mask, torch.ones(ids.shape[0], ids2.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        return model.generate(ids2, attention_mask=mask2, **kwargs)

    monkeypatch.setattr(generate_flavours, "multi_turn", from_scratch)
    with pytest.raises(RuntimeError, match="second turn did not continue the cache the first filled"):
        CHECKS["generate/concat/multi-turn"]("transformers", "cpu", torch.float32)


@needs_5x
def test_a_bug_of_continuing_a_cache_alone_fails_the_multi_turn_cell_only():
    """llm-foundry's rule in transformers' MPT (the catalogue's continue_feeds_last_token_only):
    prepare_inputs_for_generation feeds one token whenever the cache holds positions. Greedy, beam and a chunked
    prefill pass (each of their calls after the first feeds one token anyway); a second turn continuing the cache
    drops the user's reply, and its cell fails."""
    variant = GENERATE_VARIANTS["continue_feeds_last_token_only"]
    for mode in ("greedy", "beam", "chunked"):
        generate_catalogue.run(variant, mode)
    # the second turn's first call is fed 1 token where the sequence asks 3: the cache it received is 2 positions
    # short of the sequence less what it was fed
    with pytest.raises(PropertyFailure, match=r"generate/concat/multi-turn call 4 \(decode\): the cache it received .* "
                                              r"the analytic K/V of 2 x 11 tokens"):
        generate_catalogue.run(variant, "multi-turn")


@pytest.mark.skipif(transformers_major() >= 5, reason="transformers 5.x runs contrastive search from the Hub only")
def test_contrastive_candidates_are_judged_over_the_history_they_follow(monkeypatch):
    """generate/concat/contrastive (transformers 4.x): each step feeds batch x top_k candidates, one token each
    without their history; the drive judges each against the tokens generate chose before it, repeated top_k
    times, and the candidate. Judged over the other row's history, the same run fails; a generate that scored no
    candidates checked nothing of contrastive search: an error."""
    from mpt_kv.checks import generate_flavours

    notes = CHECKS["generate/concat/contrastive"]("transformers/llama/mha", "cpu", torch.float32)
    assert any("generate made" in n for n in notes), notes
    history = generate_driver.candidates_history

    def other_rows(drive):
        drive.sequences = drive.sequences.flip(0)
        history(drive)

    monkeypatch.setattr(generate_driver, "candidates_history", other_rows)
    with pytest.raises(PropertyFailure, match=r"generate/concat/contrastive call 1 \(decode\): logits"):
        CHECKS["generate/concat/contrastive"]("transformers/llama/mha", "cpu", torch.float32)
    monkeypatch.undo()
    call = generate_flavours.call_generate
    monkeypatch.setattr(generate_flavours, "call_generate",
                        lambda model, ids, mask, mode, *a: call(model, ids, mask, "greedy", *a))
    with pytest.raises(RuntimeError, match="scored no candidates in a call of batch x top_k rows"):
        CHECKS["generate/concat/contrastive"]("transformers/llama/mha", "cpu", torch.float32)


def test_a_candidate_call_whose_history_is_unknown_still_has_its_caches_judged():
    """A contrastive run that crashed returned no tokens, so its candidate calls' logits cannot be judged (their
    history is what generate returns); what was wrong with the cache a candidate call returned still fails it."""
    from types import SimpleNamespace

    from mpt_kv.checks.generate import GenerateContext, judge_calls
    from mpt_kv.checks.generate_driver import Call, Drive

    ids = torch.ones(6, 1, dtype=torch.long)
    call = Call(1, ids, torch.ones(6, 7, dtype=torch.long), 1, logits=torch.zeros(6, 1, 8), received=6, returned=7,
                problems={"returned": ["layer 0 key pins 128 bytes"]}, fed_ids=ids, history_unknown=True)
    drive = Drive("contrastive", "concat", torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), 4,
                  calls=[call])
    subject = SimpleNamespace(flavour=SimpleNamespace(name="transformers"))
    c = GenerateContext("t", "generate/concat/contrastive", "contrastive", "concat", torch.float32, subject)
    with pytest.raises(PropertyFailure, match="call 1 \\(decode\\): the cache it returned layer 0 key pins 128 bytes"):
        judge_calls(c, drive, None, [])
    assert any("its logits not judged" in n for n in c.notes), c.notes


@pytest.mark.skipif(transformers_major() < 5, reason="transformers 4.x runs contrastive and constrained beam search")
def test_contrastive_and_constrained_search_on_transformers_5_are_unsupported_saying_why():
    with pytest.raises(Unsupported, match="runs contrastive search from the Hub only"):
        CHECKS["generate/concat/contrastive"]("transformers", "cpu", torch.float32)
    with pytest.raises(Unsupported, match="runs constrained beam search from the Hub only"):
        CHECKS["generate/static/constrained"]("transformers", "cpu", torch.float32)


@pytest.mark.skipif(transformers_major() >= 5, reason="transformers 5.x runs constrained beam search from the Hub only")
def test_constrained_beam_search_must_return_the_forced_token(monkeypatch):
    """generate/<path>/constrained: every row's new tokens contain the forced token (force_words_ids); a generate
    that drops the constraint (plain beam search) fails, naming the rows."""
    from mpt_kv.checks import generate_flavours

    CHECKS["generate/concat/constrained"]("transformers/llama/mha", "cpu", torch.float32)
    call = generate_flavours.call_generate
    monkeypatch.setattr(generate_flavours, "call_generate",
                        lambda model, ids, mask, mode, *a: call(model, ids, mask, "beam", *a))
    with pytest.raises(PropertyFailure, match=r"rows \[0, 1\] of the returned tokens lack the forced token 7"):
        CHECKS["generate/concat/constrained"]("transformers/llama/mha", "cpu", torch.float32)


def test_the_reference_has_no_generate_and_says_so():
    with pytest.raises(Unsupported, match="ReferenceMPT has no generate"):
        CHECKS["generate/concat/greedy"]("reference", "cpu", torch.float32)


@pytest.mark.skipif(transformers_major() < 5, reason="transformers 4.x's MPT caches views of Wqkv (a known failure)")
def test_a_clean_generate_passes_and_says_what_it_did():
    notes = CHECKS["generate/concat/beam"]("transformers", "cpu", torch.float32)
    assert any("calls" in n and "reorders seen" in n for n in notes), notes


def test_bf16_and_other_devices_are_unsupported_not_passed():
    with pytest.raises(Unsupported, match="runs in float32"):
        CHECKS["generate/concat/greedy"]("transformers", "cpu", torch.bfloat16)


# --- docs/gate.md rows 99-104: a generate cell green without the generate half checked --------------------------

def no_forward_generate():
    """An MPT whose generate computes the right greedy tokens without calling its top-level forward (through its
    transformer and lm_head directly): no call the drive could observe."""
    from transformers import MptForCausalLM

    class NoForward(MptForCausalLM):
        def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **kwargs):
            ids, mask = input_ids, attention_mask
            for _ in range(max_new_tokens):
                hidden = self.transformer(ids, attention_mask=mask, use_cache=False)[0]
                token = self.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)
                ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            return ids

    return NoForward


def test_99_a_generate_that_calls_no_forward_is_an_error():
    """Seen failing: without the rule the cell passed (its tokens are right, no cache was kept)."""
    with pytest.raises(RuntimeError, match="returned without a forward call of its model"):
        CHECKS["generate/concat/greedy"](transformers_target(no_forward_generate()), "cpu", torch.float32)


@needs_5x
def test_100_an_assisted_generate_that_verified_no_candidate_is_an_error(monkeypatch):
    """Prompt lookup that finds no n-gram proposes nothing, and generate decodes token by token (transformers'
    PromptLookupCandidateGenerator.get_candidates returns the input unchanged). Seen failing: without the rule
    the cell passed, assisted decoding never reached."""
    from transformers.generation import candidate_generator

    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "get_candidates",
                        lambda self, input_ids, **kwargs: (input_ids, None))
    with pytest.raises(RuntimeError, match="verified no candidates in a k-token call"):
        CHECKS["generate/concat/prompt-lookup"](
            transformers_target(generate_catalogue.copying_crop()), "cpu", torch.float32)


def test_101_an_exception_of_the_observer_is_an_error_never_the_implementations_crash(monkeypatch):
    """A known failure xfails only a PropertyFailure (a crash is one): the drive's own bug must not read as the
    implementation's. Seen failing: the ValueError came out as "the implementation's generate raised"."""
    from mpt_kv.families import models

    def unreadable(cache):
        raise ValueError("the drive cannot read this cache")

    monkeypatch.setattr(models, "cached_kv", unreadable)
    with pytest.raises(generate_driver.ObserverError, match="the generate drive's observer raised ValueError"):
        CHECKS["generate/concat/greedy"]("transformers", "cpu", torch.float32)


@needs_5x
def test_102_a_cache_kept_after_generate_fails_and_a_declared_pool_passes():
    """Seen failing: without judge_kept the variant passed every column."""
    with pytest.raises(PropertyFailure, match="after generate returned: 4 cache storages it made are still alive"):
        generate_catalogue.run(GENERATE_VARIANTS["cache_kept_after_generate"], "greedy")
    notes = generate_catalogue.run(GENERATE_DESIGNS["generate_cache_pool"], "greedy")
    assert any("cache_pool declared" in n for n in notes), notes


@pytest.mark.parametrize("pattern", [
    "the implementation's generate raised RuntimeError",
    "generate/concat/greedy: the implementation's generate raised",
    "call 0 \\(prefill\\): the cache it received",
    "after generate returned: \\d+ cache storages it made are still alive",
])
def test_103_a_pattern_naming_only_a_generate_check_s_words_is_refused(pattern):
    """Seen failing: before the generate checks' lines joined the generic failures these compiled."""
    def bad(what):
        return KnownFailuresError(what)

    with pytest.raises(KnownFailuresError, match="matches a generic failure"):
        compile_pattern(pattern, bad)


def stale_token_prepare():
    """prepare_inputs_for_generation that feeds the token before the last one on decode steps (its position's
    token one step stale): the cache and the call agree with each other, not with the sequence generate holds."""
    base = generate_catalogue.copying_crop()

    class Stale(base):
        def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
            inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
            if inputs["input_ids"].shape[1] == 1 and input_ids.shape[1] > 1:
                inputs["input_ids"] = input_ids[:, -2:-1].clone()
            return inputs

    return Stale


@needs_5x
def test_104_each_call_is_judged_against_the_sequence_generate_holds_not_what_it_fed():
    """The oracle is prepare_inputs_for_generation's input (the sequence generate holds), so a call fed another
    token than generate's fails at that call. Seen failing with the oracle over the forward's own input."""
    with pytest.raises(PropertyFailure, match="call 1 \\(decode\\): logits .* vs an uncached forward of the same "
                                              "weights over the 7 positions generate held"):
        CHECKS["generate/concat/greedy"](transformers_target(stale_token_prepare()), "cpu", torch.float32)


# --- the catalogue ----------------------------------------------------------------------------------------------

def test_the_generate_catalogue_names_its_columns_origins_and_killers():
    assert GENERATE_COLUMNS == generate_driver.MODES
    assert not set(GENERATE_DESIGNS) & set(GENERATE_VARIANTS)
    for name, e in [*GENERATE_DESIGNS.items(), *GENERATE_VARIANTS.items()]:
        assert e.name == name and e.why and e.origin and e.path in ("concat", "static"), name
        assert set(e.modes) <= set(GENERATE_COLUMNS) and set(e.killed_by) <= set(e.modes), name
        assert getattr(generate_catalogue, name) is e.build  # a target factory: --target ...:<name>
    assert all(e.killed_by for e in GENERATE_VARIANTS.values())


@pytest.mark.killmatrix
@needs_5x
@pytest.mark.parametrize("name", sorted(GENERATE_VARIANTS))
def test_each_generate_variant_is_killed_by_its_columns(name):
    e = GENERATE_VARIANTS[name]
    for mode in e.killed_by:
        with pytest.raises(PropertyFailure):
            generate_catalogue.run(e, mode)


@pytest.mark.killmatrix
@needs_5x
@pytest.mark.parametrize("name", sorted(GENERATE_DESIGNS))
def test_each_generate_design_passes_its_columns(name):
    e = GENERATE_DESIGNS[name]
    for mode in e.modes:
        generate_catalogue.run(e, mode)


@needs_5x
def test_killmatrix_exit_status_on_the_generate_rows(capsys):
    from mpt_kv.cli import killmatrix

    assert killmatrix.main(["--check", "generate", "--variant", "beam_reorder_keys_only"]) == 0
    out = capsys.readouterr().out
    assert "beam_reorder_keys_only (concat)" in out and "killed*" in out


# --- optimum-habana's own generate on CPU -----------------------------------------------------------------------

@pytest.mark.optimum_habana
def test_optimum_habanas_generate_runs_on_cpu_and_transformers_is_restored_after():
    from transformers.generation.utils import GenerationMixin

    from mpt_kv.targets import gaudi_generate

    before = GenerationMixin.generate
    notes = CHECKS["generate/static/greedy"]("optimum-habana", "cpu", torch.float32)
    assert any("calls" in n for n in notes), notes
    assert GenerationMixin.generate is before
    with gaudi_generate.gaudi_generation() as module:
        assert GenerationMixin.generate is module.GaudiGenerationMixin.generate
    assert GenerationMixin.generate is before


@pytest.mark.optimum_habana
def test_a_bug_of_the_reuse_cache_path_alone_fails_its_generate_cell_only(monkeypatch):
    """The reuse_cache cell reads the model's buffers and judges its calls: a KVCache that drops the prompt's
    last position when it initialises a preallocated buffer (the reuse_cache prefill's branch alone) fails
    generate/static+reuse; generate's plain static path, which never takes that branch, still passes."""
    from mpt_kv.families import FAMILIES
    from mpt_kv.families.gaudi import load_port_module

    target = FamilyTarget("optimum-habana", "llama", "mha", ("concat", "static", "static+reuse"))
    kv_cache = load_port_module(FAMILIES["llama"]).KVCache  # the llama port's own (models/llama/modeling_llama.py)
    update = kv_cache.update

    def drops_the_last_prompt_position(prev, cur, dim, idx, inp_seq_len):
        if inp_seq_len != -1 and prev.shape != cur.shape and 1 < cur.shape[2] <= prev.shape[2]:
            prev[:, :, :inp_seq_len - 1, :].copy_(cur[:, :, :-1])
            return cur
        return update(prev, cur, dim, idx, inp_seq_len)

    monkeypatch.setattr(kv_cache, "update", staticmethod(drops_the_last_prompt_position))
    CHECKS["generate/static/greedy"](target, "cpu", torch.float32)
    with pytest.raises(PropertyFailure, match=r"generate/static\+reuse/greedy call 1 \(decode\): logits"):
        CHECKS["generate/static+reuse/greedy"](target, "cpu", torch.float32)
