"""The family checks, on any implementation of a family (`mpt_kv.families.implementations`):
each drives the implementation's Runner and Session (prefill, decode, extend, crop, reorder,
kv()) on a tiny model of the family, fp32 by default, CPU, and compares with transformers' own
model of the same weights, uncached (the oracle).

family-P0      the implementation's uncached logits = transformers' uncached logits (not a check
               of transformers itself: its cell is not drawn)
family-P1      a left-padded batch of 2: prefill, 2 greedy decode steps, a 3-token cached call
               (extend) and a decode: after each, the logits = one uncached forward of
               transformers' model over each row's tokens (P2 drives the same calls; P3, P4
               and memory the prefill and 3 decode steps: an extend that crashes is P1's finding)
family-P2      static = concat (implementations with both): the same calls on both paths, their
               logits and, where both layouts are readable, K/V at every written position
family-P3      after the prefill and every call, the storages of the cached tensors (`kv()`) hold
               nothing but them (`covered_bytes`): a view of the fused projection's output pins
               the rest of it; the failure names the module, the layer and the bytes. On the
               static path the preallocated buffers are the cache.
family-P4      outputs are not reused: the logits a call returned are not overwritten by later
               calls (a copy kept, compared after the generation), and no cached K/V tensor
               shares memory with returned logits
family-ops     a fixed beam program (a reorder after each decode: a permutation, then one with a
               repeat) and a fixed assisted program (extend 3, crop back 2, decode, extend 3),
               batch 3: P1 after every operation, the oracle following each row's token history
               through the crops and reorders
family-memory  after the prefill and every call, the bytes of the distinct storages the cache
               reaches = the family's analytic K/V bytes for the tokens written (concat: batch x
               written, static: batch x cache length; MQA/GQA aware), the excess named (with the
               module where a storage is a fused projection's output); after the session is
               deleted, nothing of it stays reachable and the model and runner keep no new tensor

A property that does not hold raises `PropertyFailure` (its message: target, implementation,
family, variant, path, dtype, batch, step, operation, layer, error or bytes). A session call of
the implementation that raises is a PropertyFailure too (generation would crash there), its
exception named, and the steps judged before it that held (the crash rule,
`mpt_kv.checks.compare.Crash`): every step before a crash is judged first (P1: against an uncached
forward over the tokens seen so far; P2: the static path up to the step the concat path crashed
at), so a wrong value there is that step's failure, noting the crash, which a known failure of the
crash does not match; a feature the implementation does not have is `Unsupported` with its reason;
anything else (a model that does not build, a family entry that misdescribes its model) is an
error.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

import torch

from mpt_kv.checks.compare import (NOT_CRASHES, Crash, PropertyFailure, assert_close, crash_of, describe,
                                   judged_before, shares_memory, tolerance)
from mpt_kv.checks import index
from mpt_kv.checks.results import snapshot
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.errors import InputError, Registry, Unsupported
from mpt_kv.families.base import Family
from mpt_kv.families.models import _built, build, cached_kv, config_key, family_of, named_kv  # noqa: F401  (public
# here before families/models.py: build, cached_kv, named_kv)
from mpt_kv.model.config import as_dtype
from mpt_kv.families.implementations import IMPLEMENTATIONS
from mpt_kv.checks.programs import Op
from mpt_kv.checks.programs import History
from mpt_kv.checks.ceilings import model_state_tensors

BATCH, PROMPT, PAD, STEPS, EXTEND = 2, 6, 2, 2, 3  # row 0 has PAD left-padding tokens
MAX_LEN = 16          # every session's cache length: prompt + steps + extend + decode fit
OPS_PADS = (2, 0, 1)  # family-ops: batch 3, each row's left padding
OPS_PROMPT = 8
PATHS = index.FAMILY_PATHS  # the matrix's paths; static+reuse = static, runner reuse_cache=True


def prompt(config, seed: int = 0, pads=(PAD, 0), length: int = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of a left-padded batch: row b starts with pads[b] padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (len(pads), length), generator=g)
    mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    return ids, mask


def teacher_tokens(config, batch: int, k: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1009 + step)
    return torch.randint(1, config.vocab_size, (batch, k), generator=g)


# --- what a check runs on ----------------------------------------------------------------------------------

# Keyed by what they hold, never by a name two models can share (a fork of a port is a Family copy
# under the port's name): the implementation's builder and the Family object itself (by identity,
# the entry keeping it alive so its id is not reused), and the transformers config.
_runners: dict = {}   # (builder, id(family), variant, dtype, options) -> (family, Runner), per process
_oracles: dict = {}   # (config, dtype) -> transformers' model (fp32)


def clear_caches() -> None:
    _runners.clear()
    _oracles.clear()
    _built.clear()


def implementation_name(implementation) -> str:
    if isinstance(implementation, str):
        return implementation
    return getattr(implementation, "implementation_name", None) or getattr(implementation, "__name__", "custom")


def runner_for(implementation, family: Family, variant: str, dtype: torch.dtype, options: dict):
    """The implementation's runner, built once per process for a named one and this Family object
    (a callable, as the tests' broken wrappers, is built every time)."""
    if not isinstance(implementation, str):
        return implementation(family, variant, dtype, seed=0, **options)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}: implementations {sorted(IMPLEMENTATIONS)}")
    builder = IMPLEMENTATIONS[implementation]
    key = (builder, id(family), variant, dtype, tuple(sorted(options.items())))
    if key not in _runners:
        _runners[key] = (family, builder(family, variant, dtype, seed=0, **options))
    return _runners[key][1]


