"""optimum-habana's ports of the families, on CPU (mpt_kv/families/gaudi.py): each builds with
transformers' weights, gives transformers' uncached logits (P0 sanity), its cached decode gives
its own uncached forward on the concat and the static path, and where it cannot be built the
reason is right.

Without optimum-habana (the cpu env) the port cases are skipped, with that reason only; where it
is installed they run, and under CI a port that does not load fails (PortError), never skips.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mpt_kv.errors import TargetUnavailable
from mpt_kv.families import FAMILIES
from mpt_kv.families import gaudi
from mpt_kv.families.base import Family, GaudiPort
from mpt_kv.checks.family_driver import BATCH, PAD, PROMPT, prompt
from mpt_kv.families.models import build

HAVE_OH = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.habana") is not None
needs_oh = pytest.mark.optimum_habana  # deselected where it is not installed (tests/conftest.py)

# the ports this file checks (fam-ports' families have their own tests), every variant
PORTS = ("mpt", "gpt2", "gpt_neox", "bloom", "codegen", "persimmon", "phi", "stablelm")
VARIANTS = [(n, v) for n in PORTS for v in FAMILIES[n].variants]
STEPS = 3
TOL = 1e-5  # fp32, same weights, same ops up to summation order
# What optimum-habana 1.21.2's ports raise however they are driven (mpt_kv/findings/family_known_failures.json
# has them as findings): (family, variant) -> (paths, "uncached" included, exception, message). A case
# here must still raise exactly that: a release that fixes it fails the test, so the entry goes.
CRASHES = {
    ("codegen", "mha"): (("uncached", "concat", "static"), TypeError,
                         r'^can only concatenate tuple \(not "Tensor"\) to tuple$'),
    ("phi", "gqa"): (("uncached", "concat", "static"), RuntimeError,
                     r"^The size of tensor a \(2\) must match the size of tensor b \(\d+\) at non-singleton dimension 2$"),
    ("persimmon", "mha"): (("concat",), AttributeError, r"^'DynamicCache' object has no attribute 'get_usable_length'$"),
    ("stablelm", "gqa"): (("concat",), AttributeError, r"^'DynamicCache' object has no attribute 'get_usable_length'$"),
}


def crash(name: str, variant: str, path: str):
    paths, error, message = CRASHES.get((name, variant), ((), None, None))
    return (error, message) if path in paths else None


@pytest.fixture(scope="module")
def runners():
    """(family, variant, options) -> runner, built once per module (a build is most of a case's time)."""
    made = {}

    def get(name, variant=None, **options):
        family = FAMILIES[name]
        variant = variant or next(iter(family.variants))
        key = (name, variant, tuple(sorted(options.items())))
        if key not in made:
            made[key] = gaudi.gaudi_runner(family, variant, **options)  # PortError: a failure, never a skip
        return made[key]

    return get


def real(mask: torch.Tensor) -> torch.Tensor:
    """The positions that are tokens (a padded query row attends to nothing: any output is fine)."""
    return mask.bool()


def test_every_port_of_this_file_has_an_entry():
    assert [n for n in PORTS if FAMILIES[n].gaudi is None] == []


@needs_oh
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_the_port_holds_transformers_weights_and_gives_its_uncached_logits(runners, name, variant):
    runner = runners(name, variant)
    reference, config = build(FAMILIES[name], variant)
    ported = runner.model.state_dict()
    assert ported.keys() == reference.state_dict().keys()
    assert all(torch.equal(ported[k], v) for k, v in reference.state_dict().items())
    ids, mask = prompt(config)
    known = crash(name, variant, "uncached")
    with torch.inference_mode():
        if known:
            with pytest.raises(known[0], match=known[1]):
                runner.logits(ids, mask)
            return
        got = runner.logits(ids, mask)
        want = reference(ids, attention_mask=mask, use_cache=False).logits
    assert got.shape == (BATCH, PROMPT, config.vocab_size)
    diff = (got - want).abs()[real(mask)].max().item()
    assert diff <= TOL, f"optimum-habana/{name}/{variant}: uncached logits differ from transformers' by {diff:.3g}"


def decode_against_uncached(runner, path: str, max_len: int = PROMPT + STEPS + 3, bucket=None):
    """Prefill + STEPS greedy decodes on `path`: (the largest |cached - uncached| over the steps, the session)."""
    ids, mask = prompt(build(runner.family, runner.variant)[1])
    session = runner.session(path, max_len, bucket)
    with torch.inference_mode():
        steps = [session.prefill(ids, mask)[:, -1]]
        seq = ids
        for _ in range(STEPS):
            token = steps[-1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], 1)
            steps.append(session.decode(token))
        full = runner.logits(seq, torch.cat([mask, torch.ones(BATCH, STEPS, dtype=mask.dtype)], 1))
    return max((s - full[:, PROMPT - 1 + i]).abs().max().item() for i, s in enumerate(steps)), session


