"""optimum-habana 1.21.2's Gaudi ports that load under the habana_frameworks stand-in (falcon,
gpt_bigcode, gptj, llama, qwen2, mistral, starcoder2), on CPU, fp32: each builds holding
transformers' weights, its uncached logits are transformers', its cached decode (concat, static
token_idx, reuse_cache where the port has it) gives its own uncached forward, and each real failure
found in it (mpt_kv/findings/family_known_failures.json, target "optimum-habana/...") reproduces
here: the exception, its message, the upstream line it is raised from, and the entry whose pattern
reads it as the family checks word it ("<operation> raised <Type>: <message>").

Without optimum-habana (the cpu env) the port cases skip with that reason only; where it is
installed (the ohabana env) a port that does not load fails (PortError), never skips.
"""

from __future__ import annotations

import importlib.util
import re
import traceback

import pytest
import torch

from mpt_kv.checks.compare import assert_close, tolerance
from mpt_kv.errors import TargetUnavailable
from mpt_kv.families import FAMILIES, gaudi
from mpt_kv.checks.family_driver import BATCH, PROMPT, prompt
from mpt_kv.families.models import build
from mpt_kv.findings.raw import raw_entries, target_of

HAVE_OH = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.habana") is not None
NOT_INSTALLED = "optimum-habana is not installed (pip install --no-deps optimum-habana, or tox -e ohabana)"
needs_oh = pytest.mark.optimum_habana  # deselected where it is not installed (tests/conftest.py)

STEPS, EXTEND, MAX_LEN = 3, 3, 16
ENTRIES = raw_entries()

# every (family, variant) of this file's ports; which of them pass what (the rest: findings below)
PORTS = [("falcon", "alibi"), ("falcon", "rotary-mqa"), ("falcon", "new-arch-gqa"), ("gpt_bigcode", "mqa"),
         ("gpt_bigcode", "mha"), ("gptj", "mha"), ("llama", "mha"), ("llama", "gqa"), ("llama", "mqa"),
         ("llama", "fused-qkv"), ("qwen2", "gqa"), ("mistral", "gqa"), ("starcoder2", "gqa")]
NO_PORT = ["phi3", "dbrx"]  # optimum-habana 1.21.2 ships none
UNCACHED_EQUAL = [p for p in PORTS if p not in {("falcon", "alibi"), ("mistral", "gqa"), ("starcoder2", "gqa")}]
# (family, variant, path, extend: a k-token cached call holds there too)
DECODES = [("falcon", "alibi", "concat", False), ("falcon", "alibi", "static", False),
           ("falcon", "rotary-mqa", "concat", False), ("falcon", "rotary-mqa", "static", False),
           ("falcon", "rotary-mqa", "static+reuse", False), ("gpt_bigcode", "mqa", "concat", True),
           ("gpt_bigcode", "mqa", "static", False), ("gpt_bigcode", "mha", "concat", True),
           ("gptj", "mha", "concat", True), ("gptj", "mha", "static", False), ("gptj", "mha", "static+reuse", False)]
DECODES += [("llama", v, p, False) for v in ("mha", "gqa", "mqa") for p in ("concat", "static", "static+reuse")]
DECODES += [("qwen2", "gqa", p, False) for p in ("concat", "static", "static+reuse")]


@pytest.fixture(scope="module")
def runners():
    """(family, variant, reuse_cache) -> runner, built once per module."""
    made = {}

    def get(name, variant, reuse=False):
        if (name, variant, reuse) not in made:
            # a port that does not load raises PortError here: the test fails, it never skips
            made[name, variant, reuse] = gaudi.gaudi_runner(FAMILIES[name], variant, reuse_cache=reuse)
        return made[name, variant, reuse]

    return get


def ids_of(p):
    return "/".join(str(x) for x in p)


def session_of(runners, name, variant, path):
    runner = runners(name, variant, path == "static+reuse")
    return runner, runner.session("concat" if path == "concat" else "static", MAX_LEN)