def oracle_model(family: Family, variant: str, dtype: torch.dtype):
    """transformers' model with the same weights, in fp32 (bf16: from the bf16-rounded weights);
    for a remote-code family, the port's own model so, driven uncached as its runner drives it."""
    key = (config_key(family.config(variant)), dtype)
    if key not in _oracles:
        model, config = build(family, variant)
        if dtype != torch.float32:
            model.to(dtype).to(torch.float32)
        if family.remote_code:
            from mpt_kv.families.gaudi import GaudiPortRunner, set_generation_settings

            set_generation_settings(model, family.gaudi.generation)
            model = GaudiPortRunner(family, variant, model, config)
        _oracles[key] = model
    return _oracles[key]


@dataclass
class Case:
    """One check of one implementation of one family variant on one path."""

    implementation: str
    family: Family
    variant: str
    path: str           # the matrix's path: concat, static, static+reuse
    dtype: torch.dtype
    runner: object
    config: object
    batch: int = BATCH
    notes: list = field(default_factory=list)
    check: str = ""     # the check id, first in a failed call's message

    @property
    def session_path(self) -> str:
        return "static" if self.path.startswith("static") else "concat"

    def ctx(self, **more) -> dict:
        return dict(target=f"{self.implementation}/{self.family.name}", implementation=self.implementation,
                    family=self.family.name, variant=self.variant, path=self.path,
                    dtype=str(self.dtype).replace("torch.", ""), batch=self.batch, **more)

    def tol(self, quantity: str):
        return tolerance(self.dtype, quantity)

    def oracle(self, ids, mask) -> torch.Tensor:
        """transformers' uncached forward (fp32) over the tokens."""
        model = oracle_model(self.family, self.variant, self.dtype)
        with torch.inference_mode():
            if self.family.remote_code:  # the port's runner: its uncached forward as generate calls it
                return model.logits(ids, mask).float()
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()

    def session(self, path: str | None = None, max_len: int = MAX_LEN):
        path = path or self.session_path
        self.runner.require(path)
        return self.runner.session(path, max_len)

    def fused_modules(self):
        own = getattr(self.runner, "fused_modules", None)
        return own() if callable(own) else self.family.fused_modules(self.runner.model)


def case_of(implementation, family, variant: str, path: str, dtype=torch.float32, check: str = "") -> Case:
    if path not in PATHS:
        raise InputError(f"unknown path {path!r}: the family paths are {PATHS}")
    dtype = as_dtype(dtype)
    family = family_of(family)
    options = {"reuse_cache": True} if path == "static+reuse" else {}
    runner = runner_for(implementation, family, variant, dtype, options)
    return Case(implementation_name(implementation), family, variant, path, dtype, runner, family.config(variant),
                check=check)


