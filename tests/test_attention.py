"""transformers' attention implementations as an axis of the family matrix (`mpt_kv.families.implementations.
ATTENTION`): which family has which is read from transformers itself; the targets are sdpa first, then eager,
the oracle's; the sdpa target runs transformers' sdpa path with the eager model's weights; family-P1 drives an
unpadded batch where sdpa skips the mask; an attention the model class lacks is unsupported with transformers'
reason; the known failures' entries name an attention implementation or cover them all; the run's summary names
the ones not generated here. (The catalogue's sdpa rows: tests/test_family_catalogue.py.)"""

import dataclasses
import json
import re

import pytest
import torch

from mpt_kv import CHECKS as ALL_CHECKS
from mpt_kv.checks import family_driver
from mpt_kv.checks.family import CHECKS
from mpt_kv.errors import TargetUnavailable, Unsupported
from mpt_kv.families import FAMILIES
from mpt_kv.families.implementations import (ATTENTION, ORACLE_ATTENTION, attention_left_out, attention_support,
                                             family_targets, generated_attention)
from mpt_kv.families.models import build
from mpt_kv.findings import entries as kf
from mpt_kv.targets import FamilyTarget, family_target

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def fresh_runners():
    family_driver.clear_caches()
    yield
    family_driver.clear_caches()


def transformers_families():
    return [name for name, f in FAMILIES.items() if not f.remote_code]


# --- the axis, read from transformers -----------------------------------------------------------------------

@pytest.mark.parametrize("family", transformers_families())
def test_which_family_has_sdpa_is_what_transformers_itself_accepts(family):
    """No hand list: a class transformers does not build with sdpa (5.x: from_config raises; 4.55: it builds
    the model with eager attention instead) is the one attention_support names, with the class's own flag;
    every other builds with sdpa set."""
    model, config = build(FAMILIES[family], next(iter(FAMILIES[family].variants)))
    reason = attention_support(type(model), "sdpa")
    try:
        runs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").config._attn_implementation
    except ValueError as e:
        runs = f"none: {e}"
    if runs != "sdpa":
        assert reason is not None, f"transformers builds {type(model).__name__} with {runs!r} for sdpa, mpt-kv would run it"
        assert f"{type(model).__name__}._supports_sdpa is False" in reason
        return
    assert reason is None, f"transformers builds {type(model).__name__} with sdpa, mpt-kv calls it unsupported: {reason}"


def test_the_transformers_targets_are_sdpa_first_then_eager_the_oracle():
    targets = [t for t in family_targets(["transformers"]) if t.family_name == "llama"]
    assert generated_attention() == ["sdpa", "eager"] and ORACLE_ATTENTION == "eager"
    assert [t.name for t in targets[:2]] == ["transformers[sdpa]/llama/mha", "transformers[eager]/llama/mha"]
    assert [(t.attention, t.oracle) for t in targets[:2]] == [("sdpa", False), ("eager", True)]
    # no transformers model of a remote-code family: one target, no attention axis
    assert [t.name for t in family_targets(["transformers"]) if t.family_name == "baichuan"] == [
        "transformers/baichuan/alibi"]
    assert {t.attention for t in family_targets(["optimum-habana"])} == {None}


def test_a_family_target_names_its_attention_and_the_name_parses_back():
    target = family_target("transformers[sdpa]/gpt2/mha")
    assert (target.implementation, target.attention, target.family_name, target.variant) == (
        "transformers", "sdpa", "gpt2", "mha")
    assert target.name == "transformers[sdpa]/gpt2/mha" and target.implementation_label == "transformers[sdpa]"
    assert family_target("transformers/gpt2/mha").attention is None  # the builder's own: eager


# --- what the sdpa target runs ------------------------------------------------------------------------------

