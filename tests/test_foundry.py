"""llm-foundry's MPT as a target (mpt_kv/targets/foundry.py): the loader (its own files, no training stack),
its layouts read as what they are, the llm-foundry-only fields, bad input, and its standalone repros against
the installed release. Tests marked llm_foundry run where llm-foundry is installed (tox -e foundry); the
others everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mpt_kv import versions
from mpt_kv.findings.entries import parse_when
from mpt_kv.errors import InputError, TargetUnavailable
from mpt_kv.findings import repros, scripts
from mpt_kv.model.config import ModelConfig, random_state_dict
from plugin_testing import HANG_S

CFG = ModelConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=32)
FOUNDRY_REPROS = [r for r in repros.target_plan(repros.target_entries())[0] if r.slug.startswith("llm-foundry-")]


def build(**fields):
    from mpt_kv.targets import foundry

    factory = foundry.factory(**fields) if fields else foundry.build
    return factory(CFG, random_state_dict(CFG), torch.device("cpu"), torch.float32)


# --- everywhere -------------------------------------------------------------------------------------------

def test_without_llm_foundry_the_named_target_is_a_usage_error_naming_the_install_command(tmp_path):
    if versions.installed("llm-foundry"):
        pytest.skip("llm-foundry is installed here")
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance", "--target", "llm-foundry",
                          "--only-targets", "-p", "no:cacheprovider", "-q", "-k", "P0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "MPT_KV_HYPOTHESIS_PROFILE": "ci"})
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--target llm-foundry: llm-foundry is not installed (pip install --no-deps llm-foundry einops catalogue " \
           "tabulate" in run.stderr


def test_the_loader_says_what_is_missing_not_a_traceback():
    if versions.installed("llm-foundry"):
        pytest.skip("llm-foundry is installed here")
    from mpt_kv.targets import foundry

    with pytest.raises(TargetUnavailable, match=r"llm-foundry is not installed \(pip install --no-deps llm-foundry"):
        foundry.load()


def test_every_llm_foundry_entry_names_a_kept_repro_and_a_measured_range():
    entries = [e for e in repros.target_entries() if e["target"] == "llm-foundry"]
    assert entries and {e["repro"] for e in entries} == {r.slug for r in FOUNDRY_REPROS}
    for e in entries:
        assert "llm-foundry" in e["when"] and "transformers" in e["when"], e
        assert "llmfoundry/" in e["reason"] or "transformers 4.51" in e["reason"], e  # the upstream file and line


def fake_release(root, modeling: str):
    """A folder holding an llm-foundry "release" (its distribution metadata and an MPT modeling file)."""
    info = root / "llm_foundry-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-foundry\nVersion: 0.0.1\n")
    mpt = root / "llmfoundry" / "models" / "mpt"
    mpt.mkdir(parents=True)
    (root / "llmfoundry" / "__init__.py").write_text("raise ImportError('the package __init__ must never run')\n")
    (mpt / "configuration_mpt.py").write_text("class MPTConfig:\n    pass\n")
    (mpt / "modeling_mpt.py").write_text(modeling)
    return root


@pytest.fixture
def broken_release(tmp_path):
    if versions.installed("llm-foundry"):
        pytest.skip("llm-foundry is installed here: the fake release would not be the one found")
    return fake_release(tmp_path / "site", "import math\nfrom composer.models import HuggingFaceModel\n"
                                           "import no_such_module_of_the_release\n")


def test_a_release_whose_files_do_not_load_names_the_file_and_the_import(broken_release):
    code = ("from mpt_kv.targets import foundry\n"
            "try:\n    foundry.load()\nexcept foundry.TargetUnavailable as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "PYTHONPATH": str(broken_release)})
    assert "llm-foundry 0.0.1: llmfoundry.models.mpt.modeling_mpt does not load: llmfoundry/models/mpt/modeling_mpt.py:3 " \
           "(import no_such_module_of_the_release) raised ModuleNotFoundError" in run.stdout, run.stdout + run.stderr


def test_a_gating_run_fails_where_the_installed_llm_foundry_does_not_load(broken_release, tmp_path):
    """Fail closed: named with --target, a release that does not load is an error of every case, never a skip."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance", "--target", "llm-foundry",
                          "--only-targets", "-p", "no:cacheprovider", "-q", "-k", "P0 and fp32", "--device", "cpu"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
                         env={**os.environ, "PYTHONPATH": str(broken_release), "MPT_KV_HYPOTHESIS_PROFILE": "ci"})
    assert run.returncode == 1, run.stdout[-3000:]
    assert "target llm-foundry cannot be built here (named with --target: an error, not a skip)" in run.stdout
    assert "no_such_module_of_the_release" in run.stdout and " passed" not in run.stdout.splitlines()[-1]