def call(c: Case, what: str, step, operation: str, fn, *args):
    """One call of the implementation; one that raises fails the property with its exception named
    (the crash rule, `mpt_kv.checks.compare.Crash`; mpt-kv's own InputError and Unsupported pass
    through)."""
    try:
        out = fn(*args)
    except NOT_CRASHES:
        raise
    except Exception as e:  # noqa: BLE001  the implementation's own call crashed
        prefix = "" if what.startswith("family-") else f"{c.check} "
        raise crash_of(f"{prefix}{what}", "the implementation", operation, e,
                       c.ctx(step=step, operation=operation)) from e
    return out


def copy_of(logits):
    """The copy rule (`mpt_kv.checks.results.snapshot`), for what a family call returns."""
    return None if logits is None else snapshot(logits)


# --- the program P1, P2, P3, P4 and memory drive -------------------------------------------------------------

@dataclass
class Step:
    name: str           # "prefill", "decode step 1", "extend 3", ...
    operation: str      # prefill | decode | extend
    logits: torch.Tensor  # as returned: (B, S, V), (B, V) or (B, k, V)


def drive(c: Case, session, on_step, tokens_from=None, extend: bool = False, judges: bool = True) -> list[Step]:
    """Prefill the left-padded prompt, then STEPS greedy decodes, an EXTEND-token cached call and
    a decode (extend=True: P1 and P2, where the implementation declares extend), or STEPS + 1
    greedy decodes (P3, P4, memory: an extend that crashes is P1's finding, not three more).
    `on_step(step, session, seq, mask)` after each (seq, mask: every row's tokens so far).
    `tokens_from(step)`: the logits the next greedy token comes from (default: this session's last).
    A call that crashes (`Crash`) ends the drive; with `judges` (on_step judges each step as it
    comes) the crash names the steps before it, which on_step judged and which held; a check whose
    on_step only records (P1) judges those itself first (`judged_before`)."""
    extend = extend and c.runner.capabilities.reason("extend") is None
    steps: list[Step] = []
    try:
        return _drive(c, session, on_step, tokens_from, extend, steps)
    except Crash as crash:
        raise crash.held([s.name for s in steps]) if judges and steps else crash


def _drive(c: Case, session, on_step, tokens_from, extend: bool, steps: list[Step]) -> list[Step]:
    ids, mask = prompt(c.config)
    first = Step("prefill", "prefill", call(c, "prefill", "prefill", "prefill", session.prefill, ids, mask))
    seq = ids
    on_step(first, session, seq, mask)
    steps.append(first)  # after on_step: `steps` are the steps on_step saw through
    plan = [("decode", 1)] * STEPS + ([("extend", EXTEND), ("decode", 1)] if extend else [("decode", 1)])
    for i, (op, k) in enumerate(plan, 1):
        if op == "decode":
            last = steps[-1].logits if tokens_from is None else tokens_from(i)
            last = last[:, -1] if last.dim() == 3 else last
            tokens = last.argmax(-1, keepdim=True)
            name = f"decode step {i}"
            logits = call(c, name, name, "decode", session.decode, tokens)
        else:
            tokens = teacher_tokens(c.config, c.batch, k, i)
            name = f"extend {k} (step {i})"
            logits = call(c, name, name, "extend", session.extend, tokens)
        seq = torch.cat([seq, tokens], 1)
        mask = torch.cat([mask, torch.ones_like(tokens)], 1)
        step = Step(name, op, logits)
        on_step(step, session, seq, mask)
        steps.append(step)
    return steps


def last_positions(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, None] if logits.dim() == 2 else logits


# --- family-P0 ----------------------------------------------------------------------------------------------

def check_uncached(implementation, family, variant: str, path: str = "concat", dtype=torch.float32) -> list[str]:
    """family-P0: the implementation's uncached forward = transformers' over the same weights."""
    if implementation_name(implementation) == "transformers":
        raise InputError("family-P0 compares an implementation with transformers' own model: transformers "
                         "itself is its oracle, not a case")
    c = case_of(implementation, family, variant, path, dtype, "family-P0")
    ids, mask = prompt(c.config)
    with torch.inference_mode():
        got = copy_of(call(c, "family-P0", "uncached", "logits", c.runner.logits, ids, mask))
    assert_close(got, c.oracle(ids, mask), c.tol("logits:uncached"),
                 "family-P0 uncached logits vs transformers' uncached forward (same weights)",
                 c.ctx(step="uncached", operation="logits"), where=mask.bool()[:, :, None])
    return c.notes