def run_program(session, config, ops):
    """prefill, then each op ("decode": the greedy token, "extend": EXTEND fixed tokens,
    "reorder": rows swapped): [(op, logits, tokens fed)]."""
    ids, mask = prompt(config)
    out = [("prefill", session.prefill(ids, mask), ids)]
    for op in ops:
        last = [o for o in out if o[1] is not None][-1][1]
        if op == "decode":
            tokens = (last[:, -1] if last.dim() == 3 else last).argmax(-1, keepdim=True)
            out.append((op, session.decode(tokens), tokens))
        elif op == "extend":
            tokens = torch.randint(1, config.vocab_size, (BATCH, EXTEND), generator=torch.Generator().manual_seed(7))
            out.append((op, session.extend(tokens), tokens))
        elif op == "reorder":
            session.reorder(torch.tensor([1, 0]))
            out.append((op, None, None))
        else:
            raise ValueError(op)
    return out


# --- the ports build, hold transformers' weights, give its logits -------------------------------------------

@needs_oh
@pytest.mark.parametrize("name,variant", PORTS, ids=[ids_of(p) for p in PORTS])
def test_the_port_holds_transformers_weights(runners, name, variant):
    runner = runners(name, variant)
    reference, config = build(FAMILIES[name], variant)
    port = FAMILIES[name].gaudi
    want = reference.state_dict() if port.state_dict is None else port.state_dict(reference.state_dict(), config)
    got = runner.model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert type(runner.model).__name__ == port.causal_lm


@needs_oh
@pytest.mark.parametrize("name,variant", UNCACHED_EQUAL, ids=[ids_of(p) for p in UNCACHED_EQUAL])
def test_the_ports_uncached_logits_are_transformers(runners, name, variant):
    runner = runners(name, variant)
    reference, config = build(FAMILIES[name], variant)
    ids, mask = prompt(config)
    with torch.inference_mode():
        got = runner.logits(ids, mask).clone()
        want = reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert_close(got, want, tolerance(torch.float32, "logits:uncached"), "uncached logits vs transformers'",
                 dict(target=f"optimum-habana/{name}", variant=variant), where=mask.bool()[:, :, None])


@needs_oh
@pytest.mark.parametrize("name,variant,path,extend", DECODES, ids=[ids_of(p) for p in DECODES])
def test_the_ports_cached_calls_give_its_uncached_forward(runners, name, variant, path, extend):
    """Prefill, STEPS greedy decodes (and a k-token call where that holds): the port's own uncached
    forward over the same tokens; the cache has one entry per layer (static: full length)."""
    runner, session = session_of(runners, name, variant, path)
    config = build(FAMILIES[name], variant)[1]
    ops = ["decode"] * STEPS + (["extend"] if extend else [])
    ids, mask = prompt(config)
    with torch.inference_mode():
        steps = [(op, logits.clone(), tokens) for op, logits, tokens in run_program(session, config, ops)]
        seq = torch.cat([tokens for _, _, tokens in steps], 1)
        full = runner.logits(seq, torch.cat([mask, torch.ones(BATCH, seq.shape[1] - PROMPT, dtype=mask.dtype)], 1))
    tol = tolerance(torch.float32, "logits:static" if path.startswith("static") else "logits:concat")
    end = 0
    for i, (op, logits, tokens) in enumerate(steps):
        end += tokens.shape[1]
        got = logits.reshape(BATCH, -1, logits.shape[-1])
        want = full[:, end - got.shape[1]:end]
        where = mask.bool()[:, :, None] if op == "prefill" else None
        assert_close(got, want, tol, f"{op} logits vs the port's uncached forward",
                     dict(target=f"optimum-habana/{name}", variant=variant, path=path, step=f"{i} {op}"), where=where)
    kv = session.kv()
    assert len(kv) == FAMILIES[name].layers(config)
    if path.startswith("static"):  # the port's own preallocated buffers
        assert all(MAX_LEN in t.shape for t in kv[0])


def test_a_family_without_a_port_in_the_release_is_unavailable_naming_it():
    for name in NO_PORT:
        variant = next(iter(FAMILIES[name].variants))
        reason = (rf"optimum-habana \S+ has no port of {name}: .*modeling_{name}.py does not exist" if HAVE_OH
                  else re.escape(NOT_INSTALLED))
        with pytest.raises(TargetUnavailable, match=reason):
            gaudi.gaudi_runner(FAMILIES[name], variant)


# --- the findings reproduce --------------------------------------------------------------------------------

def raised_at(excinfo, where: str) -> bool:
    """Whether `where` ("optimum/habana/.../file.py:LINE") is a frame of the exception's traceback."""
    file, line = where.rsplit(":", 1)
    return any(f.filename.replace("\\", "/").endswith(file) and f.lineno == int(line)
               for f in traceback.extract_tb(excinfo.tb))


