"""The properties every implementation must hold, as plain functions (pytest and the kill
matrix both call them). Each raises `PropertyFailure` naming target, device, dtype, shapes,
step and layer; each returns notes (e.g. near-ties in greedy decoding) for the report.

P0 oracle               uncached logits equal the reference's
P1 cached = uncached    every decode step equals a full forward over the same tokens
P2 static = concat      cache contents and logits agree; never-written slots do not leak
P3 no aliasing          no cached K/V shares storage with mixed_qkv or pins extra bytes
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from mpt_kv.checks.compare import TOLERANCES, TOLERANCES_KV, PropertyFailure, assert_close, describe
from mpt_kv.model.config import ModelConfig
from mpt_kv.model.session import Session
from mpt_kv.checks.storages import covered_bytes, storage_key  # P3

POISON = 1e30  # large and finite: a NaN would spread through 0 * v even where masked (FACTS.md)


@contextlib.contextmanager
def fresh_memory_holds_nan():
    """Make `torch.empty` (and friends) return NaN-filled floats while a check runs.

    Fresh memory may hold anything, NaN bit patterns included (on HPU and CUDA it holds what
    the last user left). A cache slot that is attended before it is written, even masked,
    turns 0 * NaN into NaN in the second matmul. Filling deterministically makes that a
    reproducible failure instead of one that depends on the allocator's history."""
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}

    def nan_filled(original):
        def alloc(*args, **kwargs):
            t = original(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return alloc

    try:
        for name, original in originals.items():
            setattr(torch, name, nan_filled(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)


@dataclass(frozen=True)
class Case:
    """One drawn input: a model shape, a left-padded batch of prompts, tokens to generate."""

    cfg: ModelConfig
    prompt_lens: tuple[int, ...]
    new_tokens: int
    seed: int = 0

    def __post_init__(self):
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError(f"prompt_lens={self.prompt_lens}: every row needs at least 1 token")
        if self.total_len > self.cfg.max_seq_len:
            raise ValueError(f"prompt {self.prompt_len} + new {self.new_tokens} = {self.total_len} "
                             f"exceeds max_seq_len={self.cfg.max_seq_len}")

    @property
    def batch(self) -> int:
        return len(self.prompt_lens)

    @property
    def prompt_len(self) -> int:
        return max(self.prompt_lens)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.new_tokens

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) ids and mask, rows shorter than S left-padded (mask 0)."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, self.cfg.vocab_size, (self.batch, self.prompt_len), generator=g)
        mask = torch.zeros(self.batch, self.prompt_len, dtype=torch.long)
        for b, n in enumerate(self.prompt_lens):
            mask[b, self.prompt_len - n:] = 1
        return ids.to(device), mask.to(device)

    def describe(self) -> str:
        c = self.cfg
        return (f"B={self.batch} prompt_lens={list(self.prompt_lens)} new={self.new_tokens} H={c.n_heads} "
                f"hd={c.head_dim} L={c.n_layers} clip_qkv={c.clip_qkv} max_seq_len={c.max_seq_len} seed={self.seed}")


@dataclass
class Context:
    target: str
    device: str
    dtype: torch.dtype
    case: Case
    path: str | None = None
    bucket: int | None = None
    notes: list[str] = field(default_factory=list)

    def tol(self):
        return TOLERANCES[self.dtype]

    def tol_kv(self):
        return TOLERANCES_KV[self.dtype]

    def ctx(self, **more) -> dict:
        base = dict(target=self.target, device=self.device, dtype=str(self.dtype).replace("torch.", ""),
                    path=self.path, bucket=self.bucket, case=self.case.describe())
        return {**base, **more}


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1, keepdim=True)  # (B, 1)


# --- P0 -----------------------------------------------------------------------------------------
def check_oracle(runner, reference, c: Context) -> None:
    ids, mask = c.case.inputs(c.device)
    with torch.inference_mode():
        got, want = runner.logits(ids, mask), reference.logits(ids, mask)
    assert_close(got, want, c.tol(), "P0 uncached logits vs reference", c.ctx(shape=tuple(ids.shape)),
                 where=mask.bool()[:, :, None])


