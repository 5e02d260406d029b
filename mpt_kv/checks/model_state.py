"""What a model and its runner keep after every generation ended, the memory checks' last question
(`mpt_kv.checks.ceilings`, `mpt_kv.checks.family`): the tensors they reference that are neither weights nor
pre-existing (`model_state_tensors`), the constants a model builds once and keeps (`made_once`,
`constants_kept`: llm-foundry's lazily built ALiBi bias is model state, not a leak), and the verdict
(`model_state_problem`). The walk over a runner's attributes is the accounting's (`accounting.tensors_in`)."""

from __future__ import annotations

import hashlib
import weakref

import torch

from mpt_kv.checks.accounting import tensors_in
from mpt_kv.checks.storages import storage_key
from mpt_kv.errors import describe


def model_state_tensors(runner, preexisting: set[int]) -> list[tuple[str, torch.Tensor]]:
    """Tensors the runner and its model reference that are neither its weights nor tensors that
    existed before the generations (`preexisting`): module attributes, registered buffers made
    since, runner attributes, with their paths ('model.transformer.blocks.0.attn.probs')."""
    out, seen = [], set()
    parameters = {storage_key(p) for p in runner.model.parameters()}

    def add(where, t):
        key = storage_key(t)
        if key not in seen and key not in preexisting and key not in parameters:
            seen.add(key)
            out.append((where, t))

    for name, module in runner.model.named_modules():
        prefix = f"model.{name}." if name else "model."
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_modules"):
                continue
            items = value.items() if attr == "_buffers" else [(attr, value)]
            for key, v in items:
                for where, t in tensors_in(v, prefix + str(key), 6):
                    add(where, t)
    for attr, value in vars(runner).items():
        if attr != "model":
            for where, t in tensors_in(value, f"runner.{attr}", 6):
                add(where, t)
    return out


def _digest(t: torch.Tensor) -> bytes:
    """The bytes a tensor holds, hashed (read on the host; no copy of it stays allocated)."""
    flat = t.detach().reshape(-1).contiguous()
    return hashlib.blake2b(flat.view(torch.uint8).cpu().numpy().tobytes(), digest_size=16).digest()


def made_once(runner, preexisting: set[int]) -> dict[int, tuple]:
    """What the model and runner hold right after the warm-up generation that they did not hold before
    it: {storage key: (weakref to the storage, its digest, where)}. A tensor still there, the same
    storage holding the same bytes after later generations (`constants_kept`), is model state built
    once on the first forward (llm-foundry's MPT builds its ALiBi bias so), not per-generation state."""
    return {storage_key(t): (weakref.ref(t.untyped_storage()), _digest(t), where)
            for where, t in model_state_tensors(runner, preexisting)}


def constants_kept(runner, once: dict, preexisting: set[int]) -> dict[int, tuple[str, torch.Tensor]]:
    """Of `made_once`'s tensors, those the model or runner still hold after the generations, in the same
    storage and unchanged (the later generations ran other tokens: state a generation writes changes)."""
    out = {}
    for where, t in model_state_tensors(runner, preexisting):
        key = storage_key(t)
        ref, digest, _ = once.get(key, (None, None, None))
        if ref is not None and ref() is t.untyped_storage() and _digest(t) == digest:
            out[key] = (where, t)
    return out


def model_state_problem(runner, held: int, pool: dict, preexisting: set[int], slack_per_storage: int,
                        ctx: dict, once: dict | None = None) -> str | None:
    """After every generation ended and its session is gone, the model holds its weights, its
    declared cache pool (`pool`: the storages of the last generations, kept by a target that
    declares Capabilities(cache_pool=True)) and the constants it built once (`once`: `made_once`
    after the warm-up; those still there and unchanged) and nothing else: `held` bytes above the
    level before the warm-up, less those, must be 0 (exact on cpu). Otherwise: what is held, by name."""
    alive = {key: ref() for key, ref in pool.items() if ref() is not None}
    pooled = sum(st.nbytes() for st in alive.values())
    constants = {key: v for key, v in constants_kept(runner, once or {}, preexisting).items() if key not in alive}
    built = sum(t.untyped_storage().nbytes() for _, t in constants.values())
    # one-sided: less is fine (a pool made before this measurement, as when a runner serves several
    # generations, is not counted in `held`; memory freed is not state kept)
    excess = held - pooled - built
    if excess <= slack_per_storage * 4:
        return None
    found = [(where, t) for where, t in model_state_tensors(runner, preexisting)
             if storage_key(t) not in alive and storage_key(t) not in constants]
    named = "; ".join(f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} keeps "
                      f"{t.untyped_storage().nbytes()} bytes" for where, t in found[:6])
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    rest = excess - sum(t.untyped_storage().nbytes() for _, t in found)
    kept = ", ".join(x for x in (f"{pooled} of them the declared cache pool" if pooled else "",
                                 f"{built} of them constants built once and unchanged since the warm-up"
                                 if built else "") if x)
    return (f"memory: after the generations ended and their sessions were deleted, the model and runner hold {held} "
            f"bytes above the level before the warm-up generation{f' ({kept})' if kept else ''}"
            f": {excess} bytes of per-generation state kept on the model or runner. "
            f"{named + more if named else 'No tensor attribute of the model or runner holds them'}"
            f"{f'; {rest:+d} bytes held by nothing found there (a hook, a global?)' if found and rest else ''} "
            f"[{describe(ctx)}]")
