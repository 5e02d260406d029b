"""The generate drive: an implementation's own `generate`, run as users run it, with every forward call it
makes observed (the drive beside the direct one of `running`'s other drivers; docs/generate.md).

The direct drive calls a model's forward itself and follows each release's cache operations by reading
them (`mpt_kv.targets.hf_generation`, `gaudi_generation`); here the implementation's own `generate` runs,
unchanged, and the half of the cache that lives in it (what it passes the model, how it pads, trims,
reorders, crops or rebuilds the cache between calls, what `prepare_inputs_for_generation` slices) is
judged through what it hands the model and what the model hands back:

    subject = mpt_subject(name, runner, case, draft)          # or family_subject(runner, c, draft)
    drive = observe(subject, mode, path)                      # generate once, every call recorded
    drive.calls, drive.sequences, drive.crash

A `Subject` is what both kinds of target give the drive: a model with `generate`, its config, the oracle
(an uncached forward of the same weights), its fused projections, the analytic bytes of its cache and how
its cache objects are read. The drive observes, never changes, the model: its `prepare_inputs_for_generation`
is wrapped on the instance (the full sequence generate holds, which the call's logits are judged against;
the wrapper keeps the method's signature, which generate validates its keyword arguments against), and a
forward pre-hook and hook read the cache each call receives and returns (their storages and bytes, judged
at once: a view's storage must be read while the call's fused outputs are alive) and copy the logits (the
copy rule: `mpt_kv.checks.results.snapshot`). What the check function (`mpt_kv.checks.generate`) judges,
after the drive, is every call in order.

Modes (one check id each, per cache path: concat = generate's dynamic cache, static =
`cache_implementation="static"`, or the implementation's own static path):

    greedy          batch 2, left-padded, greedy, `NEW_TOKENS`
    beam            the same prompt, `generate_flavours.NUM_BEAMS` beams (a reorder of the cache after every step)
    prompt-lookup   assisted decoding with prompt lookup: batch 1 (upstream allows no other: transformers
                    5.24 generation/utils.py:4023, optimum-habana 1.21.2 generation/utils.py:1740), a
                    prompt with a repeated n-gram so candidates are proposed and rejected (a k-token
                    verification call, then a crop)
    draft           assisted decoding with a draft model: the same implementation with other weights
    chunked         greedy with a chunked prefill (`prefill_chunk_size=generate_flavours.CHUNK`): the prompt
                    written to the cache in k-token calls before the first token (transformers' long-context
                    option; optimum-habana's generate has none: unsupported, saying so)
    contrastive     contrastive search (`penalty_alpha`, `top_k=generate_flavours.TOP_K`): after the prefill, every
                    step repeats the cache top_k times, feeds each row's top_k candidate tokens in one call of
                    batch x top_k rows, and keeps the chosen candidate's rows (optimum-habana's run_generation.py
                    --penalty_alpha --top_k; transformers 5.x runs it from the Hub only: unsupported)
    constrained     constrained beam search: beam search with a token every row must contain
                    (`force_words_ids`, run_generation.py --force_words; transformers 5.x runs it from the Hub
                    only: unsupported)
    multi-turn      two greedy turns of a chat on one cache object the user made (`generate_flavours.multi_turn`):
                    the second turn's input is the first's output and the user's reply, and generate continues
                    the cache the first turn filled (its first call feeds the reply and the first turn's last
                    token, never fed before)
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from mpt_kv import recipes
from mpt_kv.checks import index
from mpt_kv.checks.cases import Case
from mpt_kv.checks.family_driver import prompt
from mpt_kv.checks.family_storage import FusedCapture, pinning_problems, storage_report
from mpt_kv.checks.generate_flavours import (CANDIDATES, REPLY, TOP_K, Flavour, flavour_of, generate_positions,
                                             has_generate)
from mpt_kv.checks.results import snapshot
from mpt_kv.checks.storages import covered_bytes, storage_key
from mpt_kv.errors import ObserverError, TargetUnavailable, Unsupported
from mpt_kv.model.config import ModelConfig

MODES = index.GENERATE_MODES  # greedy, beam, prompt-lookup, draft, chunked, contrastive, constrained, multi-turn
ASSISTED = ("prompt-lookup", "draft")
NEW_TOKENS = 4         # greedy and beam: decode steps after the prefill
ASSISTED_NEW_TOKENS = 6
NGRAM = (5, 9, 13)     # the assisted prompt: this 3-gram twice, so prompt lookup proposes its continuation
ASSISTED_PROMPT = 8
# an MPT target's model (the kill matrix's first case's: 3 heads, ALiBi slopes of a non-power of two)
MPT_CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32), (6, 4),
                ASSISTED_NEW_TOKENS + CANDIDATES, seed=41)
CACHE_KEYS = ("cache", "past_key_values")  # transformers 5.x names the forward's cache `cache`, 4.x and the ports
#                                            `past_key_values`


def is_static(path: str) -> bool:
    """A generate path of a static cache: "static", optimum-habana's "static+reuse" and a recipe's
    ("static+reuse@flash-reuse", `mpt_kv.recipes`)."""
    return recipes.split(path)[0] != "concat"


# --- what the drive needs of a target ---------------------------------------------------------------------------

@dataclass
class Subject:
    """What both kinds of target give the generate drive (an MPT target's runner and case, or a family
    target's runner and FamilyContext).

    name       how messages name it
    runner     the target's Runner: its `model` has `generate`; its `capabilities` (cache_pool)
    config     the model's config (vocab_size: the prompts' tokens)
    oracle     (ids, mask) -> float32 logits of an uncached forward of the same weights
    fused      (name, module) of each fused projection: a cached view of its output pins the rest of it
    analytic   (batch, positions, static_len, recording) -> the cache's analytic bytes: positions written, or
               on the static path the cache length generate gave it (`static_len`); `recording`: the tokens of
               an assisted verification call, which a window layer may keep beyond its window until the crop
               (a rollback of rejected candidates must restore what the call evicted)
    kv_of      a cache object as the forward received or returned it -> [(layer, "key"/"value", tensor)]
               as stored
    flavour    how this implementation's generate is called (`generate_flavours.Flavour`)
    draft      () -> a model of the same implementation with other weights (assisted decoding's draft), or
               None where the implementation takes none
    storage    what is wrong with a cache's storages, in the words of the kind's own checks (a family's:
               family-P3's and family-memory's, `family_storage.storage_report`); None: `storage_problems`'
    """

    name: str
    runner: object
    config: object
    oracle: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    fused: list
    analytic: Callable[..., int]
    kv_of: Callable[[object], list]
    flavour: Flavour
    draft: Callable[[], torch.nn.Module] | None = None
    storage: Callable | None = None  # (kv, fused, positions, static_len, batch, recording) -> problems, its own words

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


# --- one observed call ------------------------------------------------------------------------------------------

@dataclass
class Call:
    """One forward call generate made, as observed."""

    index: int
    ids: torch.Tensor            # (B, T): the sequence generate held for this call (its prepare_inputs_for_generation)
    mask: torch.Tensor | None    # (B, T): its 2D attention mask
    fed: int                     # tokens the model was fed (its input_ids' length)
    logits: torch.Tensor | None = None   # (B, k, V), copied at once
    received: int | None = None  # positions the cache it received held (None: none yet)
    returned: int | None = None
    problems: dict = field(default_factory=dict)  # "received" / "returned" -> [what is wrong with that cache]
    kv: list | None = None       # the returned K/V, copied (the last call's, for static = concat)
    static_len: int | None = None
    fed_ids: torch.Tensor | None = None  # (B, fed): the tokens the model was fed
    history_unknown: bool = False  # contrastive candidates of a run that returned no sequences: logits not judged

    @property
    def held(self) -> int:
        """Positions of the sequence generate holds for this call: its ids', or its mask's where generate handed
        prepare_inputs_for_generation fewer ids than the mask (contrastive search's candidates)."""
        return max(self.ids.shape[1], self.mask.shape[1] if self.mask is not None else 0)

    @property
    def name(self) -> str:
        if self.index == 0:
            return "call 0 (prefill)"
        what = "decode" if self.fed == 1 else f"{self.fed}-token call"
        return f"call {self.index} ({what})"


@dataclass
class Drive:
    """One generate run: its calls, what it returned, the exception it raised (None if it returned)."""

    mode: str
    path: str
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    new_tokens: int
    calls: list[Call] = field(default_factory=list)
    sequences: torch.Tensor | None = None
    crash: BaseException | None = None
    crashed_in: str = "generate"        # "call N" where the exception came out of a forward
    alive: list = field(default_factory=list)  # (where, bytes, storage key) of the cache storages still alive after it

    @property
    def static(self) -> bool:
        """A static cache: the static path, optimum-habana's reuse_cache or a recipe on one."""
        return is_static(self.path)

    @property
    def turns(self) -> list[tuple[int, int]]:
        """(first position, count) of the tokens generate chose in each turn of the sequences it returned: one
        turn, or multi-turn's two with the user's reply between them."""
        start = self.prompt_ids.shape[1]
        if self.mode != "multi-turn":
            return [(start, self.new_tokens)]
        return [(start, self.new_tokens), (start + self.new_tokens + len(REPLY), self.new_tokens)]

    def operations(self) -> dict:
        """What the run did to the cache, read from its calls: k-token calls (assisted decoding's verification:
        a call after the prefill fed several tokens, or a prefill fed more than the prompt, its candidates
        with it), crops (a cache received shorter than the previous call returned it) and reorders (rows of
        the sequence generate held that moved: `reordered`)."""
        extends = sum(1 for c in self.calls[1:] if c.fed > 1)
        extends += 1 if self.calls and self.calls[0].fed > self.prompt_ids.shape[1] else 0
        crops = sum(1 for a, b in zip(self.calls, self.calls[1:])
                    if a.returned is not None and b.received is not None and b.received < a.returned)
        reorders = sum(1 for a, b in zip(self.calls, self.calls[1:]) if reordered(a, b))
        return {"calls": len(self.calls), "extends": extends, "crops": crops, "reorders": reorders}


def cache_of(kwargs: dict, output=None):
    """The cache a forward received (its keyword) or returned (its output's field)."""
    if output is None:
        return next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    for k in CACHE_KEYS:
        value = output.get(k) if hasattr(output, "get") else getattr(output, k, None)
        if value is not None:
            return value
    return None


def positions_of(cache, kv) -> int | None:
    """Positions a cache holds: its own `get_seq_length()` (transformers' caches, static ones included:
    written, not allocated), else the position axis (-2) of the first layer's last tensor (legacy tuples:
    MPT's [key, value] lists, llm-foundry's (b, h, s, d) value)."""
    if cache is None or not kv:
        return None
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        try:
            return int(length())
        except Exception:  # noqa: BLE001  a cache that cannot say: read its tensors
            pass
    first = [t for layer, _, t in kv if layer == kv[0][0]]
    return int(first[-1].shape[-2])


def static_length(cache, kv) -> int | None:
    """The slots of a static cache, its longest layer's (a hybrid cache's window layers have fewer):
    transformers' layers' `max_cache_len`, else the position axis (-2) of the preallocated buffers."""
    lengths = [n for layer in getattr(cache, "layers", ()) or () if isinstance(n := getattr(layer, "max_cache_len", None), int)]
    if lengths:
        return max(lengths)
    return max(int(t.shape[-2]) for _, _, t in kv) if kv else None


def storage_problems(subject: Subject, kv, positions: int, static_len: int | None, fused: dict, batch: int,
                     recording: int = 0) -> list[str]:
    """What is wrong with a cache's storages: the subject's own reading where it has one (a family's:
    `family_storage.storage_report`, the family checks' words), else P3's coverage rule
    (`family_storage.pinning_problems`: a view of a fused projection's output, or of any buffer its cached
    tensors do not fill) and the analytic bytes (the distinct storages hold the K/V of `positions` tokens, or
    of `static_len` slots, for `batch` rows; `recording`: `Subject.analytic`'s)."""
    if subject.storage is not None:
        return subject.storage(kv, fused, positions, static_len, batch, recording)
    problems = pinning_problems(kv, fused)
    by_storage: dict[int, list] = {}
    for entry in kv:
        by_storage.setdefault(storage_key(entry[2]), []).append(entry)
    total = sum(es[0][2].untyped_storage().nbytes() for es in by_storage.values())
    analytic = subject.analytic(batch, positions, static_len, recording)
    if total != analytic:
        own = sum(covered_bytes(es[0][2].untyped_storage().nbytes(), [t for _, _, t in es]) for es in by_storage.values())
        held = f"{static_len} slots" if static_len else f"{positions} tokens"
        problems.append(f"the cache's distinct storages hold {total} bytes, the analytic K/V of {batch} x {held} "
                        f"{analytic}: {total - analytic:+d} bytes (the cached tensors themselves {own})")
    return problems


# --- the observer -----------------------------------------------------------------------------------------------

def observing(method):
    """A hook body whose exception is the observer's own, kept apart from the implementation's crashes."""
    @functools.wraps(method)
    def hook(self, *args, **kwargs):
        if self.error is not None:
            raise self.error
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.error = ObserverError(f"the generate drive's observer raised {type(e).__name__}: {e} (in "
                                       f"{method.__name__}, reading {type(self.subject.model).__name__}'s call)")
            self.error.__cause__ = e
            raise self.error

    return hook


class Observer:
    """Records every forward call of `subject.model` while it is active (module doc): the sequence its
    prepare_inputs_for_generation held, the cache it received and returned (judged at once), its logits
    (copied). `poison`: on the static path, the never-written slots of the first returned cache are set
    to 1e30 (a call that attends them shows in its logits, as P2 poisons them)."""

    def __init__(self, subject: Subject, drive: Drive, poison: bool = False, judge: bool = True):
        self.subject, self.drive, self.poison, self.judge = subject, drive, poison, judge
        self.pending: tuple | None = None
        self.current: Call | None = None
        self.error: ObserverError | None = None
        self.fused = FusedCapture(subject.fused) if judge else None
        self.storages: dict[int, tuple] = {}  # every cache storage seen: key -> (weakref, where)
        self.caches: list[tuple] = []         # every cache object seen that takes a weakref: (weakref, where)
        model = subject.model
        original = model.prepare_inputs_for_generation

        @functools.wraps(original)  # generate validates its keyword arguments against this signature
        def prepare(*args, **kwargs):
            ids = args[0] if args else kwargs.get("input_ids")
            self.pending = (args, kwargs, ids, None)
            prepared = original(*args, **kwargs)
            self.pending = (args, kwargs, ids, prepared)
            return prepared

        prepare.__signature__ = inspect.signature(original)
        model.prepare_inputs_for_generation = prepare
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after, with_kwargs=True)]

    def close(self):
        for h in self.handles:
            h.remove()
        self.subject.model.__dict__.pop("prepare_inputs_for_generation", None)
        if self.fused is not None:
            self.fused.close()

    def sequence(self, args, kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(ids, mask) of the sequence generate holds for this call: its prepare_inputs_for_generation's
        input (the flavour's reading of it), else the forward's own input (a call made without it)."""
        if self.pending is not None:
            args, pkw, ids, prepared = self.pending
            self.pending = None
            if self.subject.flavour.sequence is not None:
                return self.subject.flavour.sequence(args, pkw, prepared)
            return self.chunk_of_prompt(ids, pkw.get("attention_mask")), pkw.get("attention_mask")
        return kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0], kwargs.get("attention_mask")

    def chunk_of_prompt(self, ids, mask):
        """A chunked prefill's call hands prepare_inputs_for_generation its chunk alone, with the mask up to the
        chunk's end (transformers 5.24 generation/utils.py `_prefill`): the sequence generate holds is the
        prompt up to there, where the chunk is the prompt's tokens just before; else `ids` as they are."""
        prompt = self.drive.prompt_ids
        if ids is None or mask is None or mask.dim() != 2 or ids.shape[1] >= mask.shape[1]:
            return ids
        end = mask.shape[1]
        if end <= prompt.shape[1] and ids.shape[0] == prompt.shape[0] and torch.equal(ids, prompt[:, end - ids.shape[1]:end]):
            return prompt[:, :end]
        return ids

    @observing
    def before(self, module, args, kwargs):
        ids_fed = args[0] if args else kwargs.get("input_ids")
        ids, mask = self.sequence(args, kwargs)
        mask = mask if mask is None or mask.dim() == 2 else None
        call = Call(len(self.drive.calls), ids.detach().clone(), None if mask is None else mask.detach().clone(),
                    int(ids_fed.shape[1]) if ids_fed is not None else int(ids.shape[1]),
                    fed_ids=None if ids_fed is None else ids_fed.detach().clone())
        self.drive.calls.append(call)
        self.current = call
        cache = cache_of(kwargs)
        kv = self.subject.kv_of(cache) if cache is not None else []
        self.remember(kv, f"the cache {call.name} received", cache)
        call.received = positions_of(cache, kv)
        if self.judge and kv and call.received is not None:
            static = static_length(cache, kv) if self.drive.static else None
            # what the cache should hold before this call: the sequence less the tokens it is fed
            problems = storage_problems(self.subject, kv, call.held - call.fed, static, self.fused.outputs,
                                        ids.shape[0])
            if problems:
                call.problems["received"] = problems

    @observing
    def after(self, module, args, kwargs, output):
        call = self.current
        if call is None:
            return
        logits = output.get("logits") if hasattr(output, "get") else getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)):
            logits = output[0]
        call.logits = None if logits is None else snapshot(logits)
        cache = cache_of(kwargs, output)
        kv = self.subject.kv_of(cache) if cache is not None else []
        self.remember(kv, f"the cache {call.name} returned", cache)
        call.returned = positions_of(cache, kv)
        static = static_length(cache, kv) if self.drive.static else None
        call.static_len = static
        if self.judge and kv:
            written = call.held
            # an assisted verification call's window layers may keep what it evicted until generate's crop
            recording = call.fed if self.drive.mode in ASSISTED and not static else 0
            problems = storage_problems(self.subject, kv, written, static, self.fused.outputs, call.ids.shape[0],
                                        recording)
            if problems:
                call.problems["returned"] = problems
            call.kv = [(layer, n, t.detach().clone()) for layer, n, t in kv]
            if self.poison and call.index == 0 and static and written < static:
                poison_unwritten(kv, written, static)
        self.current = None

    def remember(self, kv, where: str, cache=None) -> None:
        for layer, n, t in kv:
            self.storages[storage_key(t)] = (weakref.ref(t.untyped_storage()), f"layer {layer} {n} of {where}")
        if cache is not None and not any(ref() is cache for ref, _ in self.caches):
            try:
                self.caches.append((weakref.ref(cache), where))
            except TypeError:  # a tuple or list cache: its tensors' storages are remembered above
                pass

    def still_alive(self) -> list[tuple]:
        """(where, bytes, storage key) of each cache storage alive now: those the calls saw, and those a cache
        object the calls saw holds now (what generate did to it after its last call: a beam's last reorder)."""
        alive = {key: (where, st.nbytes(), key) for key, (ref, where) in self.storages.items()
                 if (st := ref()) is not None}
        for ref, where in self.caches:
            cache = ref()
            if cache is None:
                continue
            for layer, n, t in self.subject.kv_of(cache):
                key = storage_key(t)
                alive.setdefault(key, (f"layer {layer} {n} of {where} (the cache object, still alive)",
                                       t.untyped_storage().nbytes(), key))
        return list(alive.values())


