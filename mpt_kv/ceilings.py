"""Memory ceilings: what one generation may hold, measured on every target, path and device.

    m = measure(runner, case, path, device)          # one generation under the device's meter
    m.problems                                       # the analytic properties it broke, if any
    check_memory(runner, context)                    # the same, raising PropertyFailure (kill matrix)

Bytes are counted above the level before the generation (weights and inputs already exist),
with `mpt_kv.meter` (cpu: exact live storages; cuda/hpu: allocator statistics). Notation as in
`mpt_kv.memory`: B batch, L cache length, n layers, H heads, hd head dim, s itemsize;
KV(L) = 2 * n * B * H * L * hd * s (`memory.kv_cache_bytes`).

Two kinds of limit, combined like this:

1. Analytic properties (`measure` -> `problems`), for any case, with no stored number. The
   kill matrix runs only these (its cases and variant names have no stored ceilings).
   - retained: after prefill and after every decode step, the bytes still allocated equal
     KV(L) plus the session's bookkeeping, L the length the path keeps (concat: the tokens so
     far; static: the preallocated length). Bookkeeping is what the session protocol says a
     session holds besides K/V: its attention mask (`Session.mask`) and 0-/1-element tensors
     (counters such as transformers' `cumulative_length`), found by walking the session's
     attributes. Exact on cpu (to the byte); within the allocator's rounding elsewhere
     (`ROUNDING`). A cache that keeps K/V as views of `mixed_qkv` pins the q third: exactly
     n * B * S * D * s too many after prefill, reported per layer with the storage's size.
   - static decode: a step's peak above what was allocated before it is at most
     `decode_bound`: one layer's transients at q = 1 (`memory.layer_transients`, times
     `TRANSIENT_SLACK`), the step's logits and its masks. None of it is proportional to the
     cache, so it holds at any sequence length; a step that copies the cache does not fit.
   - concat decode: the same plus KV(L + 1): the new cache may coexist with the old one
     (`torch.cat` while the old tensors are referenced: per layer in the reference, the whole
     cache in optimum-habana's tuple cache, the transformers issue in shared/seeds/), but
     nothing beyond one old and one new cache.
   - returned: after the session is deleted, allocation is back to the level before it
     (nothing leaks across steps or calls).

2. Stored ceilings (`Baseline`), for the config table `CONFIGS` only: per device kind a JSON
   file (`baselines/ceilings-<kind>.json`) maps a key (target and its implementing package's
   version, path, dtype, batch, max input, max new, model shape) to the measured `METRICS`.
   A run fails where a measurement exceeds its ceiling (cpu: by one byte; allocator devices:
   by more than `CEILING_SLACK`) or where the entry is missing; a lower measurement passes
   and says the ceiling can be tightened. `pytest --update-ceilings` rewrites the entries
   that ran and prints the diff; writing a higher value (loosening) also needs
   `--allow-looser-ceilings`. A missing or corrupt file is an error, never a pass.
   The versions are in the key because a different transformers is a different
   implementation (4.55 keeps views, 5.x does not); torch's version is only recorded.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import nn

from . import memory
from .compare import PropertyFailure, describe
from .config import ModelConfig
from .meter import Meter, meter_for
from .properties import Case, Context

# --- the config table --------------------------------------------------------------------------------

# Tiny MPT: hd = 32 makes one layer's K+V (2*B*H*L*hd*s) larger than its score chain
# (B*H*L*(s+8)), so a decode step that copies a layer's cache stands out from the transients.
SHAPE = ModelConfig(d_model=128, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=96)


@dataclass(frozen=True)
class MemoryConfig:
    """One row of the seed PR's table: batch size, max input tokens, max new tokens."""

    batch: int
    max_input: int
    max_new: int
    cfg: ModelConfig = SHAPE

    @property
    def id(self) -> str:
        return f"B{self.batch}-in{self.max_input}-new{self.max_new}"

    def case(self) -> Case:
        # every row a full prompt: the seed's "max input tokens" is the padded length
        return Case(self.cfg, (self.max_input,) * self.batch, self.max_new, seed=0)


# The seed's four rows, scaled down (lengths / 16 or / 32, batches / 8): a large batch with
# short sequences, a long generation, a long prompt, and both large.
CONFIGS = (
    MemoryConfig(16, 8, 8),
    MemoryConfig(2, 8, 32),
    MemoryConfig(2, 32, 32),
    MemoryConfig(4, 32, 32),
)

# --- limits ---------------------------------------------------------------------------------------------