# --- where llm-foundry is installed (tox -e foundry) ---------------------------------------------------------

@pytest.mark.llm_foundry
def test_the_model_is_llm_foundrys_own_class_with_generate_as_from_pretrained_gives_it():
    runner = build()
    cls = type(runner.model)
    assert cls.__name__ == "MPTForCausalLM" and cls.__module__ == "llmfoundry.models.mpt.modeling_mpt"
    assert hasattr(runner.model, "generate") and hasattr(runner.model, "_reorder_cache")
    assert not getattr(cls, "__mpt_kv_standin__", False)
    # the training stack's stand-in is gone once the files are imported: nothing can pick it up later
    assert "composer" not in sys.modules or not getattr(sys.modules["composer"], "__mpt_kv_standin__", False)


@pytest.mark.llm_foundry
def test_the_stand_in_raises_if_the_model_code_uses_it():
    from mpt_kv.targets import foundry

    modeling, _ = foundry.load()
    if not getattr(modeling.HuggingFaceModel, "__mpt_kv_standin__", False):
        pytest.skip("composer is installed here: the real one is used")
    with pytest.raises(foundry.StandInError, match="stand-in for llm-foundry's training stack"):
        modeling.HuggingFaceModel()
    with pytest.raises(foundry.StandInError):
        modeling.dist.get_local_rank()


@pytest.mark.llm_foundry
def test_its_logits_equal_the_oracles_and_transformers_mpt_with_the_same_weights():
    from mpt_kv.model.reference import ReferenceMPT

    runner = build()
    ids = torch.randint(0, CFG.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = ReferenceMPT(CFG).load_hf_state_dict(random_state_dict(CFG)).eval()
    with torch.no_grad():
        got, want = runner.logits(ids, mask), ref(ids, mask)
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-5)


@pytest.mark.llm_foundry
def test_the_transposed_key_is_read_as_stored():
    """kv() hands the checks (B, H, T, hd) views of the stored (b, h, d, s) key: the same storage, so P3 and
    the memory checks see the stored bytes and P2's poison would land in the cache itself."""
    runner = build()
    session = runner.session("concat", 12)
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.inference_mode():
        session.prefill(ids, torch.ones_like(ids))
        session.decode(torch.ones(2, 1, dtype=torch.long))
    stored_k, stored_v = session.past[0]
    assert stored_k.shape == (2, 4, 8, 6) and stored_v.shape == (2, 4, 6, 8)  # (b, h, d, s) and (b, h, s, d)
    k, v = session.kv()[0]
    assert k.shape == (2, 4, 6, 8) and k.untyped_storage().data_ptr() == stored_k.untyped_storage().data_ptr()
    assert torch.equal(k, stored_k.transpose(2, 3)) and v is stored_v


@pytest.mark.llm_foundry
def test_a_k_token_call_goes_through_its_own_prepare_inputs_for_generation():
    """As assisted decoding's verification call: the candidates through the model's own
    prepare_inputs_for_generation, which keeps only the last token: the forward raises (the finding)."""
    runner = build()
    session = runner.session("concat", 12)
    ids = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.inference_mode():
        session.prefill(ids, torch.ones_like(ids))
        with pytest.raises(RuntimeError, match=r"is invalid for input of size|attn_bias"):
            session.extend(torch.ones(2, 3, dtype=torch.long))


@pytest.mark.llm_foundry
@pytest.mark.parametrize("fields", [{"fused_qkv": False}, {"kv_n_heads": 4}, {"softmax_scale": 1 / 8 ** 0.5},
                                    {"sliding_window_size": 32}, {"attn_type": "grouped_query_attention"}])
def test_a_field_the_oracle_follows_gives_the_oracles_logits(fields):
    from mpt_kv.model.reference import ReferenceMPT

    runner = build(**fields)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    ref = ReferenceMPT(CFG).load_hf_state_dict(random_state_dict(CFG)).eval()
    with torch.no_grad():
        assert torch.allclose(runner.logits(ids, mask), ref(ids, mask), atol=1e-5)