def assert_full_length_buffers(runner, session, max_len: int):
    """The static path's kv() is the port's preallocated buffers, max_len long, one tuple per layer."""
    kv = session.kv()
    assert len(kv) == runner.family.layers(runner.model.config)
    for layer in kv:
        assert all(max_len in t.shape for t in layer), [tuple(t.shape) for t in layer]


@needs_oh
@pytest.mark.parametrize("path", ["concat", "static"])
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_the_ports_cached_decode_gives_its_uncached_forward(runners, name, variant, path):
    runner = runners(name, variant)
    assert runner.capabilities.reason(path) is None  # every port here has both paths
    known = crash(name, variant, path)
    if known:
        with pytest.raises(known[0], match=known[1]):
            decode_against_uncached(runner, path)
        return
    diff, session = decode_against_uncached(runner, path)
    assert diff <= TOL, f"optimum-habana/{name}/{variant} {path}: cached decode differs from the uncached forward by {diff:.3g}"
    if path == "static":
        assert_full_length_buffers(runner, session, PROMPT + STEPS + 3)
    else:
        assert all(t.shape[-1] == PROMPT + STEPS or t.shape[-2] == PROMPT + STEPS for t in session.kv()[0])


@needs_oh
def test_mpts_cache_idx_buckets_run_through_the_port(runners):
    runner = runners("mpt")
    assert runner.capabilities.reason("bucket") is None
    diff, session = decode_against_uncached(runner, "static", bucket=4)
    assert diff <= TOL
    assert_full_length_buffers(runner, session, PROMPT + STEPS + 3)


@needs_oh
def test_phis_reuse_cache_decodes_into_its_preallocated_kv_cache(runners):
    runner = runners("phi", "mha", reuse_cache=True)
    assert runner.capabilities.cache_pool
    diff, session = decode_against_uncached(runner, "static")
    assert diff <= TOL
    assert_full_length_buffers(runner, session, PROMPT + STEPS + 3)
    attn = runner.model.model.layers[0].self_attn
    assert session.kv()[0][0] is attn.k_cache.cache  # the KVCache module's own buffer
    assert isinstance(session.past[0][0], torch.Size)  # what the port returns with reuse_cache: shapes
    # beam search with reuse_cache calls the model's reorder_kv_cache (generation/utils.py:3461): phi has none
    with pytest.raises(AttributeError, match="'GaudiPhiForCausalLM' object has no attribute 'reorder_kv_cache'"):
        session.reorder(torch.tensor([1, 0]))


def test_not_installed_is_the_reason(monkeypatch):
    """The cpu env has no optimum-habana: "not installed"; where it is installed, hidden."""
    if HAVE_OH:
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "optimum" else real_find_spec(n, *a))
        monkeypatch.delitem(sys.modules, FAMILIES["gpt2"].gaudi.module, raising=False)
    with pytest.raises(TargetUnavailable, match="^optimum-habana is not installed"):
        gaudi.gaudi_runner(FAMILIES["gpt2"], "mha")


def test_a_family_without_a_port_entry_is_unavailable_naming_it():
    family = Family(name="nosuch", model_type="gpt2", variants={"mha": {}})
    with pytest.raises(TargetUnavailable, match="no optimum-habana port entry for family nosuch"):
        gaudi.gaudi_runner(family, "mha")


@needs_oh
def test_a_release_without_the_ports_module_is_unavailable_naming_the_file():
    port = replace(FAMILIES["gpt2"].gaudi, module="optimum.habana.transformers.models.nosuch.modeling_nosuch")
    with pytest.raises(TargetUnavailable, match=r"optimum-habana 1\.\d+\.\d+ has no port of gpt2: .*modeling_nosuch.py "
                                                r"does not exist"):
        gaudi.gaudi_runner(replace(FAMILIES["gpt2"], gaudi=port), "mha")


