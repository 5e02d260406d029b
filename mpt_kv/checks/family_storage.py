"""The storage accounting the family checks and the generate drive judge a cache by, written once: which
storages the cached tensors reach and whether any pins bytes beyond them (a view of a fused projection's
output, `pinning_problems`), the family's analytic K/V bytes of a session (`analytic_bytes`, `analytic_range`,
a window that may keep its past for a crop), what the cached tensors hold against them (`storage_report`),
the family entry's own check on transformers (`check_entry_bytes`), and where a static buffer's written
positions line up with a concat cache's (`aligned_written`, `token_positions`).
"""

from __future__ import annotations

import torch

from mpt_kv.checks.compare import describe
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.families.base import per_layer

# `c` below is a family check's context (`mpt_kv.checks.family_driver.FamilyContext`: the driver imports this
# module, so the name is read from the annotation only, never imported here)


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


def check_fused_modules(c: FamilyContext, modules) -> None:
    """The family entry describes the model: its fused projection exists once per layer."""
    layers = c.family.layers(c.config)
    if c.family.fused is not None and len(modules) != layers:
        raise RuntimeError(f"family {c.family.name}: expected one `{c.family.fused}` module per layer ({layers}) in "
                           f"{c.implementation}'s model, found {len(modules)}: {[n for n, _ in modules]}")


def cache_tokens(c: FamilyContext, session) -> int:
    """Positions per row the cache holds: written (concat) or the whole preallocated length (static)."""
    return session.max_len if c.session_path == "static" else session.written


def analytic_bytes(c: FamilyContext, session, stored: bool = False) -> int:
    """The family's analytic cache bytes for this session now (`Family.cache_bytes`: per layer its
    window's or the whole history's tokens, its K/V or latent width; static: the cache length; a
    window keeping its past for a crop, from `c.recorded_from`: the most it may hold); stored: what
    transformers' cache holds where the entry declares more (stored_kv_heads, stored_windows, stored_width)."""
    static = session.max_len if c.session_path == "static" else None
    return c.family.cache_bytes(c.config, c.dtype, c.batch, session.written, static, stored=stored,
                                recorded_from=c.recorded_from)


def analytic_range(c: FamilyContext, session, stored: bool = False) -> tuple[int, int]:
    """(least, most) analytic bytes: equal, except while the cache may keep a window's past for a
    crop (`c.recorded_from`, `Family.layer_tokens`): a window that keeps only its w - 1 positions then
    is as right as one that keeps the past a crop rolls back to."""
    static = session.max_len if c.session_path == "static" else None
    least = c.family.cache_bytes(c.config, c.dtype, c.batch, session.written, static, stored=stored)
    return least, analytic_bytes(c, session, stored)


def range_text(least: int, most: int, c: FamilyContext) -> str:
    return (str(most) if least == most else
            f"{least} to {most} (a window may keep its past for a crop from position {c.recorded_from} on)")


def check_entry_bytes(c: FamilyContext, session, kv) -> None:
    """On transformers' implementation, the cache holds the K/V bytes the family entry says
    (`stored_kv_bytes_per_token`): a wrong entry is an error, never a verdict. Counted in the model's
    dtype (its elements): the entry describes the cache's shape; a tensor cached in another dtype is
    family-memory's finding (transformers 4.55's GPT-J caches its rotary keys in fp32 in a bf16 model)."""
    if c.implementation != "transformers":
        return
    tokens = cache_tokens(c, session)
    # elements in the model's dtype: the entry describes the cache's shape (keys cached in another dtype are
    # family-memory's finding, not a wrong entry)
    held = sum(t.numel() for _, _, t in kv) * torch.tensor([], dtype=c.dtype).element_size()
    least, most = analytic_range(c, session, stored=True)
    if not least <= held <= most:
        raise RuntimeError(f"family {c.family.name}: the cache holds {held} bytes of K/V, the family entry says "
                           f"{range_text(least, most, c)} ({c.batch} x {tokens} tokens): fix its "
                           f"kv_heads/head_dim/layers or declare stored_kv_heads [{describe(c.ctx())}]")


