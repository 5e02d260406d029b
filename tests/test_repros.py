"""`python -m mpt_kv findings --repro DIR` (mpt_kv/findings/repros.py): every generated standalone
script, run in this environment, exits 1 where its finding's `when` holds for the installed
versions and 0 where it does not; any other status fails with the script's output.

All scripts of a run share ONE Python process (a driver that `runpy`s each one and catches its
SystemExit): a Python start and `import torch` per script would cost seconds each on a 2-core CI.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from mpt_kv.findings.entries import parse_when, raw_entries, target_of
from mpt_kv.cli import findings
from mpt_kv.findings import port_repros, repros, scripts
from mpt_kv.targets.hf import static_path_missing
from mpt_kv.versions import installed, versions_match
from plugin_testing import HANG_S

GROUPS = findings.grouped(raw_entries())
KEPT, TARGETS_MISSING, SHARED = repros.target_plan(repros.target_entries())
PLANNED = [(repros.slug_of(entries), entries) for entries in GROUPS if repros.slug_of(entries)]
PLANNED += [(r.slug, list(r.entries)) for r in KEPT]  # the MPT targets' kept scripts

# The findings that have a standalone repro: this set may grow, never silently shrink.
WITH_REPROS = {
    "transformers-mpt-alibi-kv-views", "transformers-falcon-alibi-kv-views", "transformers-gpt-bigcode-mqa-kv-views",
    "transformers-gpt-bigcode-mha-kv-views", "transformers-bloom-alibi-kv-views", "transformers-gpt2-mha-kv-views",
    "transformers-gpt-neox-mha-kv-views", "transformers-codegen-mha-kv-views", "transformers-persimmon-mha-kv-views",
    "transformers-phi3-gqa-kv-views", "transformers-dbrx-gqa-kv-views",
    # the sdpa cells' finding (transformers[sdpa]/falcon/alibi): the eager oracle's double ALiBi
    "transformers-sdpa-falcon-alibi-eager-attention-alibi-twice",
    # the generate drive's own findings (kept scripts: generate's half of the cache)
    "transformers-falcon-alibi-static-generate-4d-mask", "transformers-mpt-prompt-lookup-static-cache-overrun",
    "optimum-habana-mpt-static-draft-assistant-mask-mismatch", "optimum-habana-mpt-static-beam-reads-model-config-eos",
    "optimum-habana-mpt-static-contrastive-mask-overrun",
    # transformers_call.py.tmpl: a prefill shows them
    # the zoo's windows, hybrids and latents (transformers_call.py.tmpl too: a prefill and decode steps)
    *(f"transformers-{f}-{s}" for f in ("gemma2-hybrid-window4", "gemma3-hybrid-window9", "gpt-oss-hybrid-window7",
                                 "mistral-gqa")
      for s in ("window-slice-pins-evicted", "local-layers-cache-whole-history")),
    "transformers-gpt-neo-global-local4-local-layers-cache-whole-history",
    "transformers-gpt-neo-global-local4-static-local-layers-full-length",
    *(f"transformers-gpt-neo-global-local4-static-cache-mask-from-key-length-{s}" for s in ("p1", "p2", "ops")),
    *(f"transformers-{f}-mla-{s}" for f in ("deepseek-v2", "deepseek-v3")
      for s in ("value-view-of-kv-b-proj", "caches-expanded-kv-not-latent", "static-cache-prefill-index-copy")),
    "transformers-falcon-new-arch-gqa-kv-cache-all-heads", "transformers-falcon-rotary-mqa-static-cache-prefill-index-copy",
    "optimum-habana-codegen-mha-forward-typeerror", "optimum-habana-phi-gqa-forward-size-mismatch",
    "optimum-habana-llama-fused-qkv-forward-nonetype-weight", "optimum-habana-mistral-gqa-forward-rope-size-mismatch",
    "optimum-habana-starcoder2-gqa-forward-keyerror-input-shape",
    "optimum-habana-cohere-gqa-qk-norm-forward-unexpected-output-attentions", "optimum-habana-xglm-mha-forward-no-attribute-shape",
    "optimum-habana-gpt-neo-global-local4-beam-reorder-no-reorder-cache",
    # family-ops' assisted program on the ports (a 3-token call right after the prefill): found when its beam
    # program's crash stopped hiding it
    *(f"optimum-habana-{name}-assisted-extend-{error}" for name, error in (
        ("baichuan-alibi-concat", "causal-mask-expand"), ("bloom-alibi-concat", "causal-mask-expand"),
        ("chatglm-mq-groups2-concat", "causal-mask-expand"), ("chatglm-mq-groups2-static-reuse", "causal-mask-expand"),
        ("decilm-kv-heads-4-2-1-concat", "causal-mask-expand"), ("deepseek-v3-mla-concat", "causal-mask-expand"),
        ("falcon-new-arch-gqa-concat", "causal-mask-expand"), ("falcon-new-arch-gqa-static", "size-mismatch"),
        ("falcon-rotary-mqa-concat", "causal-mask-expand"), ("falcon-rotary-mqa-static", "size-mismatch"),
        ("gemma3-hybrid-window9-concat", "causal-mask-expand"), ("gpt-bigcode-mha-static", "index-out-of-bounds"),
        ("gpt-bigcode-mqa-static", "index-add"), ("gpt-neo-global-local4-concat", "causal-mask-expand"),
        ("gpt2-mha-static", "index-copy"), ("gptj-mha-static", "index-copy"), ("mixtral-moe-2of4-concat", "size-mismatch"),
        ("mixtral-moe-2of4-static", "size-mismatch"), ("mpt-alibi-concat", "causal-mask-expand"),
        ("mpt-alibi-static", "size-mismatch"), ("opt-mha-concat", "attention-mask-length"),
        ("opt-mha-static", "causal-mask-expand"), ("persimmon-mha-static", "size-mismatch"),
        ("phi-mha-concat", "causal-mask-expand"), ("stablelm-gqa-static", "size-mismatch"))),
    # the zoo's ports (port_program.py.tmpl): the k-token extend, decode and reuse_cache crashes
    "optimum-habana-qwen3-gqa-concat-extend-causal-mask-expand",
    "optimum-habana-gemma-gqa-concat-then-static-extend-causal-mask-expand",
    "optimum-habana-gemma-gqa-static-reuse-decode-past-size-has-no-shape",
    "optimum-habana-gemma2-hybrid-window4-static-reuse-prefill-no-num-key-value-heads",
    "optimum-habana-gemma3-hybrid-window9-static-reuse-prefill-no-num-key-value-heads",
    "optimum-habana-gemma3-hybrid-window9-static-extend-causal-mask-expand",
    "optimum-habana-gemma3-hybrid-window9-static-beam-reorder-no-reorder-cache",
    "optimum-habana-gpt-neo-global-local4-concat-extend-causal-mask-expand",
    "optimum-habana-opt-mha-concat-decode-attention-mask-length",
    "optimum-habana-gemma2-hybrid-window4-concat-decode-size-mismatch",
    "optimum-habana-gemma3-hybrid-window9-concat-decode-size-mismatch",
    "optimum-habana-mpt-alibi-beam-reorder-no-reorder-cache", "optimum-habana-bloom-alibi-beam-reorder-no-reorder-cache",
    "optimum-habana-gpt2-mha-beam-reorder-no-reorder-cache", "optimum-habana-phi-mha-beam-reorder-no-reorder-cache",
    "optimum-habana-falcon-rotary-mqa-beam-reorder-no-reorder-cache",
    "optimum-habana-gpt-bigcode-mqa-beam-reorder-no-reorder-cache",
    "optimum-habana-gpt-bigcode-mha-beam-reorder-no-reorder-cache",
    "optimum-habana-gptj-mha-beam-reorder-no-reorder-cache",
    # the generate drive on the ports: the reorder its direct-drive beam program never reaches (an earlier failure)
    "optimum-habana-gemma3-hybrid-window9-beam-reorder-no-reorder-cache",
    "optimum-habana-gpt-oss-hybrid-window7-beam-reorder-no-reorder-cache",
    "optimum-habana-opt-mha-beam-reorder-no-reorder-cache",
    # the program template (port_program.py.tmpl): the k-token extend, static-path and reuse_cache crashes
    "optimum-habana-bloom-alibi-concat-extend-causal-mask-expand",
    "optimum-habana-bloom-alibi-concat-then-static-extend-mask-or-index-error",
    "optimum-habana-falcon-alibi-concat-then-static-extend-causal-mask-expand",
    "optimum-habana-falcon-alibi-concat-then-static-reuse-prefill-broadcast-family-p2",
    "optimum-habana-falcon-alibi-static-reuse-prefill-broadcast",
    "optimum-habana-falcon-new-arch-gqa-concat-decode-view-shape",
    "optimum-habana-falcon-new-arch-gqa-concat-then-static-reuse-prefill-size-mismatch-family-p2",
    "optimum-habana-falcon-new-arch-gqa-static-reuse-prefill-size-mismatch",
    "optimum-habana-falcon-rotary-mqa-concat-extend-causal-mask-expand",
    "optimum-habana-falcon-rotary-mqa-static-extend-size-mismatch",
    "optimum-habana-falcon-rotary-mqa-static-reuse-beam-reorder-no-reorder-kv-cache",
    "optimum-habana-gpt-bigcode-mha-static-decode-index-out-of-bounds",
    "optimum-habana-gpt-bigcode-mqa-static-extend-index-add",
    "optimum-habana-gpt-neox-mha-concat-extend-causal-mask-expand",
    "optimum-habana-gpt-neox-mha-concat-then-static-extend-mask-or-index-error",
    "optimum-habana-gpt2-mha-concat-then-static-extend-mask-or-index-error",
    "optimum-habana-gpt2-mha-static-extend-index-copy", "optimum-habana-gptj-mha-static-extend-index-copy",
    "optimum-habana-gptj-mha-static-reuse-extend-size-mismatch",
    "optimum-habana-llama-gqa-concat-extend-causal-mask-expand",
    "optimum-habana-llama-mha-concat-extend-causal-mask-expand",
    "optimum-habana-llama-mqa-concat-extend-causal-mask-expand",
    "optimum-habana-mpt-alibi-concat-extend-causal-mask-expand",
    "optimum-habana-mpt-alibi-concat-then-static-extend-mask-or-index-error",
    "optimum-habana-mpt-alibi-static-extend-size-mismatch",
    "optimum-habana-persimmon-mha-concat-prefill-decode-no-get-usable-length",
    "optimum-habana-persimmon-mha-static-beam-reorder-no-reorder-cache",
    "optimum-habana-persimmon-mha-static-extend-size-mismatch",
    "optimum-habana-phi-mha-concat-extend-causal-mask-expand",
    "optimum-habana-phi-mha-concat-then-static-extend-mask-or-index-error",
    "optimum-habana-phi-mha-static-reuse-beam-reorder-no-reorder-kv-cache",
    "optimum-habana-qwen2-gqa-concat-extend-causal-mask-expand",
    "optimum-habana-stablelm-gqa-concat-prefill-decode-no-get-usable-length",
    "optimum-habana-stablelm-gqa-static-beam-reorder-no-reorder-cache",
    "optimum-habana-stablelm-gqa-static-extend-size-mismatch",
    "optimum-habana-starcoder2-gqa-static-reuse-prefill-no-num-key-value-heads",
    # the same template, observing what a call leaves: the port's cache views, its logits vs eager
    "optimum-habana-falcon-alibi-concat-prefill-kv-views", "optimum-habana-falcon-alibi-concat-prefill-storage-bytes",
    "optimum-habana-persimmon-mha-static-prefill-kv-views", "optimum-habana-falcon-alibi-prefill-logits-vs-eager",
    "optimum-habana-falcon-alibi-concat-prefill-logits-vs-eager-then-extend-crash",
    "optimum-habana-falcon-alibi-static-prefill-logits-vs-eager-then-extend-crash",
    # the zoo's ports' wrong logits: each call's logits against transformers' uncached forward over the
    # same tokens (family-P0, P1, ops), or the static path's against the concat path's (family-P2)
    *(f"optimum-habana-{f}-{s}" for f in ("gemma-gqa", "gemma2-hybrid-window4")
      for s in ("uncached-logits-vs-transformers", "concat-prefill-logits-vs-uncached",
                "concat-prefill-logits-vs-uncached-family-ops")),
    *(f"optimum-habana-{f}-static-decode-logits-vs-uncached{s}" for f in ("gpt-neo-global-local4", "opt-mha")
      for s in ("", "-family-ops")),
    "optimum-habana-gpt-neo-global-local4-static-decode-logits-vs-concat",
    # decilm and chatglm (remote code, as baichuan): the k-token extend, the beam reorder (chatglm's on its
    # multi-query groups: mpt-kv's batch of 3 indexes past them)
    *(f"optimum-habana-{s}" for s in ("decilm-kv-heads-4-2-1-concat-extend-causal-mask-expand",
                                      "decilm-kv-heads-4-2-1-concat-beam-reorder-no-reorder-cache",
                                      "chatglm-mq-groups2-concat-extend-causal-mask-expand",
                                      "chatglm-mq-groups2-concat-beam-reorder-index-out-of-bounds",
                                      "chatglm-mq-groups2-static-reuse-decode-dtype-mismatch")),
    # the ports' local layers cache more than their window (family-memory: the window's analytic bytes)
    *(f"optimum-habana-{f}-static-prefill-local-layers-beyond-window" for f in ("gemma2-hybrid-window4",
                                                                             "gemma3-hybrid-window9")),
    "optimum-habana-gpt-neo-global-local4-concat-prefill-local-layers-beyond-window",
    # baichuan (remote code: the port's own model and config class): the seed bug's views of W_pack, the
    # k-token extend, and the beam reorder on the heads' dimension (the next step's crash)
    *(f"optimum-habana-baichuan-alibi-{s}" for s in ("concat-prefill-kv-views", "concat-extend-causal-mask-expand",
                                                     "concat-beam-decode-cat-size-mismatch",
                                                     "static-beam-decode-index-copy-slice-shapes")),
    # the recipes' findings (mpt_kv/recipes.py): the same template on the base path with the recipe's flags
    # (--use_flash_attention through the kernel stand-in's FusedSDPA, shipped with the script), named by the recipe
    "optimum-habana-llama-gqa-concat-then-static-prefill-trim-logits-index-error-reuse-trim-softmax",
    "optimum-habana-qwen2-gqa-concat-then-static-reuse-prefill-trim-logits-index-error-beam-flash",
    "optimum-habana-falcon-new-arch-gqa-static-reuse-extend-size-mismatch-flash-reuse",
    "optimum-habana-falcon-new-arch-gqa-concat-then-static-reuse-extend-causal-mask-expand-flash-reuse",
    "optimum-habana-falcon-new-arch-gqa-static-reuse-beam-reorder-no-reorder-kv-cache-flash-reuse",
    "optimum-habana-starcoder2-gqa-concat-then-static-extend-causal-mask-expand-starcoder2",
    *(f"optimum-habana-{f}-static-prefill-logits-vs-uncached{s}-{recipe}"
      for f, recipe in (("starcoder2-gqa", "starcoder2"), ("gemma3-hybrid-window9", "gemma")) for s in ("", "-family-ops")),
    # the MPT targets' findings (mpt_kv/findings/known_failures.json), scripts kept in mpt_kv/findings/sources/kept/
    "transformers-mpt-alibi-bias-max-ignored", "transformers-mpt-crop-keeps-cropped-positions",
    "transformers-mpt-static-decode-host-sync", "transformers-mpt-static-decode-breaks-compile",
    "transformers-mpt-static-reorder-moves-buffers",
    "transformers-mpt-static-cache-cannot-crop", "transformers-mpt-beam-reorder-copies-whole-cache",
    "optimum-habana-mpt-alibi-bias-max-ignored", "optimum-habana-mpt-bucket-decode-reads-unwritten-slots",
    "optimum-habana-mpt-prefill-kv-views-of-mixed-qkv", "optimum-habana-mpt-crop-keeps-cropped-positions",
    "optimum-habana-mpt-beam-reorder-copies-whole-cache", "optimum-habana-mpt-static-reorder-moves-buffers",
    # llm-foundry's MPT (run where llm-foundry is installed: tox -e foundry, tests/test_foundry.py too)
    "llm-foundry-mpt-prefill-kv-views-of-mixed-qkv", "llm-foundry-mpt-assisted-extend-feeds-last-token",
    "llm-foundry-mpt-crop-slices-key-head-dim", "llm-foundry-mpt-beam-reorder-copies-whole-cache",
    # the ports run through the kernel stand-in (their scripts ship it): the zoo's MoE, gpt_oss and minicpm
    "optimum-habana-mixtral-moe-2of4-beam-reorder-no-reorder-cache",
    "optimum-habana-mixtral-moe-2of4-concat-extend-size-mismatch",
    "optimum-habana-mixtral-moe-2of4-static-extend-size-mismatch",
    "optimum-habana-mixtral-moe-2of4-static-reuse-beam-reorder-no-reorder-kv-cache",
    "optimum-habana-qwen2-moe-moe-2of4-static-extend-causal-mask-expand",
    "optimum-habana-qwen3-moe-moe-2of4-static-extend-causal-mask-expand",
    "optimum-habana-deepseek-v2-mla-uncached-logits-vs-transformers",
    "optimum-habana-deepseek-v2-mla-concat-prefill-logits-vs-uncached",
    "optimum-habana-deepseek-v2-mla-concat-prefill-logits-vs-uncached-family-ops",
    "optimum-habana-deepseek-v2-mla-concat-then-static-extend-causal-mask-expand",
    "optimum-habana-deepseek-v3-mla-beam-reorder-no-reorder-cache",
    "optimum-habana-deepseek-v3-mla-concat-extend-causal-mask-expand",
    "optimum-habana-gpt-oss-hybrid-window7-concat-decode-size-mismatch",
    "optimum-habana-gpt-oss-hybrid-window7-concat-prefill-logits-vs-uncached-family-ops",
    "optimum-habana-gpt-oss-hybrid-window7-static-decode-logits-vs-uncached",
    "optimum-habana-gpt-oss-hybrid-window7-static-prefill-local-layers-beyond-window",
    "optimum-habana-minicpm-mla-concat-prefill-value-view-of-kv-b-proj",
    "optimum-habana-minicpm-mla-static-extend-size-mismatch",
}

def is_optimum_habana(entries) -> bool:
    return target_of(entries[0])[0] == "optimum-habana"


def is_llm_foundry(entries) -> bool:
    return target_of(entries[0])[0] == "llm-foundry"


def marks(entries) -> list:
    return [pytest.mark.optimum_habana] if is_optimum_habana(entries) else \
        [pytest.mark.llm_foundry] if is_llm_foundry(entries) else []


def expected_status(entries) -> int:
    """1 where the finding's `when` holds for the installed versions (one of its entries', for an
    MPT target finding several checks see in different ranges), else 0; 2 ("cannot run") for an
    MPT target finding of transformers' static path where its MPT has none (mpt-kv's own target
    declares that path unsupported there: the finding cannot apply, and no 0 may say "fixed")."""
    if all(e.get("target") == "transformers" and e.get("path") == "static" for e in entries) and \
            static_path_missing(installed("transformers")):
        return 2
    return 1 if any(versions_match(parse_when(e.get("when", {}), ValueError)) for e in entries) else 0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    directory = tmp_path_factory.mktemp("repros")
    made, missing = repros.write(directory, GROUPS)
    return directory, made, missing


@pytest.fixture(scope="module")
def driven(written):
    """Every runnable script of this environment, in one subprocess. transformers' scripts run
    first: optimum-habana's ones patch transformers' classes in place, as its
    adapt_transformers_to_gaudi does."""
    directory, made, _ = written
    runnable = [r for r in made if (not is_optimum_habana(r.entries) or installed("optimum-habana"))
                and (not is_llm_foundry(r.entries) or installed("llm-foundry"))]
    runnable.sort(key=lambda r: is_optimum_habana(r.entries))
    paths = [str(directory / r.slug / "repro.py") for r in runnable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-I", "-c", scripts.DRIVER, "", *paths], capture_output=True, text=True,
                         cwd=directory, env=env, timeout=HANG_S)
    assert run.returncode == 0, f"the driver failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    report = json.loads(run.stdout.splitlines()[-1])
    return {path.split(os.sep)[-2]: result for path, result in report["results"].items()}, report["mpt_kv_modules"]


@pytest.mark.parametrize("slug, entries", [
    pytest.param(s, e, id=s, marks=marks(e))
    for s, e in PLANNED])
def test_a_repro_exits_1_where_its_finding_holds_else_0(driven, slug, entries):
    results, _ = driven
    code, output = results[slug]["code"], results[slug]["output"]
    expected = expected_status(entries)
    if expected == 2:  # it must say why it cannot run: MPT's missing static path, not another error
        assert "cannot run a StaticCache" in output, f"{slug}: exit {code} without naming the missing static path:\n{output}"
    assert code == expected, (f"{slug}: exit status {code}, expected {expected} (when {entries[0]['when']}); "
                              f"its output:\n{output}")


def test_every_mpt_target_finding_names_a_repro_that_exists(written):
    """Each entry of mpt_kv/findings/known_failures.json names its repro: a kept script, or the
    folder of a family finding that is the same bug."""
    directory, _, _ = written
    assert TARGETS_MISSING == [], "entries without a repro: " + "; ".join(repros.describe([e]) for e in TARGETS_MISSING)
    for slug in SHARED:
        assert (directory / slug / "repro.py").is_file(), f"{slug}: named by {SHARED[slug]} but no repro has that folder"


def test_the_findings_with_a_repro_are_these():
    slugs = [slug for slug, _ in PLANNED]
    assert len(slugs) == len(set(slugs)), "two findings share a repro folder"
    assert set(slugs) == WITH_REPROS


@pytest.mark.optimum_habana
@pytest.mark.parametrize("family", sorted(port_repros.PORT_PATCHES))
def test_the_replayed_patches_are_the_installed_releases_lines(family):
    """The scripts replay adapt_transformers_to_gaudi's lines for the family, kept as data: they
    must be the installed release's own (read by mpt-kv's loader)."""
    from mpt_kv.families import FAMILIES
    from mpt_kv.families.gaudi import load_port_module, port_patches

    port = FAMILIES[family]
    lines = [(p.name, p.attribute, p.value) for p in port_patches(port, load_port_module(port))]
    assert lines == port_repros.PORT_PATCHES[family]


def test_no_repro_imports_mpt_kv(written, driven):
    directory, made, _ = written
    for r in made:
        tree = ast.parse((directory / r.slug / "repro.py").read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] == "mpt_kv"], f"{r.slug} imports {names}"
    _, imported = driven
    assert imported == [], f"running the repros imported {imported}"


def test_every_repro_compiles_without_a_warning(written):
    """A script a maintainer runs must not warn (an invalid escape in its docstring did)."""
    import warnings

    directory, made, _ = written
    for r in made:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile((directory / r.slug / "repro.py").read_text(), r.slug, "exec")


def test_the_index_lists_every_finding_without_a_repro(written):
    directory, made, missing = written
    # a family finding whose entries name a kept script ("repro": the generate drive's) is that script's
    kept = sum(1 for entries in GROUPS if "repro" in entries[0])
    assert len(made) + len(missing) == len(GROUPS) - kept + len(KEPT) + len(TARGETS_MISSING)
    index = (directory / "README.md").read_text()
    assert index.count("no standalone repro yet: ") == len(missing)
    for r in made:
        assert f"({r.slug}/README.md)" in index and (directory / r.slug / "README.md").is_file()


def test_repro_on_a_file_exits_2_before_any_work(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(SystemExit) as info:
        findings.main(["--repro", str(path)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == f"mpt-kv findings: --repro: {path} exists and is not a folder"