@needs_oh
def test_a_port_that_fails_to_import_is_an_error_with_the_real_exception(monkeypatch):
    port = FAMILIES["gpt2"].gaudi
    monkeypatch.delitem(sys.modules, port.module, raising=False)

    def broken(name, *a):
        raise ImportError(f"cannot import name 'X' from {name}")

    monkeypatch.setattr(gaudi.importlib, "import_module", broken)
    with pytest.raises(gaudi.PortError, match=r"fails to import on CPU .*ImportError: cannot import name 'X'") as e:
        gaudi.gaudi_runner(FAMILIES["gpt2"], "mha")
    assert isinstance(e.value.__cause__, ImportError)


@needs_oh
def test_a_port_class_missing_from_the_module_is_an_error():
    port = replace(FAMILIES["gpt2"].gaudi, causal_lm="GaudiNoSuchLMHeadModel")
    with pytest.raises(gaudi.PortError, match="has no GaudiNoSuchLMHeadModel"):
        gaudi.gaudi_runner(replace(FAMILIES["gpt2"], gaudi=port), "mha")


@needs_oh
def test_reuse_cache_on_a_port_without_it_is_unavailable_naming_it():
    with pytest.raises(TargetUnavailable, match="port of gpt2 .*has no reuse_cache"):
        gaudi.gaudi_runner(FAMILIES["gpt2"], "mha", reuse_cache=True)


@needs_oh
def test_buckets_are_unsupported_where_the_port_takes_no_cache_idx(runners):
    reason = runners("gpt2").capabilities.reason("bucket")
    assert reason == "GaudiGPT2LMHeadModel.forward has no cache_idx parameter (optimum-habana's bucketed cache)"



@needs_oh
def test_attribute_patches_reach_the_ports_modules_and_leave_transformers_classes_alone(runners):
    """adapt_transformers_to_gaudi's `GPTNeoXModel.forward = gaudi_gpt_neox_model_forward` reaches
    the GPTNeoXModel the port builds through its own import of the name (gaudi.patch_instances)."""
    import transformers.models.gpt_neox.modeling_gpt_neox as hf

    original = hf.GPTNeoXModel.forward
    runner = runners("gpt_neox")
    module = gaudi.load_port_module(FAMILIES["gpt_neox"])
    assert type(runner.model.gpt_neox).forward is module.gaudi_gpt_neox_model_forward
    assert isinstance(runner.model.gpt_neox, hf.GPTNeoXModel)
    assert hf.GPTNeoXModel.forward is original and hf.GPTNeoXLayer is not module.GaudiGPTNeoXLayer
    plain = build(FAMILIES["gpt_neox"], "mha")[0]
    assert type(plain.gpt_neox) is hf.GPTNeoXModel and type(plain.gpt_neox.layers[0]) is hf.GPTNeoXLayer


DOCS = Path(__file__).resolve().parents[1] / "docs" / "families.md"


def docs_fork() -> str:
    """The fork of GPT-2's port with the views bug put back, as docs/families.md writes it."""
    text = DOCS.read_text()
    block = text[text.index("```python\n# gpt2_views_fork.py\n") + len("```python\n"):]
    return block[:block.index("```")]


@needs_oh
def test_a_fork_of_a_port_loads_and_its_views_are_found(tmp_path, monkeypatch):
    from mpt_kv.checks.family_storage import pinning_problems

    (tmp_path / "gpt2_views_fork.py").write_text(docs_fork())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gpt2_views_fork", raising=False)
    gpt2 = FAMILIES["gpt2"]
    fork = replace(gpt2, gaudi=replace(gpt2.gaudi, load=gaudi.fork_loader("gpt2", "gpt2_views_fork")))
    runner = gaudi.gaudi_runner(fork, "mha")
    assert type(runner.model.transformer.h[0].attn).__module__ == "gpt2_views_fork"
    diff, session = decode_against_uncached(runner, "static")
    assert diff <= TOL  # the fork computes the same logits ...
    fresh = runner.session("concat", PROMPT + 1)
    ids, mask = prompt(build(gpt2, "mha")[1])
    with torch.inference_mode():
        fresh.prefill(ids, mask)
    kv = [(layer, name, t) for layer, pair in enumerate(fresh.kv()) for name, t in zip(("key", "value"), pair)]
    problems = pinning_problems(kv, {})
    assert len(problems) == 2 and "pinned beyond the cache" in problems[0]  # ... but its prefill cache pins c_attn's output
    assert "layer 0 key (2, 4, 6, 8) and layer 0 value (2, 4, 6, 8) are views" in problems[0]
