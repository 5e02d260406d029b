"""optimum-habana's text-generation recipes as cells of the ports (`mpt_kv/recipes.py`, the recipe part of
`mpt_kv/families/gaudi.py`): the data, what each flag turns into in a port's session (the flash branch
through the kernel stand-in, bucket_internal's padding and cache_idx, trim_logits), and the recipe rows of
the catalogues: a variant placed only in the flash branch, only under bucket_internal and only on the
reuse_cache path, each killed by the recipe's cells and passed by the paths that never take its branch, and a
flash design that passes (docs/catalogues.md, "Recipe rows": tests in the ohabana env, on the port's own code
with one line changed, as tests/test_zoo.py's port-side pairs)."""

import contextlib
import importlib.util
import inspect
import re
import textwrap
import types

import pytest
import torch

from mpt_kv import recipes
from mpt_kv.checks import index
from mpt_kv.checks.compare import PropertyFailure
from mpt_kv.checks.registry import CHECKS
from mpt_kv.errors import InputError, KnownFailure, TargetUnavailable
from mpt_kv.families import FAMILIES
from mpt_kv.families.implementations import family_targets

# --- the data (every env) --------------------------------------------------------------------------------


def test_every_recipe_names_its_flags_its_sources_and_a_registry_family_variant():
    for recipe in recipes.RECIPES.values():
        assert recipe.flags, recipe.name
        assert all(re.search(r":\d+", source) for source in recipe.sources[:1]) or recipe.name == "seed", recipe.name
        for name in recipe.families:
            family, variant = name.split("/")
            assert variant in FAMILIES[family].variants, name
        assert recipe.path.split(recipes.SEPARATOR) == [recipe.base_path, recipe.name]
        assert recipes.split(recipe.path) == (recipe.base_path, recipe)


def test_a_recipes_flags_are_its_command_line():
    assert recipes.RECIPES["flash-bucket"].describe() == (
        "--trim_logits --attn_softmax_bf16 --limit_hpu_graphs --bucket_size 128 --bucket_internal "
        "--use_flash_attention --flash_attention_recompute --flash_attention_causal_mask")
    assert recipes.RECIPES["falcon"].base_path == "static+reuse"
    assert recipes.RECIPES["gemma"].base_path == "static"


def test_a_bad_recipe_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="bucket_internal needs --bucket_size"):
        recipes.Recipe("x", (), (), bucket_internal=True)
    with pytest.raises(ValueError, match="need --use_flash_attention"):
        recipes.Recipe("x", (), (), flash_attention_causal_mask=True)
    with pytest.raises(KeyError, match="unknown recipe 'nope'"):
        recipes.split("static@nope")


def test_cache_idx_is_generates_schedule_at_the_tiny_bucket():
    """generation/utils.py:2891-2900 at bucket 4: the slot count rounded up to the bucket while it fits the
    cache's whole buckets, the cache length after."""
    recipe = recipes.RECIPES["flash-bucket"]
    assert [recipe.cache_idx(t, 16) for t in (7, 8, 9, 12, 13, 16)] == [8, 8, 12, 12, 16, 16]
    assert [recipe.cache_idx(t, 18) for t in (16, 17, 18)] == [16, 18, 18]
    assert recipes.RECIPES["gemma"].cache_idx(7, 16) is None


def test_forward_kwargs_are_those_the_port_names_and_the_rest_are_dropped():
    recipe = recipes.RECIPES["mistral-fp8"]
    named = {"lazy_mode", "trim_logits", "use_flash_attention", "reuse_cache"}
    assert recipe.forward_kwargs(named.__contains__) == {"lazy_mode": True, "trim_logits": True,
                                                         "use_flash_attention": True}
    assert recipe.dropped(named.__contains__) == ["--attn_softmax_bf16", "--flash_attention_recompute"]


