"""What the family checks (`mpt_kv.checks.family`) run on, written once beside them: the family's
tiny model and prompt, the implementation's runner and transformers' model of the same weights
(the oracle), each cached by what it holds, one check's `FamilyContext`, the crash rule for an
implementation's call, and the drive of a generation (family-ops' fixed beam and assisted programs:
`mpt_kv.checks.family_programs`; the storage accounting the checks judge: `mpt_kv.checks.family_storage`).

    runner = runner_for(implementation, family, variant, dtype, options, device)   # built once per process
    c = context_of(implementation, family, variant, path, dtype, check, device)    # what a check reads
    check(runner, c)                                                               # every family check

The run layer (`mpt_kv.checks.running`) builds both for every family check, as it builds an MPT
check's runner and Context.

The device (as the MPT checks'): the implementation's runner is built on the case's device and dtype,
and every input it is fed (prompts, teacher tokens, reorder indices) is made there (`FamilyContext.
inputs`); its sessions wait for queued work after each call (`mpt_kv.devices.sync`: on HPU
`htcore.mark_step()` in lazy mode, as for the MPT runners), and every comparison reads both tensors on
CPU (`compare.assert_close`). The oracle is transformers' model in fp32 on CPU (in bf16: from the
bf16-rounded weights, the fp32-twin rule's rounding, `mpt_kv.checks.cases.fp32_twin`), fed the same
tokens there: exact to fp32 and the cheapest place to run it. Only a remote-code family whose port
cannot run off an HPU (`GaudiPort.needs_hpu`: its oracle is the port itself) has its oracle on the
case's device.

The caches are keyed by what they hold, never by a name two models can share (a fork of a port is
a Family copy under the port's name): the implementation's builder and the Family object itself (by
identity, the entry keeping it alive so its id is not reused), the variant, dtype and options; the
oracle by the transformers config and dtype.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import torch

from mpt_kv import recipes
from mpt_kv.checks import index, reach
from mpt_kv.checks.compare import NOT_CRASHES, Crash, crash_of, tolerance
from mpt_kv.checks.results import snapshot
from mpt_kv.checks.family_storage import analytic_bytes
from mpt_kv.checks.storages import storage_key
from mpt_kv.errors import InputError, Unsupported
from mpt_kv.families.base import Family
from mpt_kv.families.implementations import IMPLEMENTATIONS
from mpt_kv.families.models import _built, build, config_key, family_of, named_kv
from mpt_kv.model.config import as_dtype
from mpt_kv.versions import with_attention

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


# Keyed by what they hold, never by a name two models can share (a fork of a port is a Family copy
# under the port's name): the implementation's builder and the Family object itself (by identity,
# the entry keeping it alive so its id is not reused), and the transformers config.
_runners: dict = {}   # (builder, id(family), variant, dtype, device, seed, options) -> (family, Runner), per process
_oracles: dict = {}   # (config, dtype, device, seed) -> transformers' model (fp32)


def clear_caches() -> None:
    _runners.clear()
    _oracles.clear()
    _built.clear()


def implementation_name(implementation) -> str:
    if isinstance(implementation, str):
        return implementation
    return getattr(implementation, "implementation_name", None) or getattr(implementation, "__name__", "custom")


def runner_for(implementation, family: Family, variant: str, dtype: torch.dtype, options: dict, device="cpu",
               seed: int = 0):
    """The implementation's runner on `device`, with the weights of `seed` (the checks': 0; the
    calibration draws others), built once per process for a named one and this Family object (a
    callable, as the tests' broken wrappers, is built every time). A builder takes `device=` (the
    built-in ones: `mpt_kv.families.implementations`)."""
    device = torch.device(device)
    if not isinstance(implementation, str):
        return implementation(family, variant, dtype, seed=seed, device=device, **options)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r}: implementations {sorted(IMPLEMENTATIONS)}")
    builder = IMPLEMENTATIONS[implementation]
    key = (builder, id(family), variant, dtype, str(device), seed, tuple(sorted(options.items())))
    if key not in _runners:
        _runners[key] = (family, builder(family, variant, dtype, seed=seed, device=device, **options))
    return _runners[key][1]


def oracle_device(family: Family, device) -> torch.device:
    """Where the oracle runs: CPU (transformers' model in fp32 runs anywhere, and there it is exact and
    cheapest), except for a remote-code family whose port, its own oracle, cannot run off an HPU
    (`GaudiPort.needs_hpu`): the case's device."""
    device = torch.device(device)
    if family.remote_code and family.gaudi is not None and family.gaudi.needs_hpu:
        return device
    return torch.device("cpu")