POISON = 1e30  # as P2's: large and finite (a NaN would spread through 0 * v even where masked)


def poison_unwritten(kv, written: int, static_len: int) -> None:
    """The slots past `written` of each cached tensor whose one axis has the static cache's length (a
    window layer's shorter buffer is left alone)."""
    for _, _, t in kv:
        axes = [i for i, n in enumerate(t.shape) if n == static_len]
        if len(axes) == 1 and t.is_floating_point():
            t.narrow(axes[0], written, static_len - written).fill_(POISON)


# --- the drive --------------------------------------------------------------------------------------------------

def inputs(subject: Subject, mode: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, mask, new tokens) of a mode: greedy and beam the family checks' left-padded batch of 2
    (`family_driver.prompt`); assisted decoding one row with a repeated n-gram."""
    if mode in ASSISTED:
        tokens = [int(t) % subject.vocab_size for t in NGRAM]
        g = torch.Generator().manual_seed(11)
        head = torch.randint(1, subject.vocab_size, (ASSISTED_PROMPT - 2 * len(tokens),), generator=g).tolist()
        ids = torch.tensor([tokens + head + tokens])
        return ids, torch.ones_like(ids), ASSISTED_NEW_TOKENS
    ids, mask = prompt(subject.config)
    return ids, mask, NEW_TOKENS


def observe(subject: Subject, mode: str, path: str, poison: bool = True) -> Drive:
    """One `generate` of `mode` on `path`, every forward call observed (module doc)."""
    ids, mask, new = inputs(subject, mode)
    drive = Drive(mode, path, ids, mask, new)
    draft = subject.draft() if mode == "draft" else None
    # not on multi-turn: transformers 4.x's StaticCache counts the positions it holds from its nonzero slots
    # (get_seq_length, which the second turn's generate reads), so poisoned slots would change what generate does
    observer = Observer(subject, drive, poison=poison and drive.static and mode != "multi-turn")
    try:
        with torch.inference_mode(), subject.flavour.context():
            drive.sequences = snapshot(subject.flavour.generate(subject.model, ids, mask, mode, path, new, draft))
    except (Unsupported, TargetUnavailable, ObserverError):
        raise
    except Exception as e:  # noqa: BLE001  the implementation's generate crashed: judged by the check (crash rule)
        if observer.error is not None:  # the observer's own, caught and rewrapped by the implementation's code
            raise observer.error from e
        drive.crash = e
        if observer.current is not None:
            drive.crashed_in = observer.current.name
    finally:
        observer.close()
    if mode == "contrastive":
        candidates_history(drive)
    if drive.crash is None:
        # what generate left behind: the cache storages it made that outlive it (identity, as the cpu meter's
        # finalizers count a storage until its last view dies), once its output and the calls' copies are ours
        gc.collect(1)  # the young generations: what generate made (a full collection costs seconds in a large process)
        drive.alive = observer.still_alive()
    return drive


def candidates_history(drive: Drive) -> None:
    """Contrastive search hands prepare_inputs_for_generation each candidate token without the history it
    follows (transformers: the (batch x top_k, 1) candidates; optimum-habana's static shapes: rows of padding
    with the candidate at token_idx - 1): a candidate call's sequence is the tokens generate chose before it,
    each row repeated top_k times, and the candidate it was fed; the chosen tokens are those generate returned.
    Without them (a crash) the candidates' logits cannot be judged, their caches still are."""
    rows = drive.prompt_ids.shape[0] * TOP_K
    for call in drive.calls:
        if call.index == 0 or call.ids.shape[0] != rows or call.fed_ids is None or call.fed != 1:
            continue
        if drive.sequences is None or drive.sequences.shape[1] < call.held - 1:
            call.history_unknown = True
            continue
        history = drive.sequences[:, :call.held - 1].repeat_interleave(TOP_K, dim=0)
        call.ids = torch.cat([history, call.fed_ids.to(history.dtype)], dim=1)
        if call.mask is not None:
            call.mask = call.mask[:, :call.held]