def test_the_recipe_cells_are_the_documented_variants_paths_and_check_ids():
    cells = {t.name: [p for p in t.paths if recipes.SEPARATOR in p] for t in family_targets(["optimum-habana"])}
    assert cells["optimum-habana/llama/gqa"] == ["static+reuse@reuse-trim-softmax", "static@flash-bucket",
                                                 "static+reuse@flash-reuse"]
    assert cells["optimum-habana/llama/mha"] == []  # one variant per recipe (docs/cost.md)
    assert cells["optimum-habana/gpt2/mha"] == []  # no recipe documents more than the defaults for gpt2
    assert all(p in index.FAMILY_PATHS for p in recipes.PATHS)
    assert "family-P1/static@flash-bucket" in CHECKS and "family-P0/static@flash-bucket" not in CHECKS
    assert "seed" not in [r.name for r in recipes.MATRIX_RECIPES]  # MPT drops its flags: the plain static path


def test_a_k_token_call_that_returns_one_positions_logits_fails_p1():
    """--trim_logits keeps the last position of a prefill (generate's next token), never of a k-token call
    (assisted decoding reads all k): an extend that returns its last position alone fails family-P1, naming
    what came back; a prefill that does passes."""
    from mpt_kv.checks.family import CHECKS as FAMILY_CHECKS
    from mpt_kv.families.implementations import transformers_runner

    class LastOnly:
        def __init__(self, inner, trim):
            self.inner, self.trim = inner, trim

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def prefill(self, ids, mask):
            out = self.inner.prefill(ids, mask)
            return out[:, -1:] if "prefill" in self.trim else out

        def extend(self, tokens):
            out = self.inner.extend(tokens)
            return out[:, -1:] if "extend" in self.trim else out

    def implementation(trim):
        def build(family, variant, dtype=torch.float32, *, seed=0, **options):
            runner = transformers_runner(family, variant, dtype, seed=seed, **options)
            session = runner.session
            runner.session = lambda path, max_len, bucket=None: LastOnly(session(path, max_len, bucket), trim)
            return runner
        build.implementation_name = f"last-only-{'-'.join(trim)}"
        return build

    FAMILY_CHECKS["family-P1"](implementation(("prefill",)), "llama", "gqa", "concat")
    with pytest.raises(PropertyFailure, match=r"family-P1 extend 3 \(step 3\): the implementation's extend of 3 "
                                              r"tokens per row returned logits for 1 positions, expected 3"):
        FAMILY_CHECKS["family-P1"](implementation(("extend",)), "llama", "gqa", "concat")


# --- on the ports (the ohabana env) ------------------------------------------------------------------------

def needs_optimum_habana():
    from mpt_kv.families.implementations import installed

    if not installed("optimum-habana"):
        pytest.skip("optimum-habana is not installed (tox -e ohabana)")


@pytest.fixture
def ports():
    needs_optimum_habana()
    from mpt_kv.families import gaudi

    return gaudi


def prompt_of(family, variant):
    from mpt_kv.checks.family_driver import prompt

    return prompt(FAMILIES[family].config(variant))


def flash_cells():
    return [(recipe.name, *name.split("/")) for recipe in recipes.MATRIX_RECIPES if recipe.use_flash_attention
            for name in recipe.families]


@pytest.mark.parametrize("recipe, family, variant", flash_cells())
def test_every_flash_cell_runs_the_standins_fusedsdpa_and_leaves_no_hpu_behind(ports, recipe, family, variant):
    """Every cell labelled cpu+standin for --use_flash_attention ran the stand-in's FusedSDPA (its prefill);
    outside the forward no habana_frameworks is importable."""
    from mpt_kv.families import hpu_kernels
    from mpt_kv.families.habana_standin import device_label
    from mpt_kv.targets import FamilyTarget

    runner = ports.gaudi_runner(FAMILIES[family], variant, torch.float32, recipe=recipe)
    before = hpu_kernels.CALLS["FusedSDPA"]
    ids, mask = prompt_of(family, variant)
    with contextlib.suppress(Exception):  # mistral's CPU RoPE raises before its attention: a known failure
        runner.session("static", 16).prefill(ids, mask)
    if family != "mistral":
        assert hpu_kernels.CALLS["FusedSDPA"] > before, f"{family} {recipe}: the flash branch never ran"
    assert importlib.util.find_spec("habana_frameworks") is None
    path = recipes.RECIPES[recipe].path
    assert device_label(FamilyTarget("optimum-habana", family, variant), "cpu", path) == "cpu+standin"


