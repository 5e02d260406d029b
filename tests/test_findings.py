"""The findings table and what it says a finding costs (`python -m mpt_kv findings`,
mpt_kv.findings.costs): the cost formula against hand-computed values (starcoder) and against
the bytes family-P3 measures on the tiny configs (transformers 4.55, where the views are real;
under 5.x with the <4.56 update put back); every real config builds offline; the README's block
is what the command prints; the command's exit codes.
"""

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.cli import findings
from mpt_kv.families import FAMILIES
from mpt_kv.findings import costs, raw
from mpt_kv.findings.raw import raw_entries, target_of
from mpt_kv.checks.family import CHECKS
from mpt_kv.checks.family_driver import BATCH, PROMPT
from mpt_kv.families.models import build
from mpt_kv.catalogue.family_catalogue import store_first_as_given

transformers = pytest.importorskip("transformers")
from packaging.version import Version  # noqa: E402

VIEW_FINDINGS = [e for e in raw_entries() if e.get("views") and target_of(e)[0] == "transformers"]
MEASURED = re.compile(r"its storage holds (\d+) bytes, the cached tensors in it (\d+): "
                      r"(\d+) bytes pinned beyond the cache")


def test_starcoder_by_hand():
    """bigcode/starcoder, MQA: n_embd 6144, n_head 48 (head_dim 128), one K/V head, 40 layers.
    c_attn's output per token: 6144 (q) + 128 (k) + 128 (v) = 6400 elements; K and V view
    128 + 128 of them, so 6144 elements (the whole query part) stay pinned: 6144 x 2 bytes (bf16)
    = 12288 bytes per token and layer; x 40 layers = 491520 per token; x 16 x 1024 tokens =
    8053063680 bytes (7.5 GiB). The cache itself: 2 (K, V) x 40 x 1 x 128 x 2 = 20480 bytes per
    token, 335544320 (320 MiB) for 16 x 1024: the pinned bytes are 24 times the cache."""
    real = costs.real_config("starcoder")
    family, config = FAMILIES["gpt_bigcode"], real.build()
    assert costs.fused_width(family, config) == 6400
    assert costs.viewed_width(family, config, ["key", "value"]) == 256
    assert costs.pinned_bytes_per_layer(family, config, ["key", "value"], 1, 1, torch.bfloat16) == 12288
    assert costs.pinned_bytes(family, config, ["key", "value"], 16, 1024, torch.bfloat16) == 8053063680
    assert costs.kv_bytes(family, config, 16, 1024, torch.bfloat16) == 335544320
    entry = next(e for e in VIEW_FINDINGS if target_of(e)[1:] == ("gpt_bigcode", "mqa"))
    cost = costs.finding_cost(entry, [(16, 1024), (1, None)], torch.bfloat16)
    assert cost.pinned == {(16, 1024): 8053063680, (1, None): 491520 * 8192}  # n_positions 8192


def test_fused_key_value_view():
    """GPT-BigCode's fused key_value layout (a port caching one (B, T, 2 x head_dim) tensor): the
    view covers K and V, so the same bytes stay pinned as with separate K and V views."""
    family, config = FAMILIES["gpt_bigcode"], costs.real_config("starcoder").build()
    assert costs.viewed_width(family, config, ["key_value"]) == costs.viewed_width(family, config, ["key", "value"])
    with pytest.raises(ValueError, match="views"):
        costs.viewed_width(family, config, ["query"])


def remote_code_marks(name: str) -> list:
    """A remote-code family's model is optimum-habana's own copy (baichuan): the ohabana env; one whose
    port cannot import off an HPU (`GaudiPort.needs_hpu`; none today: minicpm's FusedSDPA is the kernel
    stand-in's) has no model to build on CPU."""
    family = FAMILIES[name]
    if not family.remote_code:
        return []
    needs_hpu = family.gaudi.needs_hpu and importlib.util.find_spec("habana_frameworks") is None
    return [pytest.mark.optimum_habana] + ([pytest.mark.skip(reason=family.gaudi.needs_hpu)] if needs_hpu else [])


@pytest.mark.parametrize("name", [pytest.param(f, marks=remote_code_marks(f))
                                  for f in sorted(f for f in FAMILIES if FAMILIES[f].fused)])
