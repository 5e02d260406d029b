"""family-P1 and family-P3 on transformers' implementation of each family, with the cache the
model makes itself (`DynamicCache`: the concat path), in fp32, on CPU.

- family-P1: a left-padded batch of 2, prefilled and decoded a few greedy steps with the cache,
  gives the logits of one uncached forward over the same tokens.
- family-P3: after the prefill and every step, the storages of the cached keys and values hold
  nothing but them: their bytes equal the bytes the cached tensors in them reach
  (`covered_bytes`). A view of the fused projection's output (`mixed_qkv`) pins the q part and the
  rest of the step's projection; the failure names the module, the layer and the bytes.

Both raise `PropertyFailure`; anything else (a model that does not build, a cache that does not
hold what the family says) is an error of the family entry or the target.
"""

from __future__ import annotations

import torch

from mpt_kv.checks.compare import PropertyFailure, assert_close, describe, tolerance
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.families import FAMILIES
from mpt_kv.families.base import Family

BATCH, PROMPT, PAD, STEPS = 2, 6, 2, 3  # row 0 has PAD left-padding tokens


def family_of(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}: families {sorted(FAMILIES)}")
    return FAMILIES[name]


def build(family: Family, variant: str, seed: int = 0):
    """transformers' model of a tiny config, random weights (seeded), eager attention (a fully
    padded query row gives uniform weights there, not the NaN of an all -inf softmax)."""
    from transformers import AutoModelForCausalLM

    config = family.config(variant)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # no dtype: 4.x does not take it
    return model.to(torch.float32).eval(), config


def prompt(config, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of a left-padded batch: row 0 starts with PAD padding tokens, row 1 has none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (BATCH, PROMPT), generator=g)
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
    mask[0, :PAD] = 0
    return ids, mask