# --- what generate did between two calls (whose generate and how it is called: `generate_flavours`) -----------

def reordered(previous, call) -> bool:
    """Generate moved rows between two calls: the cache was not cropped and the sequence it holds now does
    not continue the previous one row by row (a beam search's reorder)."""
    t = previous.ids.shape[1]
    return (call.received == previous.returned and call.ids.shape[0] == previous.ids.shape[0]
            and call.ids.shape[1] > t and not torch.equal(call.ids[:, :t], previous.ids))


# --- the two kinds of target --------------------------------------------------------------------------------------

def mpt_subject(name: str, runner, cfg, draft: Callable[[], object] | None) -> Subject:
    """An MPT target's subject: its runner (the model with the case's weights), the oracle its own uncached
    forward (P1's: P0 holds it to the reference), `Wqkv` the fused projection, the analytic bytes of MPT's
    K and V (2 x layers x batch x positions x d_model)."""
    from mpt_kv.families.models import cached_kv

    model = getattr(runner, "model", None)
    why = has_generate(model) if model is not None else f"{name}: its runner has no model"
    if why:
        raise Unsupported(f"{name}: {why}")

    def oracle(ids, mask):
        with torch.inference_mode():
            return runner.logits(ids, mask).float()

    def analytic(batch, positions, static_len=None, recording=0):  # MPT has no window: `recording` keeps nothing
        itemsize = next(model.parameters()).element_size()
        return 2 * cfg.n_layers * batch * (static_len or positions) * cfg.d_model * itemsize

    fused = [(n, m) for n, m in model.named_modules() if n.endswith("Wqkv")]
    return Subject(name, runner, model.config if hasattr(model, "config") else cfg, oracle, fused, analytic,
                   cached_kv, flavour_of(model), draft=(lambda: draft().model) if draft is not None else None)