def test_a_flash_cell_scopes_the_standin_another_ports_import_left_in_the_module(ports, monkeypatch):
    """A port module first imported as a dependency of a port that declares the kernel stand-in keeps the stand-in's
    FusedSDPA; a flash recipe cell of a port that declares none must still run it inside its scope (order-dependent:
    llama's module imported under mixtral's port's stand-in failed llama's flash cells with StandinOutOfScope)."""
    from mpt_kv.families import hpu_kernels
    from mpt_kv.families.ports import load_port_module

    monkeypatch.setattr(load_port_module(FAMILIES["llama"]), "FusedSDPA", hpu_kernels.FusedSDPA)
    runner = ports.gaudi_runner(FAMILIES["llama"], "gqa", torch.float32, recipe="flash-bucket")
    before = hpu_kernels.CALLS["FusedSDPA"]
    runner.session("static", 16).prefill(*prompt_of("llama", "gqa"))
    assert hpu_kernels.CALLS["FusedSDPA"] > before


def test_a_plain_cell_runs_no_standin_and_keeps_its_label(ports):
    from mpt_kv.families import hpu_kernels
    from mpt_kv.families.habana_standin import device_label
    from mpt_kv.targets import FamilyTarget

    runner = ports.gaudi_runner(FAMILIES["llama"], "gqa", torch.float32, recipe="reuse-trim-softmax")
    before = hpu_kernels.CALLS["FusedSDPA"]
    runner.session("static", 16).prefill(*prompt_of("llama", "gqa"))
    assert hpu_kernels.CALLS["FusedSDPA"] == before
    target = FamilyTarget("optimum-habana", "llama", "gqa")
    assert device_label(target, "cpu", "static+reuse@reuse-trim-softmax") == "cpu"
    assert device_label(target, "cpu", "static") == "cpu"


class Spy:
    """Each forward's arguments, as the session passed them (a pre-hook: the forward's signature, which the
    session reads, stays the port's)."""

    def __init__(self, model):
        self.calls = []
        model.register_forward_pre_hook(lambda module, args, kwargs: self.calls.append({"args": args, **kwargs}),
                                        with_kwargs=True)


def test_bucket_internal_pads_the_prefill_cache_and_passes_generates_cache_idx(ports):
    runner = ports.gaudi_runner(FAMILIES["llama"], "gqa", torch.float32, recipe="flash-bucket")
    spy = Spy(runner.model)
    session = runner.session("static", 16)
    ids, mask = prompt_of("llama", "gqa")
    logits = session.prefill(ids, mask)
    assert spy.calls[0]["args"][0].shape[1] == spy.calls[0]["attention_mask"].shape[1] == 6  # the prompt alone
    assert all(t.shape[-2] == 16 for layer in session.kv() for t in layer)  # generate padded it to the cache
    for _ in range(3):
        logits = session.decode((logits if logits.dim() == 2 else logits[:, -1]).argmax(-1, keepdim=True))
    assert [c.get("cache_idx") for c in spy.calls] == [None, 8, 8, 12]
    assert spy.calls[1]["use_flash_attention"] is True and "kv_cache_len" not in spy.calls[1]  # not in its forward
    assert spy.calls[0]["valid_sequence_lengths"].tolist() == [4, 6]  # each row's unpadded prompt


def test_trim_logits_returns_the_last_positions_logits_only(ports):
    trimmed = ports.gaudi_runner(FAMILIES["llama"], "gqa", torch.float32, recipe="reuse-trim-softmax")
    plain = ports.gaudi_runner(FAMILIES["llama"], "gqa", torch.float32, reuse_cache=True)
    ids, mask = prompt_of("llama", "gqa")
    got = trimmed.session("static", 16).prefill(ids, mask)
    full = plain.session("static", 16).prefill(ids, mask)
    assert got.shape == (2, 1, full.shape[-1])
    # attn_softmax_bf16 rounds the softmax: the same next token's logits within bf16's resolution
    torch.testing.assert_close(got[:, 0].float(), full[:, -1].float(), atol=0.05, rtol=0.05)