def cached_kv(past) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, "key"/"value", tensor) of every cached tensor, as the cache stores it: a 5.x Cache's
    `layers[i].keys/.values`, a 4.x DynamicCache's `key_cache/value_cache`, legacy tuples (a
    layer's single tensor, as GPT-BigCode's fused key_value in 4.x, is named "key_value")."""
    if hasattr(past, "layers"):
        pairs = [(layer.keys, layer.values) for layer in past.layers]
    elif hasattr(past, "key_cache"):
        pairs = list(zip(past.key_cache, past.value_cache))
    elif isinstance(past, (tuple, list)):
        pairs = [tuple(p) if isinstance(p, (tuple, list)) else (p,) for p in past]
    else:
        raise TypeError(f"unknown cache type {type(past).__name__}: expected a transformers Cache or legacy tuples")
    out = []
    for layer, pair in enumerate(pairs):
        names = ("key", "value") if len(pair) == 2 else ("key_value",)
        out += [(layer, n, t) for n, t in zip(names, pair) if t is not None]
    return out


def _step(model, ids, mask, past=None):
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True)


def check_cached_equals_uncached(name: str, variant: str, steps: int = STEPS) -> None:
    """family-P1 (see the module docstring)."""
    family = family_of(name)
    model, config = build(family, variant)
    ids, mask = prompt(config)
    tol = tolerance(torch.float32, "logits:concat")
    out = _step(model, ids, mask)
    cached, past, seq = [out.logits[:, -1].clone()], out.past_key_values, ids
    for _ in range(steps):
        token = cached[-1].argmax(-1, keepdim=True)
        seq, mask = torch.cat([seq, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        out = _step(model, token, mask, past)
        cached.append(out.logits[:, -1].clone())
        past = out.past_key_values
    with torch.inference_mode():
        full = model(input_ids=seq, attention_mask=mask, use_cache=False).logits
    for step, logits in enumerate(cached):
        where = "prefill" if step == 0 else f"decode step {step}"
        assert_close(logits, full[:, PROMPT - 1 + step], tol,
                     f"family-P1 {where}: cached logits vs the uncached forward",
                     dict(target=f"transformers/{name}", variant=variant, dtype="float32", batch=BATCH,
                          prompt=PROMPT, pad=PAD, step=where, cache=type(past).__name__))


class FusedCapture:
    """Holds each fused projection's latest output, so its storage stays alive (and its identity
    unique) until the check has compared the cache's storages with it."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]]):
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules]

    def _hook(self, name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                self.outputs[name] = output
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        self.outputs = {}


def pinning_problems(kv: list[tuple[int, str, torch.Tensor]], fused: dict[str, torch.Tensor]) -> list[str]:
    """One line per storage of cached tensors with bytes none of them reaches: which tensors, the
    fused projection whose output the storage is (if it is one), the bytes."""
    by_storage: dict[int, list[tuple[int, str, torch.Tensor]]] = {}
    for entry in kv:
        by_storage.setdefault(storage_key(entry[2]), []).append(entry)
    outputs = {storage_key(t): (n, t) for n, t in fused.items()}
    problems = []
    for key, entries in by_storage.items():
        storage = entries[0][2].untyped_storage()
        covered = covered_bytes(storage.nbytes(), [t for _, _, t in entries])
        if covered == storage.nbytes():
            continue
        names = " and ".join(f"layer {layer} {n} {tuple(t.shape)}" for layer, n, t in entries)
        verb = "are views" if len(entries) > 1 else "is a view"
        if key in outputs:
            module, t = outputs[key]
            what = f"{verb} of {module}'s output {tuple(t.shape)}"
        else:
            what = f"{verb} of a buffer that is no fused projection's output of this step"
        problems.append(f"{names} {what}: its storage holds {storage.nbytes()} bytes, the cached tensors in it "
                        f"{covered}: {storage.nbytes() - covered} bytes pinned beyond the cache")
    return problems


def check_no_pinned_storage(name: str, variant: str, steps: int = STEPS) -> None:
    """family-P3 (see the module docstring). Before any verdict it checks that the family entry
    describes the model: its fused projection exists once per layer, and the cache holds the
    analytic K/V bytes (MQA/GQA aware) for the tokens seen."""
    family = family_of(name)
    model, config = build(family, variant)
    modules = family.fused_modules(model)
    if family.fused is not None and len(modules) != family.layers(config):
        raise RuntimeError(f"family {name}: expected one `{family.fused}` module per layer ({family.layers(config)}), "
                           f"found {len(modules)}: {[n for n, _ in modules]}")
    ids, mask = prompt(config)
    capture = FusedCapture(modules)
    try:
        out, seq_len = _step(model, ids, mask), PROMPT
        for step in range(steps + 1):
            if step:
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                mask, seq_len = torch.cat([mask, torch.ones_like(token)], 1), seq_len + 1
                out = _step(model, token, mask, out.past_key_values)
            where = "prefill" if step == 0 else f"decode step {step}"
            kv = cached_kv(out.past_key_values)
            ctx = dict(target=f"transformers/{name}", variant=variant, dtype="float32", batch=BATCH, step=where,
                       cache=type(out.past_key_values).__name__)
            held = sum(t.numel() * t.element_size() for _, _, t in kv)
            expected = family.stored_kv_bytes_per_token(config, torch.float32) * BATCH * seq_len
            if held != expected:
                raise RuntimeError(f"family {name}: the cache holds {held} bytes of K/V, the family entry says "
                                   f"{expected} ({BATCH} x {seq_len} tokens): fix its kv_heads/head_dim/layers or "
                                   f"declare stored_kv_heads [{describe(ctx)}]")
            problems = pinning_problems(kv, capture.outputs)
            if problems:
                raise PropertyFailure(f"family-P3 cache pins storage after {where}: " + "; ".join(problems)
                                      + f" [{describe(ctx)}]")
    finally:
        capture.close()


CHECKS = {"family-P1": check_cached_equals_uncached, "family-P3": check_no_pinned_storage}