def storage_report(c: FamilyContext, kv, fused: dict[str, torch.Tensor], tokens: int,
                   analytic: int | None = None, stored: int | None = None,
                   least: int | None = None) -> tuple[int, int, list[str]]:
    """(bytes of the distinct storages the cache reaches, the analytic bytes, what the excess is: empty
    when the cached tensors hold the analytic bytes, or any in least..analytic, and pin nothing more)."""
    by_storage: dict[int, list] = {}
    for entry in kv:
        by_storage.setdefault(storage_key(entry[2]), []).append(entry)
    total = sum(entries[0][2].untyped_storage().nbytes() for entries in by_storage.values())
    if analytic is None:
        analytic = c.family.kv_bytes_per_token(c.config, c.dtype) * c.batch * tokens
    least = analytic if least is None else least
    own = sum(covered_bytes(es[0][2].untyped_storage().nbytes(), [t for _, _, t in es]) for es in by_storage.values())
    why = []
    if not least <= own <= analytic:
        if stored is None:
            stored = c.family.stored_kv_bytes_per_token(c.config, c.dtype) * c.batch * tokens
        declared = ""
        if own == stored != analytic and c.family.stored_kv_heads is not None:
            declared = (" (the family entry's stored_kv_heads: the heads transformers caches, "
                        f"{per_layer(c.family.layer_kv_heads(c.config, stored=True))} per layer, vs "
                        f"{per_layer(c.family.layer_kv_heads(c.config))} K/V heads)")
        elif own == stored != analytic and c.family.stored_width is not None:
            who = "its remote code" if c.family.remote_code else "transformers"
            declared = (f" (the family entry's stored_width: {who} caches "
                        f"{per_layer(c.family.layer_widths(c.config, stored=True))} elements per token per layer, vs the "
                        f"architecture's {per_layer(c.family.layer_widths(c.config))})")
        elif own == stored != analytic and c.family.stored_windows is not None:
            declared = (" (the family entry's stored_windows: the windows transformers' cache keeps, "
                        f"{c.family.layer_windows(c.config, stored=True)} per layer, vs the architecture's "
                        f"{c.family.layer_windows(c.config)})")
        why.append(f"the cached tensors themselves hold {own} bytes, {own - (analytic if own > analytic else least):+d} "
                   "vs the analytic K/V "
                   f"{range_text(least, analytic, c)} ({c.family.describe_cache(c.config)} x {c.batch} x {tokens} "
                   f"tokens){declared}")
    why += other_dtypes(c, kv)
    why += pinning_problems(kv, fused)
    return total, analytic, why


def other_dtypes(c: FamilyContext, kv) -> list[str]:
    """One line naming the cached tensors held in another dtype than the model's (a bf16 model's keys
    cached in fp32 take twice their analytic bytes)."""
    other = [(layer, n, t) for layer, n, t in kv if t.dtype != c.dtype]
    if not other:
        return []
    names = ", ".join(f"layer {layer} {n}" for layer, n, _ in other[:4]) + (" ..." if len(other) > 4 else "")
    kinds = ", ".join(sorted({str(t.dtype).replace("torch.", "") for _, _, t in other}))
    return [f"{len(other)} cached tensors ({names}) are {kinds} in a {str(c.dtype).replace('torch.', '')} model"]


def aligned_written(static: torch.Tensor, concat: torch.Tensor, written: int) -> tuple[torch.Tensor, int] | None:
    """(the static tensor's written positions in the concat tensor's layout, the position axis):
    the one axis where the static buffer has the cache length and the concat tensor `written`
    (or, same shapes, the last axis of size `written` but the head dim); None where the layouts do
    not line up that way (then only the logits are compared)."""
    if static.dim() != concat.dim():
        return None
    if static.shape == concat.shape:
        axes = [i for i in range(concat.dim() - 1) if concat.shape[i] == written]
        return (static, axes[-1]) if axes else None
    axes = [i for i, (a, b) in enumerate(zip(static.shape, concat.shape)) if a != b]
    if len(axes) != 1 or concat.shape[axes[0]] != written:
        return None
    return static.narrow(axes[0], 0, written), axes[0]


def token_positions(t: torch.Tensor, axis: int, mask: torch.Tensor) -> torch.Tensor | None:
    """A bool mask broadcastable to `t` that is True at real tokens (not padding): its first axis
    is the batch (or batch x heads, as Bloom's (B*H, hd, T) keys), `axis` the positions."""
    batch = mask.shape[0]
    if axis == 0 or t.shape[0] % batch:
        return None
    rows = mask.bool().repeat_interleave(t.shape[0] // batch, 0)  # (t.shape[0], written)
    shape = [1] * t.dim()
    shape[0], shape[axis] = t.shape[0], t.shape[axis]
    return rows.reshape(shape)