# --- family-P1 ----------------------------------------------------------------------------------------------

def check_cached(implementation, family, variant: str, path: str = "concat", dtype=torch.float32) -> list[str]:
    """family-P1 (module doc)."""
    c = case_of(implementation, family, variant, path, dtype, "family-P1")
    tol = c.tol(f"logits:{c.session_path}")
    got: list[tuple[Step, torch.Tensor, int]] = []  # (step, its logits copied, positions written after it)
    final = {}

    def keep(step: Step, session, seq, mask):
        got.append((step, last_positions(copy_of(step.logits)), seq.shape[1]))
        final.update(seq=seq, mask=mask)

    def judge():
        if not got:
            return
        mask = final["mask"]
        # causal: one uncached forward over the final tokens (after a crash: the tokens seen so
        # far) is every step's oracle
        full = c.oracle(final["seq"], mask)
        for step, logits, end in got:
            k = logits.shape[1]
            where = mask.bool()[:, end - k:end, None] if step.operation == "prefill" else None
            assert_close(logits, full[:, end - k:end], tol,
                         f"family-P1 {step.name}: cached logits vs transformers' uncached forward over each row's "
                         "tokens", c.ctx(step=step.name, operation=step.operation), where=where)

    lacks_extend = c.runner.capabilities.reason("extend")
    try:
        with torch.inference_mode():
            drive(c, c.session(), keep, extend=True, judges=False)
    except Crash as crash:  # the steps before it are compared first: a wrong value there is the verdict
        judged_before(crash, judge, [step.name for step, _, _ in got])
    judge()
    if lacks_extend:
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: the k-token cached call: {lacks_extend} "
                          "(the prefill and the decode steps held)")
    return c.notes


# --- family-P2 ----------------------------------------------------------------------------------------------

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


def check_static_concat(implementation, family, variant: str, path: str = "static", dtype=torch.float32) -> list[str]:
    """family-P2 (module doc): greedy tokens from the concat path, fed to both."""
    c = case_of(implementation, family, variant, path, dtype, "family-P2")
    if c.session_path != "static":
        raise InputError(f"family-P2 compares the static path with the concat path: give path static or "
                         f"static+reuse, not {path!r}")
    c.runner.require("concat", "static")
    concat_steps: dict[str, tuple[Step, list]] = {}  # step name -> (its logits copied, its K/V copied)

    def record(step: Step, session, seq, mask):
        kv = [(layer, n, t.clone()) for layer, n, t in named_kv(session.kv())]
        concat_steps[step.name] = (Step(step.name, step.operation, copy_of(step.logits)), kv)

    compared = []

    class PastTheRecord(Exception):
        """The static path reached the step the concat path crashed at: nothing to compare it with."""

    def compare(step: Step, session, seq, mask):
        if step.name not in concat_steps:
            raise PastTheRecord(step.name)
        ref, theirs = concat_steps[step.name]
        ctx = c.ctx(step=step.name, operation=step.operation)
        got, want = last_positions(copy_of(step.logits)), last_positions(ref.logits)
        where = mask.bool()[:, -got.shape[1]:, None] if step.operation == "prefill" else None
        assert_close(got, want, c.tol("logits:static"), f"family-P2 {step.name}: static-path logits vs the concat "
                     "path's", ctx, where=where)
        ours = named_kv(session.kv())
        if len(ours) != len(theirs):
            return
        windows = c.family.layer_windows(c.config)
        for (layer, n, t), (_, n2, ref_t) in zip(ours, theirs):
            if layer < len(windows) and windows[layer] is not None:
                continue  # a window's slots are not the written positions: its logits are compared
            aligned = aligned_written(t, ref_t, seq.shape[1]) if n == n2 else None
            real = None if aligned is None else token_positions(ref_t, aligned[1], mask)
            if real is None:
                continue
            compared.append((layer, n))
            # padding positions are not compared: their K/V beyond layer 0 come from fully masked
            # queries, which each path may treat its own way
            assert_close(aligned[0].clone(), ref_t, c.tol("kv:static"), f"family-P2 {step.name}: static-path cached "
                         f"{n} of layer {layer} at the written token positions vs the concat path's",
                         {**ctx, "layer": layer}, where=real)

    def static_drive():
        names = list(concat_steps)  # the static path is fed the concat path's greedy tokens
        drive(c, c.session("static"), compare, tokens_from=lambda i: concat_steps[names[i - 1]][0].logits,
              extend=True)

    def judge_recorded():  # the concat path crashed: the static path's steps it recorded are compared
        try:
            static_drive()
        except Crash as crash:
            if crash.ctx.get("step") in concat_steps:
                raise
        except PastTheRecord:
            pass

    lacks_extend = c.runner.capabilities.reason("extend")
    with torch.inference_mode():
        try:
            drive(c, c.session("concat"), record, extend=True, judges=False)
        except Crash as crash:
            judged_before(crash, judge_recorded, list(concat_steps))
        static_drive()
    if not compared:
        c.notes.append("family-P2: the static and concat K/V layouts do not line up: logits compared only")
    if lacks_extend:
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: the k-token cached call: {lacks_extend} "
                          "(the prefill and the decode steps held)")
    return c.notes