def entry_reading(name, variant, path, message) -> dict:
    """The optimum-habana entry of this family variant (for this path) whose pattern reads `message`."""
    hits = [e for e in ENTRIES if target_of(e) == ("optimum-habana", name, variant) and e.get("path", path) == path
            and re.search(e["pattern"], message)]
    assert hits, f"no optimum-habana entry of {name}/{variant} ({path}) in known_failures.json reads: {message}"
    return hits[0]


OH = "optimum/habana/transformers/"
MASK, MODELS = OH + "modeling_attn_mask_utils.py", OH + "models/"
EXPANDED = r"The expanded size of the tensor \(\d+\) must match the existing size \(\d+\)"


def crash(name, variant, path, ops, operation, error, message, raised, named):
    """A crash found in a port: the program (ops after the prefill) on `path`, the operation that
    raises `error` with `message` (a regex), from the frame `raised` (file:line; None: the
    attribute lookup of mpt-kv's own call), and what the entry's upstream names (`named`)."""
    return pytest.param(name, variant, path, ops, operation, error, message, raised, named,
                        id=f"{name}/{variant}/{path}/{operation}")


CRASHES = [
    crash("llama", "gqa", "concat", ["decode", "extend"], "extend", RuntimeError,
          r"The expanded size of the tensor \(10\) must match the existing size \(7\)", MASK + ":79",
          "modeling_attn_mask_utils.py:54"),
    crash("llama", "gqa", "static", ["decode", "extend"], "extend", RuntimeError,
          r"The expanded size of the tensor \(19\) must match the existing size \(16\)", MASK + ":79",
          "modeling_attn_mask_utils.py:54"),
    crash("qwen2", "gqa", "concat", ["extend"], "extend", RuntimeError, EXPANDED, MASK + ":79",
          "modeling_attn_mask_utils.py:54"),
    crash("falcon", "rotary-mqa", "concat", ["extend"], "extend", RuntimeError, EXPANDED, MASK + ":79",
          "modeling_attn_mask_utils.py:54"),
    crash("falcon", "rotary-mqa", "static", ["extend"], "extend", RuntimeError,
          r"The size of tensor a \(16\) must match the size of tensor b \(3\) at non-singleton dimension 3",
          MASK + ":128", "modeling_attn_mask_utils.py:128"),
    crash("gptj", "mha", "static", ["extend"], "extend", IndexError,
          r"index_copy_\(\): Number of indices \(1\) should be equal to source.size\(dim\) \(3\)",
          MODELS + "gptj/modeling_gptj.py:225", "modeling_gptj.py:225"),
    crash("gptj", "mha", "static+reuse", ["extend"], "extend", RuntimeError,
          r"The size of tensor a \(6\) must match the size of tensor b \(3\) at non-singleton dimension 2",
          MODELS + "gptj/modeling_gptj.py:52", "modeling_gptj.py:51-53"),
    crash("gpt_bigcode", "mqa", "static", ["extend"], "extend", RuntimeError,
          r"index_add_\(\): Number of indices \(1\) should be equal to source.size\(dim\): \(3\), for dim: 1",
          MODELS + "gpt_bigcode/modeling_gpt_bigcode.py:358", "modeling_gpt_bigcode.py:358"),
    crash("gpt_bigcode", "mha", "static", ["decode"], "decode", RuntimeError,
          r"INDICES element is out of DATA bounds, id=6 axis_dim=4", MODELS + "gpt_bigcode/modeling_gpt_bigcode.py:358",
          "modeling_gpt_bigcode.py:358"),
    crash("falcon", "rotary-mqa", "concat", ["decode", "reorder"], "reorder", AttributeError,
          r"'GaudiFalconForCausalLM' object has no attribute '_reorder_cache'", OH + "generation/utils.py:191",
          "utils.py:190-191"),
    crash("gpt_bigcode", "mqa", "concat", ["decode", "reorder"], "reorder", AttributeError,
          r"'GaudiGPTBigCodeForCausalLM' object has no attribute '_reorder_cache'", OH + "generation/utils.py:191",
          "utils.py:190-191"),
    crash("gptj", "mha", "concat", ["decode", "reorder"], "reorder", AttributeError,
          r"'GaudiGPTJForCausalLM' object has no attribute '_reorder_cache'", OH + "generation/utils.py:191",
          "utils.py:190-191"),
    crash("falcon", "rotary-mqa", "static+reuse", ["decode", "reorder"], "reorder", AttributeError,
          r"'GaudiFalconForCausalLM' object has no attribute 'reorder_kv_cache'", None, "utils.py:3461"),
    crash("falcon", "alibi", "static+reuse", [], "prefill", RuntimeError,
          r"output with shape \[2, 1, 6, 8\] doesn't match the broadcast shape \[2, 4, 6, 8\]",
          MODELS + "modeling_all_models.py:63", "modeling_falcon.py:257"),
    crash("falcon", "new-arch-gqa", "concat", ["decode"], "decode", RuntimeError,
          r"shape '\[2, 4, 2, 1, 8\]' is invalid for input of size 64", MODELS + "falcon/modeling_falcon.py:111",
          "modeling_falcon.py:301"),
    crash("falcon", "new-arch-gqa", "static", ["decode"], "decode", RuntimeError,
          r"shape '\[2, 4, 2, 1, 8\]' is invalid for input of size 64", MODELS + "falcon/modeling_falcon.py:111",
          "modeling_falcon.py:301"),
    crash("falcon", "new-arch-gqa", "static+reuse", [], "prefill", RuntimeError,
          r"The size of tensor a \(2\) must match the size of tensor b \(4\) at non-singleton dimension 1",
          MODELS + "modeling_all_models.py:63", "modeling_falcon.py:255"),
    crash("llama", "fused-qkv", "concat", [], "prefill", AttributeError, r"'NoneType' object has no attribute 'weight'",
          MODELS + "llama/modeling_llama.py:524", "modeling_llama.py:524"),
    crash("llama", "fused-qkv", "static", [], "prefill", AttributeError, r"'NoneType' object has no attribute 'weight'",
          MODELS + "llama/modeling_llama.py:524", "modeling_llama.py:524"),
    crash("llama", "fused-qkv", "static+reuse", [], "prefill", AttributeError,
          r"'NoneType' object has no attribute 'weight'", MODELS + "llama/modeling_llama.py:515", ":515"),
    crash("mistral", "gqa", "concat", [], "prefill", RuntimeError,
          r"The size of tensor a \(4\) must match the size of tensor b \(6\) at non-singleton dimension 1",
          MODELS + "mistral/modeling_mistral.py:710", "modeling_mistral.py:710"),
    crash("starcoder2", "gqa", "concat", [], "prefill", KeyError, r"'input_shape'",
          MODELS + "starcoder2/modeling_starcoder2.py:121", "modeling_starcoder2.py:121"),
    crash("starcoder2", "gqa", "static+reuse", [], "prefill", AttributeError,
          r"'GaudiStarcoder2Attention' object has no attribute 'num_key_value_heads'",
          MODELS + "starcoder2/modeling_starcoder2.py:156", "modeling_starcoder2.py:156"),
]