# Allocator rounding per live storage (bytes): cuda rounds every block up to 512 bytes; the
# HPU allocator's granularity is not documented publicly, 4 KiB is an assumption (unchecked here).
ROUNDING = {"cpu": 0, "cuda": 512, "hpu": 4096}
# Eager code keeps more temporaries alive than the idealised count of `memory.layer_transients`
# (e.g. `scores / sqrt(hd)`, `+ alibi` and `masked_fill` each make a score-sized copy).
TRANSIENT_SLACK = 2


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def shape_of(cfg: ModelConfig) -> memory.Shape:
    return memory.Shape(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len)


def decode_bound(cfg: ModelConfig, batch: int, length: int, s: int, path: str) -> int:
    """Most a decode step may allocate above what was allocated before it (see module doc)."""
    shape = shape_of(cfg)
    transients = TRANSIENT_SLACK * memory.layer_transients(shape, batch, 1, length, s, softmax_itemsize=4)
    logits = memory.logits_bytes(shape, batch, 1, trim=True, itemsize=s) * 2  # + an fp32 copy
    masks = batch * length * (2 * 8 + 4 + 1) + length  # old + new int64 mask, a float and a bool mask
    cache = memory.kv_cache_bytes(shape, batch, length, s) if path == "concat" else 0
    return transients + logits + masks + cache


# --- measuring one generation ----------------------------------------------------------------------


@dataclass
class Measurement:
    """One generation's memory, in bytes above the level before it."""

    target: str
    target_version: str
    device: str  # kind: cpu | cuda | hpu
    dtype: str  # "float32" | "bfloat16"
    path: str
    bucket: int | None
    batch: int
    max_input: int
    max_new: int
    cfg: dict  # ModelConfig fields
    weights: int  # parameters and buffers of the model (reported, not measured)
    prefill_retained: int  # allocated after prefill, its logits dropped
    decode_transient: int  # max over steps of (peak during the step - allocated before it)
    allocated: int  # after the last step, cache alive ("Memory allocated")
    max_allocated: int  # peak over the whole generation ("Max memory allocated")
    returned: int  # after the session is deleted (0: nothing leaked)
    kv_bytes: int  # live storages of session.kv() after the last step
    kv_analytic: int  # KV(L) after the last step
    problems: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in METRICS}


# What the baseline stores and bounds per config.
METRICS = ("prefill_retained", "decode_transient", "allocated", "max_allocated")