def sdpa_calls(monkeypatch) -> list[dict]:
    """Every torch scaled_dot_product_attention call from now on: whether it had a mask, is_causal, the query length."""
    calls, original = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append({"mask": attn_mask is not None, "is_causal": is_causal, "q": query.shape[-2], "k": key.shape[-2]})
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_the_sdpa_target_runs_sdpa_with_the_eager_models_weights(monkeypatch):
    eager, _ = build(FAMILIES["llama"], "gqa")
    sdpa, _ = build(FAMILIES["llama"], "gqa", attention="sdpa")
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), sdpa.state_dict().values()))
    calls = sdpa_calls(monkeypatch)
    CHECKS["family-P1"]("transformers", "llama", "gqa", attention="eager")
    assert calls == [], "the eager target called torch's sdpa"
    CHECKS["family-P1"]("transformers", "llama", "gqa", attention="sdpa")
    assert calls, "the sdpa target never called torch's sdpa"


def test_family_p1_drives_an_unpadded_batch_where_sdpa_skips_the_mask(monkeypatch):
    """sdpa skips the mask of an unpadded batch's prefill (is_causal) and decode steps (no mask), and builds it
    for a k-token cached call (is_causal would align it upper-left): family-P1 reaches all three; the padded
    drives (family-ops here) build the mask every time."""
    calls = sdpa_calls(monkeypatch)
    CHECKS["family-P1"]("transformers", "llama", "gqa", attention="sdpa")
    prefill, decode, extend = ([c for c in calls if (c["q"], c["q"] == c["k"]) == key]
                               for key in ((6, True), (1, False), (3, False)))
    assert prefill and all(c["is_causal"] and not c["mask"] for c in prefill), prefill
    assert decode and all(not c["is_causal"] and not c["mask"] for c in decode), decode
    assert extend and all(c["mask"] and not c["is_causal"] for c in extend), extend
    calls.clear()
    CHECKS["family-ops"]("transformers", "llama", "gqa", attention="sdpa")
    assert calls and all(c["mask"] and not c["is_causal"] for c in calls)
    assert family_driver.context_of("transformers", "llama", "gqa", "concat", check="family-P1",
                                    attention="eager").pads == (family_driver.PAD, 0)


def test_an_attention_the_class_lacks_is_unsupported_with_transformers_reason():
    """transformers' MPT is eager only: its sdpa row says so in every cell, never a pass."""
    with pytest.raises(TargetUnavailable, match=r"transformers \S+: MptForCausalLM._supports_sdpa is False: .*"
                                                r"from_pretrained falls back to eager for it"):
        CHECKS["family-P1"]("transformers", "mpt", "alibi", attention="sdpa")
    with pytest.raises(Unsupported, match=r"transformers\[sdpa\]/mpt/alibi: .*MptForCausalLM._supports_sdpa is False"):
        ALL_CHECKS["family-P3/concat"]("transformers[sdpa]/mpt/alibi")
    with pytest.raises(ValueError, match=r"unknown attention 'sdpa2'; transformers' attention implementations here: "
                                         r"\['sdpa', 'eager', 'flex_attention', 'flash_attention_2'\]"):
        CHECKS["family-P1"]("transformers", "llama", "gqa", attention="sdpa2")


def test_the_implementations_not_generated_here_say_why():
    left_out = attention_left_out()
    assert set(left_out) == {"transformers[flex_attention]", "transformers[flash_attention_2]"}
    assert "torch.compile" in left_out["transformers[flex_attention]"]
    assert "CUDA only" in left_out["transformers[flash_attention_2]"]
    assert set(generated_attention(("cuda",))) == set(ATTENTION)

    from mpt_kv.plugin.parametrize import summary

    class Config:
        stash: dict = {}

        def getoption(self, name, default=None):
            return default

    lines = []
    tw = type("TW", (), {"write_line": lambda self, line: lines.append(line)})()
    monkey = pytest.MonkeyPatch()
    with monkey.context() as m:
        m.setattr("mpt_kv.plugin.parametrize.absent_kinds", lambda config: {})
        m.setattr("mpt_kv.plugin.parametrize.absent_targets", lambda config: {})
        summary(tw, Config(), [{"target": "transformers[sdpa]/llama/mha"}])
    assert len(lines) == 1 and "no transformers[flex_attention] family cases (transformers runs flex_attention " \
                               "through torch.compile" in lines[0] and "no transformers[flash_attention_2]" in lines[0]