@pytest.mark.llm_foundry
@pytest.mark.parametrize("field, value", [("qk_ln", True), ("kv_n_heads", 2), ("softmax_scale", 0.5),
                                          ("sliding_window_size", 4), ("attn_logit_softcapping", 30.0),
                                          ("rope", True), ("no_such_field", 1)])
def test_a_field_the_oracle_cannot_follow_is_refused_naming_it(field, value):
    with pytest.raises(InputError, match=rf"llm-foundry field {field}={value!r}"):
        build(**{field: value})


@pytest.mark.llm_foundry
def test_flash_is_declared_unsupported_on_every_device_where_flash_attn_does_not_import():
    from mpt_kv.targets import foundry

    if foundry.flash_unavailable() is None:
        pytest.skip("flash_attn imports here")
    runner = foundry.build_flash(CFG, random_state_dict(CFG), torch.device("cpu"), torch.float32)
    assert set(runner.capabilities.unsupported) == {"cpu", "cuda", "hpu"}
    assert all("flash_attn does not import" in r for r in runner.capabilities.unsupported.values())


@pytest.mark.llm_foundry
def test_a_transformers_outside_the_releases_pin_is_refused(monkeypatch):
    from mpt_kv.targets import foundry

    monkeypatch.setattr(foundry.versions, "transformers_version", lambda: "4.55.4")
    with pytest.raises(TargetUnavailable, match=r"requires transformers .*but transformers 4.55.4 is installed"):
        foundry.check_transformers()


@pytest.mark.llm_foundry
def test_its_repros_exit_1_where_their_finding_holds(tmp_path):
    """Each kept llm-foundry script, run against the installed release alone (no mpt_kv on its path)."""
    repros.write(tmp_path, [])
    paths = [str(tmp_path / r.slug / "repro.py") for r in FOUNDRY_REPROS]
    run = subprocess.run([sys.executable, "-I", "-c", scripts.DRIVER, "", *paths], capture_output=True, text=True,
                         cwd=tmp_path, timeout=HANG_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["mpt_kv_modules"] == []
    for r in FOUNDRY_REPROS:
        result = report["results"][str(tmp_path / r.slug / "repro.py")]
        holds = any(versions.versions_match(parse_when(e["when"], ValueError)) for e in r.entries)
        assert result["code"] == (1 if holds else 0), f"{r.slug}: {result['output'][-2000:]}"


@pytest.mark.llm_foundry
@pytest.mark.parametrize("fields", [{"fused_qkv": False}, {"kv_n_heads": "n_heads"},
                                    {"sliding_window_size": "max_seq_len"}])
def test_p1_holds_on_the_fields_the_oracle_follows(fields):
    """The drawn P1 cases (hypothesis, the ci profile here) on llm-foundry's own code paths for these fields:
    separate Wq/Wk/Wv, the grouped-query class with as many K/V heads, the sliding-window branch."""
    import mpt_kv
    from mpt_kv.targets import foundry

    per_case = {"n_heads": lambda cfg: cfg.n_heads, "max_seq_len": lambda cfg: cfg.max_seq_len}

    def build(cfg, state_dict, device, dtype):  # a value that depends on the drawn config: read from it per case
        values = {k: per_case[v](cfg) if isinstance(v, str) else v for k, v in fields.items()}
        return foundry.factory(**values)(cfg, state_dict, device, dtype)
    mpt_kv.CHECKS["P1/concat"](build, "cpu", "fp32")


@pytest.mark.llm_foundry
def test_p3_reads_the_unfused_projections_as_their_own_storage():
    """With fused_qkv off there is no fused buffer to pin: the cached key is all of Wk's output, and P3
    passes; with it on (mpt-7b's), P3 names the views of mixed_qkv (the known failure)."""
    import mpt_kv
    from mpt_kv.errors import PropertyFailure
    from mpt_kv.targets import foundry

    mpt_kv.CHECKS["P3/concat"](foundry.factory(fused_qkv=False), "cpu", "fp32")
    with pytest.raises(PropertyFailure, match=r"are views of layer \d+'s mixed_qkv"):
        mpt_kv.CHECKS["P3/concat"](foundry.build, "cpu", "fp32")