def test_an_unknown_recipe_or_one_whose_flags_a_port_drops_is_refused(ports):
    with pytest.raises(InputError, match="unknown recipe 'fast'"):
        ports.gaudi_runner(FAMILIES["llama"], "gqa", recipe="fast")
    with pytest.raises(TargetUnavailable, match="drops every flag of the recipe trim"):
        ports.gaudi_runner(FAMILIES["gpt2"], "mha", recipe="trim")


# --- the recipe rows of the catalogues: one line of the port changed ---------------------------------------

@contextlib.contextmanager
def changed(owner, name: str, *replacements):
    """`owner.name` (a function of the port) compiled from its own source with each (old, new, count) of
    `replacements` made (`old` found exactly `count` times), run in its module's own globals (a name the
    kernel stand-in sets there while a forward runs, FusedSDPA, is seen) with its line numbers; put back
    after."""
    function = getattr(owner, name)
    assert function.__closure__ is None, f"{name} has a closure (super()): not recompiled here"
    source = inspect.getsource(function)
    for old, new, count in replacements:
        assert source.count(old) == count, f"{name}: {old!r} found {source.count(old)} times, expected {count}"
        source = source.replace(old, new)
    scratch = {}
    exec(compile(textwrap.dedent(source), inspect.getsourcefile(function), "exec"), dict(function.__globals__), scratch)
    code = scratch[name].__code__
    rebuilt = types.FunctionType(code, function.__globals__, name, function.__defaults__)
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    setattr(owner, name, rebuilt)
    try:
        yield
    finally:
        setattr(owner, name, function)


def llama_attention():
    needs_optimum_habana()
    from mpt_kv.families.ports import load_port_module

    return load_port_module(FAMILIES["llama"]).GaudiLlamaAttention


DECODE_MASK = '''                    value_states,
                    attention_mask,
                    0.0,
                    False,
                    None,
                    "None",
                    False,'''


def flash_decode_drops_the_mask():
    """Only in the flash branch: the next token's FusedSDPA call without the attention mask (the decode
    shortcut of fast attention paths; a left-padded row then attends its padding)."""
    return changed(llama_attention(), "pre_attn_forward",
                   (DECODE_MASK, DECODE_MASK.replace("attention_mask,", "None,"), 1))


def bucket_slice_one_short():
    """Only under bucket_internal: the decode's cache slice one slot short of cache_idx (the key, the value
    and the mask alike), which drops the newest token at a bucket's last slot."""
    return changed(llama_attention(), "pre_attn_forward", ("[:, :, :cache_idx, :]", "[:, :, :cache_idx - 1, :]", 2),
                   ("attention_mask[:, :, :, :cache_idx]", "attention_mask[:, :, :, :cache_idx - 1]", 1))


def reuse_reorders_keys_only():
    """Only on the reuse_cache path: reorder_kv_cache (what beam search calls with reuse_cache) reorders the
    key cache and leaves the values in the old beam order."""
    return changed(llama_attention(), "reorder_kv_cache",
                   ("        self.reorder(self.v_cache.cache, beam_idx, seq_length, head_dim)\n", "", 1))


FLASH_SDPA = '''                        None,
                        0.0,
                        True,
                        None,
                        softmax_mode,
                        flash_attention_recompute,
                        valid_sequence_lengths,
                        "left",
                    )'''


def flash_through_torch_sdpa():
    """A design: the first token's causal flash call computed by torch's SDPA, the left padding as a key mask
    from valid_sequence_lengths (what a port without Habana's kernel writes): it must pass."""
    replacement = '''                        padding_keys(key_states, valid_sequence_lengths),
                        0.0,
                        False,
                        None,
                        softmax_mode,
                        flash_attention_recompute,
                        None,
                        "None",
                    )'''
    owner = llama_attention()

    @contextlib.contextmanager
    def design():
        module = inspect.getmodule(owner)
        module.padding_keys = padding_keys
        try:
            with changed(owner, "pre_attn_forward", (FLASH_SDPA, replacement, 1)):
                yield
        finally:
            del module.padding_keys
    return design()