def oracle_model(family: Family, variant: str, dtype: torch.dtype, device="cpu", seed: int = 0):
    """transformers' model with the same weights (`seed`'s), in fp32 (bf16: from the bf16-rounded
    weights), on `oracle_device(family, device)`, with eager attention whatever the target's
    (`implementations.ORACLE_ATTENTION`: the attention written out in the model file, which every family
    has); for a remote-code family, the port's own model so, driven uncached as its runner drives it."""
    where = oracle_device(family, device)
    key = (config_key(family.config(variant)), dtype, str(where), seed)
    if key not in _oracles:
        model, config = build(family, variant, seed)
        if dtype != torch.float32:
            model.to(dtype).to(torch.float32)
        model.to(where)
        if family.remote_code:
            from mpt_kv.families.gaudi import GaudiPortRunner, set_generation_settings

            set_generation_settings(model, family.gaudi.generation)
            model = GaudiPortRunner(family, variant, model, config, device=where)
        _oracles[key] = model
    return _oracles[key]


@dataclass
class FamilyContext:
    """Where a family check runs, for its messages, and what it compares with: one implementation of
    one family variant on one path (the family checks' `Context`; the runner comes beside it)."""

    implementation: str
    family: Family
    variant: str
    path: str           # the matrix's path: concat, static, static+reuse
    dtype: torch.dtype
    config: object
    batch: int = BATCH
    notes: list = field(default_factory=list)
    check: str = ""     # the check id, first in a failed call's message
    reach: reach.FamilyReach | None = None  # what the program reaches, where the run layer records it
    # where the drive's cache keeps its past for a crop from (its first k-token call, then each crop):
    # a window layer may hold more until a crop (`Family.layer_tokens`); None: no k-token call yet
    recorded_from: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where the implementation runs
    seed: int = 0       # the weights' and the prompt's (the checks': 0; `calibrate families` draws others)
    attention: str | None = None  # transformers' attention implementation of the target (None: the builder's)

    @property
    def session_path(self) -> str:
        return "static" if self.path.startswith("static") else "concat"

    @property
    def options(self) -> dict:
        """The runner's options for this path (static+reuse: the static path with reuse_cache; a recipe's
        path: that recipe, mpt_kv/recipes.py)."""
        recipe = recipes.recipe_of(self.path)
        if recipe is not None:
            return {"recipe": recipe.name}
        return ({"reuse_cache": True} if self.path == "static+reuse" else {}) | (
            {"attention": self.attention} if self.attention else {})

    @property
    def pads(self) -> tuple[int, ...]:
        """Each row's left padding in this check's prefill: family-ops' programs OPS_PADS; family-P1's drive
        none where the attention skips the mask without padding (`unpadded_p1`); every other drive (PAD, 0)."""
        if self.check == "family-ops":
            return OPS_PADS
        return (0,) * BATCH if unpadded_p1(self) else (PAD, 0)

    def ctx(self, **more) -> dict:
        implementation = with_attention(self.implementation, self.attention)
        return dict(target=f"{implementation}/{self.family.name}", implementation=implementation,
                    family=self.family.name, variant=self.variant, path=self.path, device=self.device.type,
                    dtype=str(self.dtype).replace("torch.", ""), batch=self.batch, **more)

    def tol(self, quantity: str):
        return tolerance(self.dtype, quantity)

    def inputs(self, *tensors: torch.Tensor):
        """The tensors on the implementation's device (the prompt and teacher tokens are drawn on CPU,
        the same on every device); one tensor, or a tuple of them."""
        moved = tuple(t.to(self.device) for t in tensors)
        return moved[0] if len(moved) == 1 else moved

    def oracle(self, ids, mask) -> torch.Tensor:
        """transformers' uncached forward (fp32) over the tokens, on `oracle_device` (CPU)."""
        model = oracle_model(self.family, self.variant, self.dtype, self.device, self.seed)
        where = oracle_device(self.family, self.device)
        ids, mask = ids.to(where), mask.to(where)
        with torch.inference_mode():
            if self.family.remote_code:  # the port's runner: its uncached forward as generate calls it
                return model.logits(ids, mask).float().cpu()
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().cpu()

    def session(self, runner, path: str | None = None, max_len: int = MAX_LEN):
        path = path or self.session_path
        runner.require(path)
        return runner.session(path, max_len)

    def fused_modules(self, runner):
        own = getattr(runner, "fused_modules", None)
        return own() if callable(own) else self.family.fused_modules(runner.model)