# --- family-P3 ----------------------------------------------------------------------------------------------

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


def check_fused_modules(c: Case, modules) -> None:
    """The family entry describes the model: its fused projection exists once per layer."""
    layers = c.family.layers(c.config)
    if c.family.fused is not None and len(modules) != layers:
        raise RuntimeError(f"family {c.family.name}: expected one `{c.family.fused}` module per layer ({layers}) in "
                           f"{c.implementation}'s model, found {len(modules)}: {[n for n, _ in modules]}")


def cache_tokens(c: Case, session) -> int:
    """Positions per row the cache holds: written (concat) or the whole preallocated length (static)."""
    return session.max_len if c.session_path == "static" else session.written


def analytic_bytes(c: Case, session) -> int:
    """The family's analytic cache bytes for this session now (`Family.cache_bytes`: per layer its
    window's or the whole history's tokens, its K/V or latent width; static: the cache length)."""
    static = session.max_len if c.session_path == "static" else None
    return c.family.cache_bytes(c.config, c.dtype, c.batch, session.written, static)


def check_entry_bytes(c: Case, session, kv) -> None:
    """On transformers' implementation, the cache holds the K/V bytes the family entry says
    (`stored_kv_bytes_per_token`): a wrong entry is an error, never a verdict."""
    if c.implementation != "transformers":
        return
    tokens = cache_tokens(c, session)
    held = sum(t.numel() * t.element_size() for _, _, t in kv)
    static = session.max_len if c.session_path == "static" else None
    expected = c.family.cache_bytes(c.config, c.dtype, c.batch, session.written, static, stored=True)
    if held != expected:
        raise RuntimeError(f"family {c.family.name}: the cache holds {held} bytes of K/V, the family entry says "
                           f"{expected} ({c.batch} x {tokens} tokens): fix its kv_heads/head_dim/layers or "
                           f"declare stored_kv_heads [{describe(c.ctx())}]")


def check_no_pinned_storage(implementation, family, variant: str, path: str = "concat",
                            dtype=torch.float32) -> list[str]:
    """family-P3 (module doc)."""
    c = case_of(implementation, family, variant, path, dtype, "family-P3")
    modules = c.fused_modules()
    check_fused_modules(c, modules)
    capture = FusedCapture(modules)

    def inspect(step: Step, session, seq, mask):
        kv = named_kv(session.kv())
        check_entry_bytes(c, session, kv)
        problems = pinning_problems(kv, capture.outputs)
        if problems:
            raise PropertyFailure(f"family-P3 cache pins storage after {step.name}: " + "; ".join(problems)
                                  + f" [{describe(c.ctx(step=step.name, operation=step.operation))}]")

    try:
        with torch.inference_mode():
            drive(c, c.session(), inspect)
    finally:
        capture.close()
    return c.notes


# --- family-P4 ----------------------------------------------------------------------------------------------