def target_version(target: str) -> str:
    """The versions of the packages that implement a built-in target ('' for the reference)."""
    packages = {"transformers": ("transformers",), "optimum-habana": ("optimum-habana", "transformers")}
    out = []
    for p in packages.get(target, ()):
        try:
            out.append(f"{p} {'.'.join(version(p).split('.')[:2])}")
        except PackageNotFoundError:
            out.append(f"{p} ?")
    return ", ".join(out)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def session_tensors(session) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the session references through attributes, lists, tuples and dicts, with its
    path ('session.cache.kv[0][1]'); models and runners are not entered (they hold the weights)."""
    from .targets import Runner

    out, seen = [], set()
    skip = (nn.Module, Runner, type, str, bytes, int, float, bool, torch.device, torch.dtype)

    def walk(x, where, depth):
        if isinstance(x, torch.Tensor):
            out.append((where, x))
            return
        if x is None or isinstance(x, skip) or depth == 0 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, dict):
            items = [(f"{where}[{k!r}]", v) for k, v in x.items()]
        elif isinstance(x, (list, tuple)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(x)]
        elif hasattr(x, "__dict__") and not callable(x):
            items = [(f"{where}.{k}", v) for k, v in vars(x).items()]
        else:
            return
        for w, v in items:
            walk(v, w, depth - 1)

    walk(session, "session", 8)
    return out


def span_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Accounting:
    """What holds the bytes allocated at one point of a generation."""

    kv_storages: dict[int, tuple[int, list[tuple[int, str, torch.Tensor]]]]  # key -> (bytes, [(layer, name, t)])
    bookkeeping: dict[int, tuple[str, int]]  # key -> (where, bytes): the mask, counters
    others: dict[int, tuple[str, torch.Tensor]]  # tensors the session keeps that are neither

    @property
    def kv_total(self) -> int:
        return sum(b for b, _ in self.kv_storages.values())

    @property
    def bookkeeping_total(self) -> int:
        return sum(b for _, b in self.bookkeeping.values())


def account(session, preexisting: set[int]) -> Accounting:
    """Sort the storages a session holds into K/V, bookkeeping and others. Storages that
    existed before the generation (inputs, weights) are not part of its allocation."""
    kv: dict = {}
    for layer, (k, v) in enumerate(session.kv()):
        for name, t in (("key", k), ("value", v)):
            key = storage_key(t)
            if key not in preexisting:
                kv.setdefault(key, (t.untyped_storage().nbytes(), []))[1].append((layer, name, t))
    mask_key = storage_key(session.mask) if isinstance(session.mask, torch.Tensor) else None
    bookkeeping, others = {}, {}
    for where, t in session_tensors(session):
        key = storage_key(t)
        if key in kv or key in preexisting or key in bookkeeping or key in others:
            continue
        if key == mask_key or t.numel() <= 1:
            bookkeeping[key] = (where, t.untyped_storage().nbytes())
        else:
            others[key] = (where, t)
    return Accounting(kv, bookkeeping, others)


def explain_excess(acc: Accounting, excess: int, expected_kv: int, cfg: ModelConfig, batch: int) -> str:
    """Where the bytes beyond KV + bookkeeping are: per layer, per session attribute, or elsewhere."""
    parts = []
    kv_extra = acc.kv_total - expected_kv
    if kv_extra:
        for nbytes, tensors in acc.kv_storages.values():
            own = sum(span_bytes(t) for _, _, t in tensors)
            if nbytes > own:
                names = " and ".join(f"layer {layer} {name} {tuple(t.shape)}" for layer, name, t in tensors)
                T = nbytes // (batch * 3 * cfg.d_model * tensors[0][2].element_size() or 1)
                fused = batch * T * 3 * cfg.d_model * tensors[0][2].element_size()
                what = (f"the size of mixed_qkv ({batch}, {T}, {3 * cfg.d_model}): views of it pin the q third"
                        if fused == nbytes else "a view of a larger buffer")
                parts.append(f"{names} live in a storage of {nbytes} bytes, {nbytes - own} more than "
                             f"they hold ({what})")
        if not parts:
            parts.append(f"the cache storages hold {acc.kv_total} bytes, the KV cache is {expected_kv} "
                         f"({kv_extra:+d}: a cache of another length or layout)")
    for where, t in acc.others.values():
        parts.append(f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} keeps "
                     f"{t.untyped_storage().nbytes()} bytes")
    rest = excess - kv_extra - sum(t.untyped_storage().nbytes() for _, t in acc.others.values())
    if rest:
        parts.append(f"{rest:+d} bytes held by nothing the session references (the model, a hook, a global?)")
    return "; ".join(parts)


_checked_meters: set[str] = set()


def checked_meter(device: torch.device) -> Meter:
    """The device's meter, self-checked once per process: a meter reading 0 must not pass."""
    meter = meter_for(device)
    if str(device) not in _checked_meters:
        meter.self_check(device)
        _checked_meters.add(str(device))
    return meter