def context_of(implementation, family, variant: str, path: str, dtype=torch.float32, check: str = "",
               device="cpu", seed: int = 0, attention: str | None = None) -> FamilyContext:
    """The context of one family check (the run layer's `Run.family_case`; its runner: `runner_for`)."""
    if path not in PATHS:
        raise InputError(f"unknown path {path!r}: the family paths are {PATHS}")
    dtype = as_dtype(dtype)
    family = family_of(family)
    return FamilyContext(implementation_name(implementation), family, variant, path, dtype, family.config(variant),
                         check=check, device=torch.device(device), seed=seed,
                         attention=attention)


# The attention implementations whose mask transformers skips where no row is padded, calling the kernel
# with is_causal (or none) instead: sdpa (masking_utils.py `_ignore_causal_mask_sdpa`, 5.24.0 lines 289-293:
# no padding and one query, or as many queries as keys; 4.55.4 modeling_attn_mask_utils.py
# `_ignore_causal_mask_sdpa`). The eager path always builds the mask.
MASK_SKIPPED = ("sdpa", "flash_attention_2")


def unpadded_p1(c: FamilyContext) -> bool:
    """family-P1 drives a batch with no padding where the target's attention skips the mask there
    (MASK_SKIPPED): the path a single prompt's generation takes (the prefill with is_causal, the decode
    steps with no mask, the k-token call with the mask built at an offset: where a cache misaligns
    is_causal). Every other drive keeps row 0 left-padded (family-ops, P2, P3, P4, memory), so the
    padded mask of the same attention is checked there."""
    return c.attention in MASK_SKIPPED and c.check == "family-P1"


def call(c: FamilyContext, what: str, step, operation: str, fn, *args):
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


def observed(c: FamilyContext, session, operation: str, count: int | None, what: str, step, fn, *args):
    """`call` of one of the program's session calls, followed for the case's reach (`c.reach`, where
    the run layer records it): the call's own size (prefill: the prompt's positions; decode, extend:
    its new tokens per row; crop: the length cropped to) and after it the position axis of each
    tensor the cache's kv() holds (read for their shapes only, none kept)."""
    if c.reach is None:
        return call(c, what, step, operation, fn, *args)
    c.reach.calling(operation, count)
    out = call(c, what, step, operation, fn, *args)
    try:
        kv = [(layer, tuple(t.shape)) for layer, _, t in named_kv(session.kv())]
    except Exception as e:  # noqa: BLE001  reach never changes a verdict: the record says the cache was unreadable
        kv, c.reach.unreadable = None, f"kv() after {operation} raised {type(e).__name__}: {e}"
    c.reach.called(operation, count, kv)
    return out