def check_outputs_not_reused(implementation, family, variant: str, path: str = "concat",
                             dtype=torch.float32) -> list[str]:
    """family-P4 (module doc). A runner that declares Capabilities(graph_outputs=True) returns
    buffers a later call overwrites on purpose (graph replays): only the K/V aliasing is checked."""
    c = case_of(implementation, family, variant, path, dtype, "family-P4")
    returned: list[tuple[Step, torch.Tensor]] = []

    def keep(step: Step, session, seq, mask):
        returned.append((step, copy_of(step.logits)))
        for layer, n, t in named_kv(session.kv()):
            for earlier, _ in returned:
                if shares_memory(t, earlier.logits):
                    raise PropertyFailure(
                        f"family-P4 after {step.name}: the cached {n} {tuple(t.shape)} of layer {layer} shares memory "
                        f"with the logits {tuple(earlier.logits.shape)} returned by {earlier.name} "
                        f"[{describe(c.ctx(step=step.name, operation=step.operation, layer=layer))}]")

    with torch.inference_mode():
        drive(c, c.session(), keep)
    if c.runner.capabilities.graph_outputs:
        c.notes.append("family-P4: graph_outputs declared: returned logits may be overwritten by later calls")
        return c.notes
    for step, kept in returned:
        if not torch.equal(step.logits, kept):
            diff = (step.logits.float() - kept.float()).abs().max().item()
            raise PropertyFailure(f"family-P4: the logits {tuple(kept.shape)} returned by {step.name} were "
                                  f"overwritten by a later call (max abs change {diff:.3e}): a caller that keeps "
                                  f"them (generate's scores, a beam's history) reads another step's values "
                                  f"[{describe(c.ctx(step=step.name, operation=step.operation))}]")
    return c.notes


# --- family-ops ---------------------------------------------------------------------------------------------

def beam_program():
    ops = []
    for index in ((2, 0, 1), (1, 1, 0)):
        ops += [Op("decode"), Op("reorder", index=index)]
    return "beam", ("reorder",), ops + [Op("decode")]


def assisted_program():
    return "assisted", ("extend", "crop"), [Op("extend", 3), Op("crop", 2), Op("decode"), Op("extend", 3)]


def run_program(c: Case, name: str, ops) -> None:
    """One fixed program on a fresh session: P1 after every logits-producing operation."""
    ids, mask = prompt(c.config, pads=OPS_PADS, length=OPS_PROMPT)
    tol = c.tol(f"logits:{c.session_path}")
    session = c.session()
    history = History(ids, mask)
    out = copy_of(call(c, f"family-ops {name}", "prefill", "prefill", session.prefill, ids, mask))
    assert_close(out, c.oracle(ids, mask), tol, f"family-ops {name} prefill logits vs transformers' uncached forward",
                 c.ctx(program=name, step="prefill", operation="prefill"), where=mask.bool()[:, :, None])
    held = ["prefill"]  # each step is judged as it comes: a crash names those before it
    try:
        program_steps(c, name, ops, session, history, tol, held)
    except Crash as crash:
        raise crash.held(held)


def program_steps(c: Case, name: str, ops, session, history, tol, held: list) -> None:
    for i, op in enumerate(ops):
        what = f"family-ops {name} step {i} ({op.describe()})"
        tokens = teacher_tokens(c.config, c.batch, op.k, i) if op.kind in ("decode", "extend") else None
        if op.kind == "decode":
            out = last_positions(copy_of(call(c, what, i, "decode", session.decode, tokens)))
        elif op.kind == "extend":
            out = copy_of(call(c, what, i, "extend", session.extend, tokens))
        elif op.kind == "crop":
            out = call(c, what, i, "crop", session.crop, session.written - op.k)
        else:
            out = call(c, what, i, "reorder", session.reorder, torch.tensor(op.index))
        history.apply(op, tokens)
        if out is not None:
            full = c.oracle(history.ids, history.mask)
            assert_close(out, full[:, -op.k:], tol, f"{what}: logits vs transformers' uncached forward over each "
                         f"row's surviving history ({history.ids.shape[1]} positions)",
                         c.ctx(program=name, step=i, operation=op.kind))
            held.append(f"step {i} ({op.describe()})")  # a crop or reorder is judged by the next logits call


def check_operations(implementation, family, variant: str, path: str = "concat", dtype=torch.float32) -> list[str]:
    """family-ops (module doc). A program whose operation the implementation lacks is Unsupported
    with its reason, after the other program ran: never a pass."""
    c = case_of(implementation, family, variant, path, dtype, "family-ops")
    c.batch = len(OPS_PADS)
    unsupported = []
    for name, needs, ops in (beam_program(), assisted_program()):
        reasons = [r for r in (c.runner.capabilities.reason(f) for f in needs) if r]
        if reasons:
            unsupported.append(f"{name} program: {'; '.join(reasons)}")
            continue
        try:
            with torch.inference_mode():
                run_program(c, name, ops)
        except Unsupported as e:
            unsupported.append(f"{name} program: {e.msg}")
    if unsupported:
        ran = "" if len(unsupported) == 2 else " (the other program ran and held)"
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: " + " | ".join(unsupported) + ran)
    return c.notes