def weights_bytes(model: nn.Module) -> int:
    storages = {storage_key(t): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def decode_tokens(case: Case, device) -> torch.Tensor:
    """(new, B, 1) token ids fed at each step. Memory does not depend on which tokens, so they
    are drawn up front (outside the measurement) instead of argmax'ed from the logits."""
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randint(0, case.cfg.vocab_size, (case.new_tokens, case.batch, 1), generator=g).to(device)


def measure(runner, case: Case, path: str, device, dtype: torch.dtype, bucket: int | None = None,
            target: str | None = None) -> Measurement:
    """Run one generation (prefill, `case.new_tokens` decode steps, delete the session) under the
    device's meter and check the analytic properties (module doc) at every point."""
    import gc

    device = torch.device(device)
    target = target or runner.name
    cfg, B, s = case.cfg, case.batch, itemsize(dtype)
    ctx = dict(target=target, device=device.type, dtype=str(dtype).replace("torch.", ""), path=path,
               bucket=bucket, case=case.describe())
    meter = checked_meter(device)
    ids, mask = case.inputs(device)
    tokens = decode_tokens(case, device)
    preexisting = {storage_key(t) for t in [ids, mask, tokens, *runner.model.parameters(), *runner.model.buffers()]}
    slack_per_storage = ROUNDING.get(device.type, 4096)
    problems: dict[str, str] = {}  # property -> first failure

    def expected_len(written: int) -> int:
        return written if path == "concat" else case.total_len

    def check_retained(session, phase: str, allocated: int) -> int:
        L = expected_len(session.written)
        kv = memory.kv_cache_bytes(shape_of(cfg), B, L, s)
        acc = account(session, preexisting)
        excess = allocated - kv - acc.bookkeeping_total
        slack = slack_per_storage * (len(acc.kv_storages) + len(acc.bookkeeping) + 2)
        if abs(excess) > slack and "retained" not in problems:
            problems["retained"] = (
                f"memory: after {phase}, {allocated} bytes allocated, {excess} bytes "
                f"{'too many' if excess > 0 else 'too few'} (allowed {slack}: allocator rounding): expected the KV "
                f"cache {kv} bytes (2 x {cfg.n_layers} layers x B {B} x H {cfg.n_heads} x L {L} x hd "
                f"{cfg.head_dim} x {s} bytes) + {acc.bookkeeping_total} bytes of bookkeeping (the session's mask "
                f"and counters). {explain_excess(acc, excess, kv, cfg, B)} [{describe(ctx)}]")
        return acc.kv_total

    gc.freeze()  # pre-existing objects out of the meter's gc.collect(): 400 ms -> microseconds
    try:
        with torch.inference_mode(), meter:
            warm_up(runner, path, case, bucket, ids, mask, tokens)
            meter.reset_peak()
            base = meter.allocated()
            session = runner.session(path, case.total_len, bucket)
            session.prefill(ids, mask)  # logits dropped at once
            prefill_retained = meter.allocated() - base
            max_allocated = meter.peak() - base
            kv_bytes = check_retained(session, "prefill", prefill_retained)
            allocated, transient = prefill_retained, 0
            for step in range(case.new_tokens):
                L = expected_len(session.written)
                meter.reset_peak()
                session.decode(tokens[step])
                peak = meter.peak() - base
                step_transient = peak - allocated
                allocated = meter.allocated() - base
                transient, max_allocated = max(transient, step_transient), max(max_allocated, peak)
                kv_bytes = check_retained(session, f"decode step {step}", allocated)
                bound = decode_bound(cfg, B, L + (path == "concat"), s, path)
                if step_transient > bound and "decode" not in problems:
                    problems["decode"] = (
                        f"memory: {path} decode step {step} peaked {step_transient} bytes above the "
                        f"{allocated} allocated before it, {step_transient - bound} bytes too many: the bound "
                        f"is {bound} ({decode_bound_text(cfg, B, L + (path == 'concat'), s, path)}) "
                        f"[{describe(ctx)}]")
            del session
            returned = meter.allocated() - base
            if abs(returned) > slack_per_storage * 4:
                problems["returned"] = (
                    f"memory: after the session was deleted, {returned} bytes are still allocated above the "
                    f"level before the generation: they leak across steps and calls [{describe(ctx)}]")
    finally:
        gc.unfreeze()
    L = expected_len(case.total_len)
    return Measurement(
        target=target, target_version=target_version(target), device=device.type, dtype=ctx["dtype"],
        path=path, bucket=bucket, batch=B, max_input=case.prompt_len, max_new=case.new_tokens,
        cfg=asdict(cfg), weights=weights_bytes(runner.model), prefill_retained=prefill_retained,
        decode_transient=transient, allocated=allocated, max_allocated=max_allocated, returned=returned,
        kv_bytes=kv_bytes, kv_analytic=memory.kv_cache_bytes(shape_of(cfg), B, L, s),
        problems=list(problems.values()))


def warm_up(runner, path, case, bucket, ids, mask, tokens) -> None:
    """A prefill and one decode step before measuring: lazily built state (kernel workspaces,
    cached constants) is made once here, not counted as a leak of the measured call."""
    session = runner.session(path, case.total_len, bucket)
    session.prefill(ids, mask)
    if case.new_tokens:
        session.decode(tokens[0])


def decode_bound_text(cfg, batch, length, s, path) -> str:
    shape = shape_of(cfg)
    lt = memory.layer_transients(shape, batch, 1, length, s, softmax_itemsize=4)
    text = (f"{TRANSIENT_SLACK} x one layer's transients {lt} at q=1, kv={length} + logits and masks")
    if path == "concat":
        text += f" + the new cache KV({length}) {memory.kv_cache_bytes(shape, batch, length, s)} next to the old one"
    return text


def check_memory(runner, c: Context) -> None:
    """The analytic memory properties (module doc) for one case and path: PropertyFailure if any fails."""
    m = measure(runner, c.case, c.path or "concat", c.device, c.dtype, c.bucket, target=c.target)
    if m.problems:
        raise PropertyFailure(" | ".join(m.problems))