@needs_oh
@pytest.mark.parametrize("name,variant,path,ops,operation,error,message,raised,named", CRASHES)
def test_a_crash_found_in_the_port_reproduces_and_its_entry_reads_it(runners, name, variant, path, ops, operation,
                                                                     error, message, raised, named):
    runner, session = session_of(runners, name, variant, path)
    config = build(FAMILIES[name], variant)[1]
    with pytest.raises(error) as e, torch.inference_mode():
        run_program(session, config, ops)
    text = str(e.value) if error is not KeyError else repr(e.value.args[0])
    assert re.search(message, text), text
    if raised is not None:
        assert raised_at(e, raised), f"not raised at {raised}: {traceback.format_tb(e.tb)[-3:]}"
    entry = entry_reading(name, variant, path, f"{operation} raised {error.__name__}: {text}")
    assert named in entry["upstream"], entry["upstream"]


@needs_oh
@pytest.mark.parametrize("name", ["mistral", "starcoder2"])
def test_the_ports_that_crash_in_every_forward_crash_uncached_too(runners, name):
    runner = runners(name, "gqa")
    ids, mask = prompt(build(FAMILIES[name], "gqa")[1])
    with pytest.raises((RuntimeError, KeyError)) as e, torch.inference_mode():
        runner.logits(ids, mask)
    text = str(e.value) if e.type is RuntimeError else repr(e.value.args[0])
    entry_reading(name, "gqa", "concat", f"logits raised {e.type.__name__}: {text}")