def test_fused_width_is_the_fused_modules_output(name):
    """The formula's fused width is what the family's fused module outputs per token (the tiny
    config of each variant, transformers' own model)."""
    family = FAMILIES[name]
    for variant in family.variants:
        model, config = build(family, variant)
        widths = []
        hooks = [m.register_forward_hook(lambda mod, args, out: widths.append(out.shape[-1]))
                 for _, m in family.fused_modules(model)]
        with torch.inference_mode():
            model(input_ids=torch.ones(1, 3, dtype=torch.long), use_cache=False)
        for h in hooks:
            h.remove()
        assert widths and set(widths) == {costs.fused_width(family, config)}, (name, variant, widths)


def measured_pins(entry) -> list[tuple[int, int, int]]:
    """(storage bytes, cached bytes, pinned bytes) per storage, as family-P3's failure names them."""
    with pytest.raises(PropertyFailure) as info:
        CHECKS["family-P3"](*target_of(entry), entry.get("path", "concat"))
    return [tuple(map(int, m)) for m in MEASURED.findall(str(info.value))]


def assert_formula_gives(entry, measured):
    """The formula at the tiny config (batch BATCH, prompt PROMPT, fp32) gives every storage's
    bytes exactly, one storage per caching layer."""
    _, name, variant = target_of(entry)
    family = FAMILIES[name]
    config = family.config(variant)
    per_layer = costs.pinned_bytes_per_layer(family, config, entry["views"], BATCH, PROMPT, torch.float32)
    fused = costs.fused_width(family, config) * 4 * BATCH * PROMPT
    assert len(measured) == family.layers(config), measured
    assert all(held == fused and pinned == per_layer for held, _, pinned in measured), (per_layer, fused, measured)


@pytest.mark.skipif(Version(transformers.__version__) >= Version("4.56"),
                    reason="transformers >= 4.56 copies on the first update: nothing pins to measure")
@pytest.mark.parametrize("entry", VIEW_FINDINGS, ids=lambda e: "-".join(target_of(e)[1:]))
def test_formula_is_the_measured_pin(entry):
    """Under transformers 4.55 (the ohabana env) every view finding's failure names per storage
    the bytes the formula gives at the tiny config."""
    assert_formula_gives(entry, measured_pins(entry))


# DynamicLayer.update as in transformers <4.56: the first K/V stored as they come (views of the
# fused output where the model splits one), later ones concatenated (the catalogue's one copy)
views_update = store_first_as_given


@pytest.mark.skipif(not hasattr(getattr(pytest.importorskip("transformers.cache_utils"), "DynamicLayer", None),
                                "lazy_initialization"),
                    reason="the <4.56 update is put back into transformers 5.x's DynamicLayer")
@pytest.mark.parametrize("entry", VIEW_FINDINGS, ids=lambda e: "-".join(target_of(e)[1:]))
def test_formula_is_the_pin_with_the_bug_put_back(entry, monkeypatch):
    """Under 5.x with the <4.56 DynamicLayer.update put back, the same bytes."""
    from transformers.cache_utils import DynamicLayer

    monkeypatch.setattr(DynamicLayer, "update", views_update)
    assert_formula_gives(entry, measured_pins(entry))


@pytest.mark.parametrize("name", sorted(costs.real_configs()))
def test_real_config_builds_offline_with_its_fields(name):
    """Each real config builds without the hub, of its family's model_type, and the config object
    holds the file's values (a misspelt field would be silently kept as an extra attribute while the
    family reads a default: so every field is read back through the family's accessors too)."""
    real = costs.real_config(name)
    family, config = FAMILIES[real.family], real.build()
    assert config.model_type == family.model_type == real.model_type
    for key, value in real.fields.items():
        got = getattr(config, key)
        if isinstance(value, dict):
            assert all(getattr(got, k) == v for k, v in value.items()), (key, got, value)
        else:
            assert got == value, (key, got, value)
    heads = config.num_attention_heads
    assert family.kv_heads(config) <= heads and heads % family.kv_heads(config) == 0
    assert family.head_dim(config) * heads == config.hidden_size
    assert family.kv_bytes_per_token(config, torch.bfloat16) > 0


def test_a_real_config_of_another_variant_is_refused():
    """The MHA finding costed on starcoder (multi-query) would be wrong: an error naming the switch."""
    entry = dict(next(e for e in VIEW_FINDINGS if target_of(e)[1:] == ("gpt_bigcode", "mha")),
                 cost_config="starcoder")
    with pytest.raises(ValueError, match=r"multi_query=True \(variant mha: False\)"):
        costs.finding_cost(entry, [(16, 1024)], torch.bfloat16)
    with pytest.raises(ValueError, match="is a falcon config"):
        costs.finding_cost(dict(entry, cost_config="falcon-7b"), [(16, 1024)], torch.bfloat16)