def padding_keys(key_states, lengths):
    """A (B, 1, L, L) bool mask: causal, and row b's first L - lengths[b] (left padding) keys left out, where
    a query has a key at all (a padded query row keeps its own position: its output is never read)."""
    length = key_states.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=key_states.device).tril()
    keys = torch.arange(length, device=key_states.device)[None, :] >= (length - lengths.reshape(-1, 1))
    mask = causal[None, None] & keys[:, None, None, :]
    return mask | torch.eye(length, dtype=torch.bool, device=key_states.device)[None, None] & ~mask.any(-1, keepdim=True)


def verdict(check: str, path: str, dtype) -> str:
    """The gate's verdict on one llama/gqa cell with the known-failure rule: pass, known (the cell's entry
    explains the failure) or killed (a failure no entry explains)."""
    from mpt_kv.checks.family_driver import clear_caches
    from mpt_kv.findings.known import KnownFailures
    from mpt_kv.targets import FamilyTarget

    clear_caches()  # a runner built before the change keeps nothing of it but the class's methods
    try:
        KnownFailures().check(CHECKS[f"{check}/{path}"], FamilyTarget("optimum-habana", "llama", "gqa"), "cpu", dtype)
    except KnownFailure:
        return "known"
    except PropertyFailure as failure:
        return f"killed: {str(failure)[:160]}"
    return "pass"


VARIANTS = {
    # variant: (the check that kills it, its recipe cell, the plain cells that never take its branch)
    "flash_decode_drops_the_mask": (flash_decode_drops_the_mask, "family-P1", "static@flash-bucket",
                                    ("static", "static+reuse")),
    "bucket_slice_one_short": (bucket_slice_one_short, "family-P1", "static@flash-bucket", ("static", "static+reuse")),
    "reuse_reorders_keys_only": (reuse_reorders_keys_only, "family-ops", "static+reuse@reuse-trim-softmax",
                                 ("static", "concat")),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_a_variant_in_a_recipes_branch_is_killed_by_its_cells_and_passed_by_the_plain_ones(name):
    change, check, recipe_path, plain = VARIANTS[name]
    with change():
        assert verdict(check, recipe_path, torch.float32).startswith("killed"), name
        for path in plain:  # the branch is never taken there: the gate says what it says without the change
            assert not verdict(check, path, torch.float32).startswith("killed"), (name, path)
    assert not verdict(check, recipe_path, torch.float32).startswith("killed")  # the port as shipped


def test_the_flash_branch_through_torch_sdpa_passes():
    with flash_through_torch_sdpa():
        for check in ("family-P1", "family-P3", "family-P4", "family-ops", "family-memory"):
            for path in ("static@flash-bucket", "static+reuse@flash-reuse"):
                assert verdict(check, path, torch.float32) in ("pass", "known"), (check, path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "falcon", "starcoder2", "gemma3"])
def test_the_repros_recipe_keywords_are_what_the_installed_ports_forward_names(ports, family):
    """The standalone repros of the recipes' findings pass a port the recipe keywords its forward names
    (mpt_kv/findings/port_repros.py RECIPE_FORWARD_NAMES, kept as data): the installed release's own."""
    import inspect as inspect_
    from mpt_kv.findings.port_repros import RECIPE_FORWARD_NAMES
    from mpt_kv.families.ports import load_port_module

    port = FAMILIES[family].gaudi
    named = inspect_.signature(getattr(load_port_module(FAMILIES[family]), port.causal_lm).forward).parameters
    keywords = set(recipes.RECIPES["flash-bucket"].model_kwargs()) - {"reuse_cache", "bucket_internal",
                                                                      "limit_hpu_graphs"}
    assert set(RECIPE_FORWARD_NAMES[family]) == keywords & set(named)