# --- P1 -----------------------------------------------------------------------------------------
def check_cached_equals_uncached(runner, c: Context) -> list[str]:
    ids, mask = c.case.inputs(c.device)
    with torch.inference_mode(), fresh_memory_holds_nan():
        session = runner.session(c.path, c.case.total_len, c.bucket)
        cached, full = session.prefill(ids, mask), runner.logits(ids, mask)
        assert_close(cached, full, c.tol(), "P1 prefill logits vs full forward",
                     c.ctx(step="prefill"), where=mask.bool()[:, :, None])
        last, full = cached[:, -1], full[:, -1]  # the next token's logits, cached and uncached
        for step in range(c.case.new_tokens):
            token = greedy(last)
            check_token(token, greedy(full), full, c, step)
            ids = torch.cat([ids, token], dim=1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            last, full = session.decode(token), runner.logits(ids, mask)[:, -1]
            assert_close(last, full, c.tol(), "P1 decode logits vs full forward",
                         c.ctx(step=step, tokens_so_far=ids.shape[1]))
    return c.notes


def check_token(cached, uncached, full_logits, c: Context, step) -> None:
    """Greedy tokens must match, unless the uncached top two are within tolerance (a tie)."""
    for b in (cached != uncached).flatten().nonzero().flatten().tolist():
        top2 = full_logits[b].float().topk(2).values
        gap = (top2[0] - top2[1]).item()
        if gap <= c.tol().bound(full_logits[b]):
            c.notes.append(f"near-tie at step {step}, row {b}: top-2 logits {gap:.2e} apart [{describe(c.ctx())}]")
        else:
            raise PropertyFailure(f"P1 greedy token differs at step {step}, row {b}: cached {int(cached[b])} vs "
                                  f"uncached {int(uncached[b])}, top-2 gap {gap:.3e} [{describe(c.ctx())}]")


# --- P2 -----------------------------------------------------------------------------------------
def check_static_equals_concat(runner, c: Context) -> list[str]:
    ids, mask = c.case.inputs(c.device)
    n = c.case.total_len
    with torch.inference_mode(), fresh_memory_holds_nan():
        concat, static = runner.session("concat", n), runner.session("static", n, c.bucket)
        a, b = concat.prefill(ids, mask), static.prefill(ids, mask)
        poison_unwritten(static)
        compare_step(a, b, concat, static, c, "prefill", where=mask.bool()[:, :, None])
        for step in range(c.case.new_tokens):
            token = greedy(a[:, -1] if a.dim() == 3 else a)
            a, b = concat.decode(token), static.decode(token)
            compare_step(a, b, concat, static, c, step)
    return c.notes


def poison_unwritten(static: Session) -> None:
    """Fill slots no token has reached yet: a step that lets them through is caught."""
    for k, v in static.kv():
        k[:, :, static.written:] = POISON
        v[:, :, static.written:] = POISON


def compare_step(concat_logits, static_logits, concat, static, c: Context, step, where=None) -> None:
    assert_close(static_logits, concat_logits, c.tol(), "P2 static vs concat logits", c.ctx(step=step), where=where)
    t = concat.written
    # (B, 1, t, 1) real tokens only: padding K/V from layer 1 on are built from all-masked
    # query rows, whose output depends on how many slots each path masked
    real = concat.mask[:, :t].bool()[:, None, :, None]
    for layer, ((ck, cv), (sk, sv)) in enumerate(zip(concat.kv(), static.kv())):
        for name, x, y in (("key", sk, ck), ("value", sv, cv)):
            assert_close(x[:, :, :t], y, c.tol_kv(), f"P2 static vs concat cached {name}s at written positions [0, {t})",
                         c.ctx(step=step, layer=layer), where=real)


# --- P3 -----------------------------------------------------------------------------------------
class WqkvCapture:
    """Holds each layer's latest `Wqkv` output (mixed_qkv) until the next check, so its memory
    cannot be reused by a later allocation and fake an overlap."""

    def __init__(self, modules):
        self.outputs: list[torch.Tensor | None] = [None] * len(modules)
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(modules)]

    def _hook(self, i):
        def hook(module, args, output):
            self.outputs[i] = output
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        self.outputs = []