def test_every_view_finding_says_what_views_and_where_it_costs():
    """A transformers family-P3 finding whose pattern is a view carries "views" and "cost_config"
    (else the table would show it without bytes, and the measurement tests above would not run)."""
    # a view of a fused projection's output; not a view of another buffer ("no fused projection's
    # output": a sliding window's slice of its own concatenation, DeepSeek 4.55's V split from
    # kv_b_proj's output), whose bytes no fused width gives
    p3 = [e for e in raw_entries() if e["property"] == "family-P3"
          and target_of(e)[0] == "transformers" and "view" in e["pattern"]
          and "no fused projection" not in e["pattern"]]
    assert p3 and all(e.get("views") and e.get("cost_config") for e in p3), p3
    assert len(VIEW_FINDINGS) >= len(p3)


def test_configs_lists_each_real_config_with_its_sizes(capsys):
    """starcoder: 20480 K/V bytes per token (above), c_attn's 6400 elements x 2 bytes per token and layer."""
    assert findings.main(["--configs"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("starcoder "))
    assert line.split()[1:5] == ["bigcode/starcoder", "gpt_bigcode", "20480", "12800"], line


def test_every_view_finding_has_a_cost():
    for entry in VIEW_FINDINGS:
        cost = costs.finding_cost(entry, findings.POINTS, torch.bfloat16)
        assert cost.pinned[findings.POINTS[0]] > 0, entry


def test_the_docs_block_is_the_commands_output():
    """docs/findings.md's block is what `python -m mpt_kv findings --markdown` prints: a stale
    table fails here (regenerate: python -m mpt_kv findings --update-docs)."""
    readme = findings.DOC.read_text(encoding="utf-8")
    start, end = findings.readme_block(readme)
    assert readme[start:end] == "\n" + findings.markdown(), f"stale: run {findings.COMMAND}"
    assert findings.COMMAND in readme


def test_an_implementation_crash_is_shown_without_bytes(tmp_path, monkeypatch, capsys):
    """An optimum-habana finding without views (a crash): its error, "-" and why no bytes."""
    crash = {"target": "optimum-habana/codegen/mha", "property": "family-P1",
             "when": {"optimum-habana": "<=1.21.2"}, "pattern": r"TypeError: can only concatenate tuple \(not Tensor\)",
             "upstream": "optimum/habana/transformers/models/codegen/modeling_codegen.py:NN", "reason": "..."}
    path = tmp_path / "known_failures.json"
    path.write_text(json.dumps(raw_entries()[:1] + [crash]))
    monkeypatch.setattr(raw, "FAMILY_FILE", path)
    assert findings.main([]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("codegen/mha"))
    assert "optimum-habana" in row and "`TypeError: can only concatenate tuple (not Tensor)`" in row
    assert "- (no cached view of a fused output: nothing pinned)" in row
    assert "mosaicml/mpt-7b" in out and "4.00 GiB" in out


def readme_with_block(tmp_path, content="stale\n"):
    path = tmp_path / "README.md"
    path.write_text(f"# x\n\nbefore\n{findings.BEGIN}\n{content}{findings.END}\nafter\n")
    return path


def test_update_readme_then_check(tmp_path, capsys):
    path = readme_with_block(tmp_path)
    assert findings.main(["--check", "--readme", str(path)]) == 1
    assert "stale" in capsys.readouterr().err
    assert findings.main(["--update-docs", "--doc", str(path)]) == 0
    text = path.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{findings.END}\nafter\n")
    assert "stale" not in text and "bigcode/starcoder" in text
    assert findings.main(["--check", "--readme", str(path)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--markdown", "--check"], "not allowed with argument"),
    (["--doc", "docs/findings.md"], "--doc is only read with --update-docs or --check"),
    (["--readme", "README.md"], "--doc is only read with --update-docs or --check"),
    (["--check", "--readme", "/nonexistent/README.md"], "No such file"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        findings.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_readme_without_the_block_is_refused_before_any_work(tmp_path, capsys):
    path = tmp_path / "README.md"
    path.write_text("# no block\n")
    with pytest.raises(SystemExit) as info:
        findings.main(["--update-readme", "--readme", str(path)])
    assert info.value.code == 2 and "needs exactly one" in capsys.readouterr().err
    assert path.read_text() == "# no block\n"


def test_the_cli_dispatches_findings():
    run = subprocess.run([sys.executable, "-m", "mpt_kv", "findings", "--bogus"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("mpt-kv findings: unrecognized arguments"), run.stderr
