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

import pytest
import torch

from mpt_kv.errors import TargetUnavailable, Unsupported
from mpt_kv.families import FAMILIES
from mpt_kv.families import gaudi
from mpt_kv.families.base import Family, GaudiPort
from mpt_kv.families.checks import BATCH, PAD, PROMPT, build, prompt
from mpt_kv.plugin.gate import in_ci

HAVE_OH = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.habana") is not None
NOT_INSTALLED = "optimum-habana is not installed (pip install --no-deps optimum-habana, or tox -e ohabana)"
needs_oh = pytest.mark.skipif(not HAVE_OH, reason=NOT_INSTALLED)

# the ports this file checks (fam-ports' families have their own tests)
PORTS = [n for n in ("mpt", "gpt2", "gpt_neox", "bloom", "codegen", "persimmon", "phi", "stablelm")
         if FAMILIES[n].gaudi is not None]
STEPS = 3
TOL = 1e-5  # fp32, same weights, same ops up to summation order


@pytest.fixture(scope="module")
def runners():
    """(family, variant) -> runner, built once per module (a build is most of a case's time)."""
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


@needs_oh
@pytest.mark.parametrize("name", PORTS)
def test_the_port_holds_transformers_weights_and_gives_its_uncached_logits(runners, name):
    runner = runners(name)
    family = FAMILIES[name]
    reference, config = build(family, runner.variant)
    ported = runner.model.state_dict()
    assert ported.keys() == reference.state_dict().keys()
    assert all(torch.equal(ported[k], v) for k, v in reference.state_dict().items())
    ids, mask = prompt(config)
    with torch.inference_mode():
        got = runner.logits(ids, mask)
        want = reference(ids, attention_mask=mask, use_cache=False).logits
    assert got.shape == (BATCH, PROMPT, config.vocab_size)
    diff = (got - want).abs()[real(mask)].max().item()
    assert diff <= TOL, f"optimum-habana/{name}: uncached logits differ from transformers' by {diff:.3g}"


def decode_against_uncached(runner, path: str, max_len: int = PROMPT + STEPS + 3) -> float:
    """Prefill + STEPS greedy decodes on `path`: the largest |cached - uncached| over the real tokens."""
    ids, mask = prompt(build(runner.family, runner.variant)[1])
    session = runner.session(path, max_len)
    with torch.inference_mode():
        steps = [session.prefill(ids, mask)[:, -1]]
        seq = ids
        for _ in range(STEPS):
            token = steps[-1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], 1)
            steps.append(session.decode(token))
        full = runner.logits(seq, torch.cat([mask, torch.ones(BATCH, STEPS, dtype=mask.dtype)], 1))
    return max((s - full[:, PROMPT - 1 + i]).abs().max().item() for i, s in enumerate(steps)), session


@needs_oh
@pytest.mark.parametrize("path", ["concat", "static"])
@pytest.mark.parametrize("name", PORTS)
def test_the_ports_cached_decode_gives_its_uncached_forward(runners, name, path):
    runner = runners(name)
    try:
        diff, session = decode_against_uncached(runner, path)
    except Unsupported as e:
        pytest.fail(f"optimum-habana/{name} does not support {path}: {e}")  # every port here has both
    assert diff <= TOL, f"optimum-habana/{name} {path}: cached decode differs from the uncached forward by {diff:.3g}"
    kv = session.kv()
    config = runner.model.config
    assert len(kv) == runner.family.layers(config)
    if path == "static":  # the port's own preallocated buffers, full length
        assert all(t.shape[-2] == PROMPT + STEPS + 3 or t.shape[-1] == PROMPT + STEPS + 3 for t in kv[0])


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


def test_ports_run_in_ci_where_optimum_habana_is_installed():
    """Under CI with optimum-habana installed nothing above may have been skipped for its absence."""
    if in_ci() and HAVE_OH:
        assert PORTS, "no family has a GaudiPort"