# --- family-memory ------------------------------------------------------------------------------------------

def storage_report(c: Case, kv, fused: dict[str, torch.Tensor], tokens: int,
                   analytic: int | None = None, stored: int | None = None) -> tuple[int, int, list[str]]:
    """(bytes of the distinct storages the cache reaches, the analytic bytes, what the excess is)."""
    by_storage: dict[int, list] = {}
    for entry in kv:
        by_storage.setdefault(storage_key(entry[2]), []).append(entry)
    total = sum(entries[0][2].untyped_storage().nbytes() for entries in by_storage.values())
    if analytic is None:
        analytic = c.family.kv_bytes_per_token(c.config, c.dtype) * c.batch * tokens
    own = sum(covered_bytes(es[0][2].untyped_storage().nbytes(), [t for _, _, t in es]) for es in by_storage.values())
    why = []
    if own != analytic:
        if stored is None:
            stored = c.family.stored_kv_bytes_per_token(c.config, c.dtype) * c.batch * tokens
        declared = ""
        if own == stored != analytic and c.family.stored_kv_heads is not None:
            declared = (" (the family entry's stored_kv_heads: the heads transformers caches, "
                        f"{c.family.stored_kv_heads(c.config)} per layer, vs {c.family.kv_heads(c.config)} K/V heads)")
        elif own == stored != analytic and c.family.stored_width is not None:
            declared = (" (the family entry's stored_width: transformers caches "
                        f"{c.family.layer_width(c.config, stored=True)} elements per token per layer, vs the "
                        f"architecture's {c.family.layer_width(c.config)})")
        elif own == stored != analytic and c.family.stored_windows is not None:
            declared = (" (the family entry's stored_windows: the windows transformers' cache keeps, "
                        f"{c.family.layer_windows(c.config, stored=True)} per layer, vs the architecture's "
                        f"{c.family.layer_windows(c.config)})")
        why.append(f"the cached tensors themselves hold {own} bytes, {own - analytic:+d} vs the analytic K/V "
                   f"{analytic} ({c.family.describe_cache(c.config)} x {c.batch} x {tokens} tokens){declared}")
    why += pinning_problems(kv, fused)
    return total, analytic, why


def cache_evidence(implementation, family, variant: str, path: str = "concat", dtype=torch.float32) -> dict:
    """What shows the implementation keeps a cache on this path (the green-run rule,
    `mpt_kv.checks.running.cache_evidence`): after a prefill, the distinct storages of `kv()` hold at
    least the family's analytic K/V of the tokens written, and a second `kv()` returns the same ones."""
    c = case_of(implementation, family, variant, path, dtype, "cache-evidence")
    ids, mask = prompt(c.config)
    with torch.inference_mode():
        session = c.session()
        session.prefill(ids, mask)
        first = named_kv(session.kv())
        again = named_kv(session.kv())  # `first` still alive: a recomputed tensor cannot take its storage's address
    storages = {storage_key(t): t.untyped_storage().nbytes() for _, _, t in first}
    held, written = sum(storages.values()), session.written
    analytic = analytic_bytes(c, session)
    where = f"after a prefill of {c.batch} x {written} tokens on {path}, {str(c.dtype).replace('torch.', '')}:"
    if held < analytic:
        return {"shown": False, "why": f"{where} the cache's storages hold {held} bytes, less than the family's "
                                       f"analytic K/V of the prefilled tokens ({analytic} bytes): no cache is kept"}
    if set(storages) != {storage_key(t) for _, _, t in again}:
        return {"shown": False, "why": f"{where} a second kv() returned other storages than the first: K/V made "
                                       "at each read (recomputed from the tokens?), not kept"}
    return {"shown": True, "why": f"{where} the cache's storages hold {held} bytes (analytic K/V {analytic}), the "
                                  "same at a second kv()"}