@needs_oh
def test_falcon_alibi_is_transformers_sdpa_and_the_eager_oracle_adds_alibi_twice(runners):
    """The P0 finding is the reference's: the port = transformers' sdpa Falcon (ALiBi once), the
    eager Falcon (the oracle) differs from both by its second ALiBi."""
    from transformers import AutoModelForCausalLM

    runner = runners("falcon", "alibi")
    eager, config = build(FAMILIES["falcon"], "alibi")
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    ids, mask = prompt(config)
    real = mask.bool()
    with torch.inference_mode():
        got = runner.logits(ids, mask)
        to_sdpa = (got - sdpa(input_ids=ids, attention_mask=mask).logits)[real].abs().max().item()
        to_eager = (got - eager(input_ids=ids, attention_mask=mask).logits)[real].abs().max().item()
    assert to_sdpa <= 1e-5 < 1e-3 < to_eager, (to_sdpa, to_eager)
    entry = next(e for e in ENTRIES if (*target_of(e), e["property"]) == ("optimum-habana", "falcon", "alibi", "family-P0"))
    assert "modeling_falcon.py:393-394" in entry["upstream"]


@needs_oh
def test_falcon_alibi_prefill_cache_is_a_view_of_query_key_value(runners):
    """The seed bug class in the port: after the concat prefill the cached K and V of every layer
    are views of that layer's query_key_value output, which they pin a third of."""
    runner, session = session_of(runners, "falcon", "alibi", "concat")
    outputs = {}
    hooks = [b.self_attention.query_key_value.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out))
             for i, b in enumerate(runner.model.transformer.h)]
    try:
        with torch.inference_mode():
            run_program(session, build(FAMILIES["falcon"], "alibi")[1], [])
    finally:
        for h in hooks:
            h.remove()
    for layer, (k, v) in enumerate(session.kv()):
        fused = outputs[layer].untyped_storage()
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == fused.data_ptr()
        assert fused.nbytes() == 3 * k.numel() * k.element_size()  # q, k, v: the q third pinned
    entry_reading("falcon", "alibi", "concat", "family-P3 cache pins storage after prefill: layer 0 key (2, 4, 6, 8) "
                  "and layer 0 value (2, 4, 6, 8) are views of transformer.h.0.self_attention.query_key_value's output")


@needs_oh
def test_falcon_new_arch_caches_kv_broadcast_to_every_query_head(runners):
    runner, session = session_of(runners, "falcon", "new-arch-gqa", "concat")
    config = build(FAMILIES["falcon"], "new-arch-gqa")[1]
    with torch.inference_mode():
        run_program(session, config, [])
    k, v = session.kv()[0]
    assert k.shape[1] == v.shape[1] == config.num_attention_heads != FAMILIES["falcon"].kv_heads(config)


@needs_oh
@pytest.mark.parametrize("path", ["concat", "static"])
def test_falcon_new_arch_with_8_kv_heads_takes_the_other_branch_and_decodes(path):
    """The new-arch finding is num_kv_heads != 8's: with 8 (Falcon-40B/180B's) the port caches 8
    K/V heads and its decode gives its uncached forward. A variant made here only: not drawn in the
    matrix (its cost), the registry's new-arch-gqa stays the finding's."""
    from dataclasses import replace

    falcon = FAMILIES["falcon"]
    kv8 = {"alibi": False, "new_decoder_architecture": True, "num_kv_heads": 8, "hidden_size": 64,
           "num_attention_heads": 16}
    family = replace(falcon, variants={**falcon.variants, "new-arch-kv8": kv8})
    runner = gaudi.gaudi_runner(family, "new-arch-kv8")
    config = family.config("new-arch-kv8")
    session = runner.session(path, MAX_LEN)
    ids, mask = prompt(config)
    with torch.inference_mode():
        steps = [(op, logits.clone(), tokens) for op, logits, tokens in run_program(session, config, ["decode"] * STEPS)]
        seq = torch.cat([tokens for _, _, tokens in steps], 1)
        full = runner.logits(seq, torch.cat([mask, torch.ones(BATCH, STEPS, dtype=mask.dtype)], 1))
    for i, (op, logits, _) in enumerate(steps[1:], 1):
        assert_close(logits.reshape(BATCH, -1), full[:, PROMPT - 1 + i], tolerance(torch.float32, f"logits:{path}"),
                     f"{op} vs uncached", dict(target="optimum-habana/falcon", variant="new-arch-kv8", path=path))
    k, v = session.kv()[0]
    assert k.shape[1] == v.shape[1] == 8