@dataclass
class CacheStorage:
    """One storage the cached tensors live in, as seen after one step."""

    storage: torch.UntypedStorage  # held: its identity cannot pass to a new storage while P3 compares steps
    tensors: list[tuple[int, str, torch.Tensor]]  # (layer, "key"/"value", tensor)
    made_at: object       # the step after which it first held cached tensors
    persisted: bool       # it already held cached tensors at the previous step
    covered: int = 0      # bytes of it the cached tensors reach

    @property
    def pinned(self) -> int:
        return self.storage.nbytes() - self.covered

    def names(self) -> str:
        parts = [f"layer {layer} {name} {tuple(t.shape)}" for layer, name, t in self.tensors]
        return " and ".join(parts) if len(parts) <= 4 else ", ".join(parts[:3]) + f" and {len(parts) - 3} more"

    def sizes(self) -> str:
        return (f"its storage holds {self.storage.nbytes()} bytes, the cached tensors in it {self.covered}: "
                f"{self.pinned} bytes pinned beyond the cache")


def cache_storages(kv, step, previous: dict[int, CacheStorage]) -> dict[int, CacheStorage]:
    """The storages of every layer's cached key and value, by identity, with the bytes they cover."""
    now: dict[int, CacheStorage] = {}
    for layer, pair in enumerate(kv):
        for name, t in zip(("key", "value"), pair):
            key = storage_key(t)
            if key not in now:
                before = previous.get(key)
                now[key] = CacheStorage(t.untyped_storage(), [], before.made_at if before else step, before is not None)
            now[key].tensors.append((layer, name, t))
    for st in now.values():
        st.covered = covered_bytes(st.storage.nbytes(), [t for _, _, t in st.tensors])
    return now


def aliasing_problems(kv, captured, previous: dict[int, CacheStorage] | None = None, step="prefill",
                      last: bool = True) -> tuple[list[str], dict[int, CacheStorage]]:
    """What the cached keys and values keep alive besides the cache, after `step`.

    - a storage that is a layer's mixed_qkv (the `Wqkv` output captured at this step): bad, always;
    - a storage whose every byte a cached tensor reaches is the cache's own allocation: fine (one
      tensor each, K and V stacked in one buffer, all layers in one buffer);
    - a storage with bytes no cached tensor reaches is fine if it persists from step to step (a
      preallocated cache with room to spare, a pool), bad if it was made at one step and is gone at
      the next (a view of a per-step temporary) or made at the last step (nothing shows it persists).

    Returns (problems, this step's storages): pass the latter back as `previous` for the next step."""
    previous = previous or {}
    now = cache_storages(kv, step, previous)
    qkv = {storage_key(t): (layer, t) for layer, t in enumerate(captured) if t is not None}
    problems = []
    for key, st in now.items():
        if key in qkv:
            layer, t = qkv[key]
            verb = "are views" if len(st.tensors) > 1 else "is a view"
            problems.append(f"{st.names()} {verb} of layer {layer}'s mixed_qkv {tuple(t.shape)}: {st.sizes()}")
        elif st.pinned and not st.persisted and last:
            problems.append(f"{st.names()} {'live' if len(st.tensors) > 1 else 'lives'} in a buffer made at the last "
                            f"step ({step}) that the cache does not fill: {st.sizes()} (no later step shows it to be "
                            "the cache's own, persisting allocation)")
    for key, st in previous.items():
        if st.pinned and not st.persisted and key not in now:
            problems.append(f"{st.names()} {'were views' if len(st.tensors) > 1 else 'was a view'} of a per-step "
                            f"temporary, made at step {st.made_at} and gone after the next: {st.sizes()}")
    return problems, now


def check_no_aliasing(runner, c: Context) -> None:
    """P3: after the prefill and every decode step, the cached K/V keep nothing alive besides the
    cache (`aliasing_problems`): no view of mixed_qkv, no view of a per-step temporary."""
    ids, mask = c.case.inputs(c.device)
    capture = WqkvCapture(runner.wqkv_modules())
    try:
        with torch.inference_mode():
            session = runner.session(c.path, c.case.total_len, c.bucket)
            logits = session.prefill(ids, mask)[:, -1]
            steps, storages = ["prefill", *range(c.case.new_tokens)], {}
            for step in steps:
                if step != "prefill":
                    logits = session.decode(greedy(logits))
                problems, storages = aliasing_problems(session.kv(), capture.outputs, storages, step,
                                                       last=step == steps[-1])
                if problems:
                    raise PropertyFailure(f"P3 cache aliasing after step {step}: " + "; ".join(problems)
                                          + f" [{describe(c.ctx(step=step))}]")
    finally:
        capture.close()