def warm_up(c: Case) -> None:
    """A prefill and a decode before measuring: state a model builds lazily once (rotary tables,
    cached masks, a cache pool) is made here, not counted as kept by the measured generation."""
    ids, mask = prompt(c.config)
    with torch.inference_mode():
        session = c.session()
        logits = call(c, "family-memory warm-up", "warm-up", "prefill", session.prefill, ids, mask)
        call(c, "family-memory warm-up", "warm-up", "decode", session.decode, logits[:, -1].argmax(-1, keepdim=True))
    del session, logits
    gc.collect()


def check_memory(implementation, family, variant: str, path: str = "concat", dtype=torch.float32) -> list[str]:
    """family-memory (module doc)."""
    c = case_of(implementation, family, variant, path, dtype, "family-memory")
    modules = c.fused_modules()
    check_fused_modules(c, modules)
    gc.freeze()  # what existed before the check out of its gc.collect()s (measured: 0.26 s each -> ms)
    try:
        return measured_memory(c, modules)
    finally:
        gc.unfreeze()


def measured_memory(c: Case, modules) -> list[str]:
    warm_up(c)
    # held to the end: a storage's key is its StorageImpl's address, which a freed one hands on (a
    # model that keeps its last cache frees the warm-up's when the measured generation replaces it, and
    # the new cache's storage could take its address and pass as pre-existing)
    held_before = [t for _, t in model_state_tensors(c.runner, set())]
    before = {storage_key(t) for t in held_before}
    capture = FusedCapture(modules)
    storages: dict[int, tuple[weakref.ref, str]] = {}

    def measure(step: Step, session, seq, mask):
        kv = named_kv(session.kv())
        tokens = cache_tokens(c, session)
        static = session.max_len if c.session_path == "static" else None
        total, analytic, why = storage_report(c, kv, capture.outputs, tokens, analytic_bytes(c, session),
                                              c.family.cache_bytes(c.config, c.dtype, c.batch, session.written,
                                                                   static, stored=True))
        for layer, n, t in kv:  # the latest storage at an address (a freed one's address is reused)
            storages[storage_key(t)] = (weakref.ref(t.untyped_storage()), f"layer {layer} {n}")
        if total != analytic:
            raise PropertyFailure(f"family-memory after {step.name}: the cache's distinct storages hold {total} "
                                  f"bytes, the family's analytic K/V for {c.batch} x {tokens} tokens {analytic}: "
                                  f"{total - analytic:+d} bytes; " + "; ".join(why)
                                  + f" [{describe(c.ctx(step=step.name, operation=step.operation))}]")

    try:
        with torch.inference_mode():
            session = c.session()
            drive(c, session, measure)
    finally:
        capture.close()
    pool = c.runner.capabilities.cache_pool
    del session
    gc.collect()
    alive = {key: (ref(), where) for key, (ref, where) in storages.items() if ref() is not None}
    kept = [(where, t) for where, t in model_state_tensors(c.runner, before) if not (pool and storage_key(t) in alive)]
    if pool:
        c.notes.append(f"family-memory: cache_pool declared: {len(alive)} cache storages kept for the next generation")
        alive = {}
    if alive or kept:
        found = "; ".join(f"{where} {tuple(t.shape)} keeps {t.untyped_storage().nbytes()} bytes"
                          for where, t in kept[:6])
        lost = sum(st.nbytes() for st, _ in alive.values())
        raise PropertyFailure(
            f"family-memory after the session was deleted: {len(alive)} storages the cache held "
            f"({lost} bytes: {', '.join(sorted(w for _, w in alive.values())[:4])}) are still alive"
            f"{'; ' if alive and kept else ''}{'the model or runner keeps ' + found if kept else ''}"
            + ("" if kept or not alive else "; no tensor attribute of the model or runner holds them")
            + f" [{describe(c.ctx(step='after the session'))}]")
    return c.notes


# property -> its function, as the index names them (`CHECKS["family-P3"](implementation, family,
# variant, path)`: the family checks' own calling form; `mpt_kv.CHECKS["family-P3/concat"](target)` runs
# the same function on a FamilyTarget through the run layer)
CHECKS = Registry("family check id", {p.name: globals()[p.function.split(":")[1]]
                                      for p in index.PROPERTIES if p.family})