def only_shapes(cache) -> bool:
    """A legacy cache of shapes, no tensor: what optimum-habana's ports return with reuse_cache or, after the
    prefill, bucket_internal (the cache lives elsewhere: the model's buffers, generate's padded cache)."""
    return isinstance(cache, (tuple, list)) and bool(cache) and all(
        isinstance(layer, torch.Size) or (isinstance(layer, (tuple, list)) and all(isinstance(x, torch.Size) for x in layer))
        for layer in cache)  # an MQA port's layer is one tensor (K and V stacked): one shape


def family_subject(runner, c, draft: Callable[[], object] | None) -> Subject:
    """A family target's subject: the implementation's runner, the oracle transformers' uncached model of the
    same weights (`FamilyContext.oracle`), the family's fused projections and analytic bytes
    (`Family.cache_bytes`: windows, latents, K/V heads), the port's own cache reader where it has one."""
    from mpt_kv.families.models import cached_kv, named_kv

    why = has_generate(runner.model)
    if why:
        raise Unsupported(f"{c.implementation}/{c.family.name}: {why}")
    port = getattr(runner, "port", None)

    def kv_of(cache):
        if port is None:
            return cached_kv(cache)
        # with bucket_internal a decode returns only the cache's shapes (generate keeps the padded cache it
        # passes each call, written in place): no cache to read there (what the next call receives is)
        return [] if only_shapes(cache) else named_kv(port.kv(cache))

    flavour = flavour_of(runner.model)
    if port is not None and getattr(runner, "reuse_cache", False):
        # reuse_cache: generate allocates the cache on the model (allocate_kv_cache) and the port returns only
        # its shapes: the cache every call received and returned is the model's buffers, kept for the next
        # generate by design (optimum-habana 1.21.2 generation/utils.py:1638-1642)
        def kv_of(cache):
            return named_kv(port.reuse_kv(runner.model))

        def pool(model):
            return [t for _, _, t in named_kv(port.reuse_kv(model))], (
                "optimum-habana's reuse_cache buffers, allocated on the model by generate (allocate_kv_cache, "
                "generation/utils.py:1638-1642) and reused by its next call")

        flavour = dataclasses.replace(flavour, pool=pool)

    def analytic(batch, positions, static_len=None, recording=0):
        if static_len is not None or not recording:
            return c.family.cache_bytes(c.config, c.dtype, batch, positions, static_len)
        # a window layer may hold the verification call's tokens beyond its w - 1 until the crop
        tokens = [positions if w is None else min(positions, w - 1 + recording)
                  for w in c.family.layer_windows(c.config)]
        size = torch.empty((), dtype=c.dtype).element_size()
        return sum(width * n for width, n in zip(c.family.layer_widths(c.config), tokens, strict=True)) * batch * size

    def oracle(ids, mask):
        """transformers' uncached forward of the same weights, each row's positions counted from its first real
        token where the model takes position_ids (`generate_positions`: what generate feeds a left-padded row)."""
        if c.family.remote_code:
            return c.oracle(ids, mask)
        from mpt_kv.checks.family_driver import oracle_model

        model = oracle_model(c.family, c.variant, c.dtype)
        extra = {"position_ids": generate_positions(mask)} if "position_ids" in inspect.signature(
            model.forward).parameters else {}
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits.float()

    def storage(kv, fused, positions, static_len, batch, recording):
        """family-P3's and family-memory's reading (`family_storage.storage_report`), their words: the pinned views
        and the bytes beyond the family's analytic K/V, with what the family entry declares stored."""
        c.batch = batch
        tokens = static_len if static_len is not None else positions
        total, expected, why = storage_report(c, kv, fused, tokens, analytic(batch, positions, static_len, recording),
                                              c.family.cache_bytes(c.config, c.dtype, batch, positions, static_len,
                                                                   stored=True))
        if total == expected and not why:
            return []
        head = (f"the cache's distinct storages hold {total} bytes, the family's analytic K/V for {batch} x {tokens} "
                f"tokens {expected}: {total - expected:+d} bytes" if total != expected else "")
        return ["; ".join(part for part in (head, *why) if part)]

    return Subject(f"{c.implementation}/{c.family.name}/{c.variant}", runner, c.config, oracle,
                   c.fused_modules(runner), analytic, kv_of, flavour,
                   draft=(lambda: draft().model) if draft is not None else None, storage=storage)