def test_family_p0_compares_sdpa_with_the_eager_oracle():
    assert CHECKS["family-P0"]("transformers", "llama", "gqa", attention="sdpa") == []
    assert any(t.attention == "sdpa" and not t.oracle for t in family_targets(["transformers"]))


# --- known failures: an entry names an attention implementation or covers every one --------------------------

def test_an_entry_without_an_attention_covers_every_attention_and_one_with_its_own():
    every = kf.Entry(0, "transformers/gpt2/mha", "family-P3", "r", re.compile("x"))
    sdpa = dataclasses.replace(every, target="transformers[sdpa]/gpt2/mha")
    for name in ("transformers[sdpa]/gpt2/mha", "transformers[eager]/gpt2/mha", "transformers/gpt2/mha"):
        assert every.covers(name, "family-P3", "concat", None)
    assert sdpa.covers("transformers[sdpa]/gpt2/mha", "family-P3", "concat", None)
    assert not sdpa.covers("transformers[eager]/gpt2/mha", "family-P3", "concat", None)
    assert not sdpa.covers("transformers/gpt2/mha", "family-P3", "concat", None)
    assert not every.covers("transformers[sdpa]/gpt2/mqa", "family-P3", "concat", None)
    assert (sdpa.implementation, sdpa.attention, every.attention) == ("transformers", "sdpa", None)


@pytest.mark.parametrize("target, prop, message", [
    ("transformers[sdpa2]/gpt2/mha", "family-P1", r"an attention implementation is named on transformers only, one "
                                                  r"of \('sdpa', 'eager'"),
    ("optimum-habana[sdpa]/gpt2/mha", "family-P1", r"an attention implementation is named on transformers only"),
    # P0 of transformers with eager attention is the oracle's own: no cell, whether eager is named or not
    ("transformers/gpt2/mha", "family-P0", r"the matrix has no such cell"),
    ("transformers[eager]/gpt2/mha", "family-P0", r"the matrix has no such cell"),
])
def test_a_family_entry_names_an_attention_the_matrix_has(tmp_path, target, prop, message):
    entry = {"target": target, "property": prop, "pattern": "cached logits vs transformers. uncached forward", "reason": "r", "upstream": "u", "when": {}}
    path = tmp_path / "k.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ValueError, match=message):
        kf.load_families(path)
    path.write_text(json.dumps([{**entry, "target": "transformers[sdpa]/gpt2/mha", "property": "family-P0"}]))
    (loaded,) = kf.load_families(path)  # sdpa's P0 is a cell: against the eager oracle
    assert (loaded.implementation, loaded.attention) == ("transformers", "sdpa")


def test_the_sdpa_finding_is_scoped_to_the_sdpa_cells():
    """transformers[sdpa]/falcon/alibi's entries (the eager oracle's double ALiBi) take the sdpa cells only: the
    eager ones pass (their oracle is themselves), so an entry without the attention would be an XPASS there."""
    found = [e for e in kf.load_families() if e.target == "transformers[sdpa]/falcon/alibi"]
    # (and the generate drive's sdpa cells: generate runs the attention from_pretrained picks)
    assert {e.property for e in found} == {"family-P0", "family-P1", "family-ops", "generate"}
    assert CHECKS["family-P1"]("transformers", "falcon", "alibi", attention="eager") == []
    if any(e.applies() for e in found):
        from mpt_kv.checks.compare import PropertyFailure

        with pytest.raises(PropertyFailure) as failure:
            CHECKS["family-P1"]("transformers", "falcon", "alibi", attention="sdpa")
        assert next(e for e in found if e.property == "family-P1").explains(failure.value)


def test_a_model_built_with_another_attention_than_asked_is_an_error(monkeypatch):
    """Fail closed: were transformers to build the model with eager attention when asked for sdpa (4.55.4 does
    so for a class without sdpa), the sdpa target would check eager under sdpa's name; the build refuses it."""
    original = transformers.AutoModelForCausalLM.from_config

    def falls_back(config, attn_implementation=None, **kwargs):
        return original(config, attn_implementation="eager", **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", falls_back)
    with pytest.raises(RuntimeError, match=r"LlamaForCausalLM built with attn_implementation='sdpa' runs 'eager'"):
        build(FAMILIES["llama"], "mqa", attention="sdpa")