def reach_of(c: FamilyContext) -> reach.FamilyReach:
    """An empty record of `c`'s case: its fixed knobs, the windows and latent of its model's config."""
    config, family = c.config, c.family
    head_dim = family.head_dim(config)
    if family.latent_width is not None:  # multi-head latent attention: a query/key head is nope + rope wide
        head_dim = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0) or head_dim
    knobs = dict(family=family.name, implementation=c.implementation, attention=c.attention or "-",
                 padded_rows=sum(1 for n in c.pads if n), variant=c.variant, path=c.path,
                 dtype=str(c.dtype).replace("torch.", ""), device=c.device.type, n_layers=family.layers(config),
                 n_heads=config.num_attention_heads, kv_heads=reach.per_layer_text(family.layer_kv_heads(config)),
                 head_dim=head_dim)
    latent = getattr(config, "kv_lora_rank", None) if family.latent_width is not None else None
    return reach.FamilyReach(knobs, family.layer_windows(config), latent, head_dim)


def router_modules(model) -> list[tuple[torch.nn.Module, int | None]]:
    """(router, its top_k) of a mixture-of-experts model: transformers 5.x's `*TopKRouter` modules,
    or a `gate` / `router` module of a block that has `top_k` (4.x's plain Linear gates)."""
    out = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if type(module).__name__.lower().endswith("router") or last in ("gate", "router"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            top_k = getattr(module, "top_k", None) or getattr(parent, "top_k", None)
            if top_k is not None:
                out.append((module, top_k))
    return out


@contextlib.contextmanager
def routing_observed(runner, c: FamilyContext):
    """While a case runs, each router of the implementation's model reports the tokens it routed (its
    input's), its experts (its weight's rows) and experts per token (its indices' last axis, else its
    top_k)."""
    model = getattr(runner, "model", None)
    if c.reach is None or not isinstance(model, torch.nn.Module):
        yield
        return

    def hook(top_k):
        def on_route(module, args, output):
            hidden = args[0] if args and torch.is_tensor(args[0]) else None
            weight = getattr(module, "weight", None)
            if hidden is None or not torch.is_tensor(weight) or weight.dim() != 2:
                return
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            indices = [t for t in outputs if torch.is_tensor(t) and not t.is_floating_point() and t.dim() >= 1]
            # the router's own weight (experts x hidden) and input (the tokens it routes), in every release
            c.reach.routed(hidden.numel() // hidden.shape[-1], weight.shape[0],
                           indices[0].shape[-1] if indices else top_k)
        return on_route

    handles = [m.register_forward_hook(hook(k)) for m, k in router_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def copy_of(logits):
    """The copy rule (`mpt_kv.checks.results.snapshot`), for what a family call returns."""
    return None if logits is None else snapshot(logits)


@dataclass
class Step:
    name: str           # "prefill", "decode step 1", "extend 3", ...
    operation: str      # prefill | decode | extend
    logits: torch.Tensor  # as returned: (B, S, V), (B, V) or (B, k, V)


def drive(runner, c: FamilyContext, session, on_step, tokens_from=None, extend: bool = False,
          judges: bool = True, operations: bool = False) -> list[Step]:
    """Prefill the left-padded prompt, then STEPS greedy decodes, an EXTEND-token cached call and
    a decode (extend=True: P1 and P2, where the implementation declares extend), or STEPS +
    `closing_decodes(c)` greedy decodes (P3, P4, memory: an extend that crashes is P1's finding, not
    three more). `operations` (P3, memory): then an EXTEND-token call, a crop back CROP positions and a
    decode (`closing_operations`), the cache judged after the k-token call and after the decode that
    follows the crop (a crop is judged by the next call, as family-ops judges it); one the
    implementation lacks, or that raises or is refused, ends the drive with a note: its crash is
    family-P1's finding (a k-token call) or family-ops' (a crop), whose drives make them.
    `on_step(step, session, seq, mask)` after each (seq, mask: every row's tokens so far).
    `tokens_from(step)`: the logits the next greedy token comes from (default: this session's last).
    A call that crashes (`Crash`) ends the drive; with `judges` (on_step judges each step as it
    comes) the crash names the steps before it, which on_step judged and which held; a check whose
    on_step only records (P1) judges those itself first (`judged_before`)."""
    extend = extend and runner.capabilities.reason("extend") is None
    lacks = {op: runner.capabilities.reason(op) for op in ("extend", "crop")} if operations else None
    steps: list[Step] = []
    try:
        return _drive(c, session, on_step, tokens_from, extend, steps, lacks)
    except Crash as crash:
        raise crash.held([s.name for s in steps]) if judges and steps else crash


MAX_CLOSING_DECODES = MAX_LEN - PROMPT - STEPS  # what fits the sessions' cache (a real window is not driven to)


def closing_decodes(c: FamilyContext) -> int:
    """The greedy decodes after the STEPS in a drive without the k-token call (P3, P4, memory): one, or
    as many as take the widest local window past its edge where that is within MAX_CLOSING_DECODES
    (gemma3's 9 > PROMPT + STEPS + 1): the checks that measure a cache then see every tiny window slide,
    not P1 alone."""
    widest = max((w for w in c.family.layer_windows(c.config) if w is not None), default=0)
    past_the_edge = widest + 1 - PROMPT - STEPS
    return past_the_edge if 1 < past_the_edge <= MAX_CLOSING_DECODES else 1


def _drive(c: FamilyContext, session, on_step, tokens_from, extend: bool, steps: list[Step],
           lacks: dict | None = None) -> list[Step]:
    c.recorded_from = None
    ids, mask = c.inputs(*prompt(c.config, c.seed, pads=c.pads))
    first = Step("prefill", "prefill", observed(c, session, "prefill", ids.shape[1], "prefill", "prefill",
                                                session.prefill, ids, mask))
    seq = ids
    on_step(first, session, seq, mask)
    steps.append(first)  # after on_step: `steps` are the steps on_step saw through
    plan = [("decode", 1)] * STEPS + ([("extend", EXTEND), ("decode", 1)] if extend else
                                      [("decode", 1)] * closing_decodes(c))
    for i, (op, k) in enumerate(plan, 1):
        if op == "decode":
            last = steps[-1].logits if tokens_from is None else tokens_from(i)
            last = last[:, -1] if last.dim() == 3 else last
            tokens = last.argmax(-1, keepdim=True)
            name = f"decode step {i}"
            logits = observed(c, session, "decode", tokens.shape[1], name, name, session.decode, tokens)
        else:
            tokens = c.inputs(teacher_tokens(c.config, c.batch, k, i))
            name = f"extend {k} (step {i})"
            c.recorded_from = session.written if c.recorded_from is None else c.recorded_from
            logits = observed(c, session, "extend", tokens.shape[1], name, name, session.extend, tokens)
        seq = torch.cat([seq, tokens], 1)
        mask = torch.cat([mask, torch.ones_like(tokens)], 1)
        step = Step(name, op, logits)
        on_step(step, session, seq, mask)
        steps.append(step)
    if lacks is not None:
        closing_operations(c, session, on_step, steps, seq, mask, lacks)
    return steps


CROP = 2  # positions the closing operations crop back (family-ops' assisted program crops back 2)


def closing_operations(c: FamilyContext, session, on_step, steps: list[Step], seq, mask, lacks: dict) -> None:
    """After the decodes of a drive without its k-token call (P3, memory): an EXTEND-token call, a crop
    back CROP positions and a decode, each window then holding what `Family.layer_tokens` lets it
    keep while the cache keeps its past for a crop (`FamilyContext.recorded_from`). on_step judges the
    k-token call and the decode; the crop is judged by that decode (what a crop leaves pinned until the
    next call is the ops checks' measure). An operation the implementation lacks, refuses (Unsupported)
    or crashes on ends the drive with a note, never a second verdict (module doc of `drive`)."""
    if session.written + EXTEND > session.max_len:
        c.notes.append(f"{c.check}: no k-token call or crop after the decodes: {session.written} + {EXTEND} positions "
                       f"pass the sessions' cache length {session.max_len}")
        return
    first = len(steps)
    for i, (op, k) in enumerate((("extend", EXTEND), ("crop", CROP), ("decode", 1)), first):
        reason = lacks.get(op)
        if reason:
            c.notes.append(f"{c.check}: the cache was not measured after a {op} ({reason})")
            return
        name = f"{op} {k} (step {i})" if op != "decode" else f"decode step {i} (after the crop)"
        before = session.written
        try:
            if op == "extend":
                tokens = teacher_tokens(c.config, c.batch, k, i)
                c.recorded_from = before if c.recorded_from is None else c.recorded_from
                logits = observed(c, session, "extend", k, name, name, session.extend, tokens)
            elif op == "crop":
                observed(c, session, "crop", before - k, name, name, session.crop, before - k)
                c.recorded_from = before - k
                seq, mask = seq[:, :before - k], mask[:, :before - k]
                continue
            else:  # the bytes do not depend on which token: a fixed one, as the extend's
                tokens = teacher_tokens(c.config, c.batch, 1, i)
                logits = observed(c, session, "decode", 1, name, name, session.decode, tokens)
        except (Crash, Unsupported) as e:
            finding = ("family-P1's finding (its drive makes a k-token call)" if op == "extend" else
                       "family-ops' finding (its assisted program crops, then decodes)")
            c.notes.append(f"{c.check}: the cache was not measured after the {op}: "
                           f"{' '.join(str(getattr(e, 'msg', e)).split())[:300]} ({finding})")
            return
        seq = torch.cat([seq, tokens], 1)
        mask = torch.cat([mask, torch.ones_like(tokens)], 1)
        step = Step(name, op, logits)
        on_step(step, session, seq, mask)
        steps.append(step)


def cache_evidence(runner, c: FamilyContext) -> dict:
    """What shows the implementation keeps a cache on this path (the green-run rule,
    `mpt_kv.checks.evidence.cache_evidence`): after a prefill, the distinct storages of `kv()` hold at
    least the family's analytic K/V of the tokens written, and a second `kv()` returns the same ones."""
    ids, mask = c.inputs(*prompt(c.config))
    with torch.inference_mode():
        session = c.session(runner)
        session.prefill(ids, mask)
        first = named_kv(session.kv())
        again = named_kv(session.kv())  # `first` still alive: a recomputed tensor cannot take its storage's address
    storages = {storage_key(t): t.untyped_storage().nbytes() for _, _, t in first}
    held, written = sum(storages.values()), session.written
    analytic = analytic_bytes(c, session)
    where = (f"after a prefill of {c.batch} x {written} tokens on {c.path}, {c.device.type}, "
             f"{str(c.dtype).replace('torch.', '')}:")
    if held < analytic:
        return {"shown": False, "why": f"{where} the cache's storages hold {held} bytes, less than the family's "
                                       f"analytic K/V of the prefilled tokens ({analytic} bytes): no cache is kept"}
    if set(storages) != {storage_key(t) for _, _, t in again}:
        return {"shown": False, "why": f"{where} a second kv() returned other storages than the first: K/V made "
                                       "at each read (recomputed from the tokens?), not kept"}
    return {"shown": True, "why": f"{where} the cache's storages hold {held} bytes (analytic K/V {analytic}), the "
                                  "same at a second kv()"}


def warm_up(runner, c: FamilyContext) -> None:
    """A prefill and a decode before measuring: state a model builds lazily once (rotary tables,
    cached masks, a cache pool) is made here, not counted as kept by the measured generation."""
    ids, mask = c.inputs(*prompt(c.config))
    with torch.inference_mode():
        session = c.session(runner)
        logits = call(c, "family-memory warm-up", "warm-up", "prefill", session.prefill, ids, mask)
        call(c, "family-memory warm-up", "warm-up", "decode", session.decode, logits[:, -1].argmax(-1, keepdim=True))
    del session, logits
    gc.collect()
