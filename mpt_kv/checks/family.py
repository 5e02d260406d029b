"""The family checks, on any implementation of a family (`mpt_kv.families.implementations`):
each drives the implementation's Runner and Session (prefill, decode, extend, crop, reorder,
kv()) on a tiny model of the family, on the case's device and dtype (fp32 and CPU by default), and
compares with transformers' own model of the same weights, uncached, fp32 on CPU (the oracle). Each takes what every check takes: the runner
the run layer built and the check's context, `check(runner, c)` (`c` a
`mpt_kv.checks.family_driver.FamilyContext`; what they run on, the drive and its accounting:
`mpt_kv.checks.family_driver`). `CHECKS` calls one by property, with an implementation, a family,
a variant and a path.

family-P0      the implementation's uncached logits = transformers' uncached logits (not a check
               of transformers itself: its cell is not drawn)
family-P1      a left-padded batch of 2: prefill, 2 greedy decode steps, a 3-token cached call
               (extend) and a decode: after each, the logits = one uncached forward of
               transformers' model over each row's tokens (P2 drives the same calls; P3, P4
               and memory the prefill and the decode steps, P3 and memory then a k-token call, a
               crop and a decode, `family_driver.closing_operations`: an extend that crashes
               there is P1's finding, a crop family-ops', a note)
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
               through the crops and reorders; each program on its own session, both always run
               (a failure of one hides nothing of the other: both fail as `Failures`)
family-memory  after the prefill and every call, the bytes of the distinct storages the cache
               reaches = the family's analytic K/V bytes for the tokens written (concat: batch x
               written, static: batch x cache length; MQA/GQA aware; a window that keeps its past
               for a crop: within `Family.layer_tokens`' range, nothing pinned), the excess named (with the
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

import functools
import gc
import weakref

import torch

from mpt_kv.checks import index, running
from mpt_kv.checks.compare import Crash, PropertyFailure, assert_close, describe, judged_before, shares_memory
from mpt_kv.checks.family_driver import OPS_PADS, FamilyContext, Step, call, copy_of, drive, prompt, warm_up
from mpt_kv.checks.family_programs import assisted_program, beam_program, last_positions, returned_positions, run_program
from mpt_kv.checks.family_storage import (FusedCapture, aligned_written, analytic_bytes, analytic_range, cache_tokens,
                                          check_entry_bytes, check_fused_modules, pinning_problems, range_text,
                                          storage_report, token_positions)
from mpt_kv.checks.model_state import model_state_tensors
from mpt_kv.checks.storages import storage_key
from mpt_kv.errors import InputError, Registry, Unsupported, independently
from mpt_kv.families.implementations import ORACLE_ATTENTION
from mpt_kv.families.models import named_kv


def check_uncached(runner, c: FamilyContext) -> list[str]:
    """family-P0: the implementation's uncached forward = transformers' over the same weights."""
    if c.implementation == "transformers" and c.attention in (None, ORACLE_ATTENTION):
        raise InputError("family-P0 compares an implementation with transformers' own model: transformers "
                         "with eager attention is its oracle, not a case")
    ids, mask = c.inputs(*prompt(c.config, c.seed))
    with torch.inference_mode():
        got = copy_of(call(c, "family-P0", "uncached", "logits", runner.logits, ids, mask))
    assert_close(got, c.oracle(ids, mask), c.tol("logits:uncached"),
                 "family-P0 uncached logits vs transformers' uncached forward (same weights)",
                 c.ctx(step="uncached", operation="logits"), where=mask.bool()[:, :, None])
    return c.notes


def check_cached(runner, c: FamilyContext) -> list[str]:
    """family-P1 (module doc)."""
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
        start = 0
        for step, logits, end in got:
            # as many positions as the call fed (a prefill: or its last alone, --trim_logits), each step in turn
            k = returned_positions(c, f"family-P1 {step.name}", logits, end - start, step.operation, step.name)
            start = end
            where = mask.bool()[:, end - k:end, None] if step.operation == "prefill" else None
            assert_close(logits, full[:, end - k:end], tol,
                         f"family-P1 {step.name}: cached logits vs transformers' uncached forward over each row's "
                         "tokens", c.ctx(step=step.name, operation=step.operation), where=where)

    lacks_extend = runner.capabilities.reason("extend")
    try:
        with torch.inference_mode():
            drive(runner, c, c.session(runner), keep, extend=True, judges=False)
    except Crash as crash:  # the steps before it are compared first: a wrong value there is the verdict
        judged_before(crash, judge, [step.name for step, _, _ in got])
    judge()
    if lacks_extend:
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: the k-token cached call: {lacks_extend} "
                          "(the prefill and the decode steps held)")
    return c.notes


def check_static_concat(runner, c: FamilyContext) -> list[str]:
    """family-P2 (module doc): greedy tokens from the concat path, fed to both."""
    if c.session_path != "static":
        raise InputError(f"family-P2 compares the static path with the concat path: give path static or "
                         f"static+reuse, not {c.path!r}")
    runner.require("concat", "static")
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
        drive(runner, c, c.session(runner, "static"), compare, tokens_from=lambda i: concat_steps[names[i - 1]][0].logits,
              extend=True)

    def judge_recorded():  # the concat path crashed: the static path's steps it recorded are compared
        try:
            static_drive()
        except Crash as crash:
            if crash.ctx.get("step") in concat_steps:
                raise
        except PastTheRecord:
            pass

    lacks_extend = runner.capabilities.reason("extend")
    with torch.inference_mode():
        try:
            drive(runner, c, c.session(runner, "concat"), record, extend=True, judges=False)
        except Crash as crash:
            judged_before(crash, judge_recorded, list(concat_steps))
        static_drive()
    if not compared:
        c.notes.append("family-P2: the static and concat K/V layouts do not line up: logits compared only")
    if lacks_extend:
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: the k-token cached call: {lacks_extend} "
                          "(the prefill and the decode steps held)")
    return c.notes


def check_no_pinned_storage(runner, c: FamilyContext) -> list[str]:
    """family-P3 (module doc)."""
    modules = c.fused_modules(runner)
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
            drive(runner, c, c.session(runner), inspect, operations=True)
    finally:
        capture.close()
    return c.notes


def check_outputs_not_reused(runner, c: FamilyContext) -> list[str]:
    """family-P4 (module doc). A runner that declares Capabilities(graph_outputs=True) returns
    buffers a later call overwrites on purpose (graph replays): only the K/V aliasing is checked."""
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
        drive(runner, c, c.session(runner), keep)
    if runner.capabilities.graph_outputs:
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


def check_operations(runner, c: FamilyContext) -> list[str]:
    """family-ops (module doc). A program whose operation the implementation lacks is Unsupported
    with its reason, after the other program ran: never a pass."""
    c.batch = len(OPS_PADS)
    unsupported = []

    def program(name, needs, ops):  # each on its own session: one failing hides nothing of the other
        reasons = [r for r in (runner.capabilities.reason(f) for f in needs) if r]
        if reasons:
            unsupported.append(f"{name} program: {'; '.join(reasons)}")
            return
        try:
            with torch.inference_mode():
                run_program(runner, c, name, ops)
        except Unsupported as e:
            unsupported.append(f"{name} program: {e.msg}")

    independently(functools.partial(program, *p) for p in (beam_program(), assisted_program()))
    if unsupported:
        ran = "" if len(unsupported) == 2 else " (the other program ran and held)"
        raise Unsupported(f"{c.implementation}/{c.family.name} {c.path}: " + " | ".join(unsupported) + ran)
    return c.notes


def check_memory(runner, c: FamilyContext) -> list[str]:
    """family-memory (module doc)."""
    modules = c.fused_modules(runner)
    check_fused_modules(c, modules)
    gc.freeze()  # what existed before the check out of its gc.collect()s (measured: 0.26 s each -> ms)
    try:
        return measured_memory(runner, c, modules)
    finally:
        gc.unfreeze()


def measured_memory(runner, c: FamilyContext, modules) -> list[str]:
    warm_up(runner, c)
    # held to the end: a storage's key is its StorageImpl's address, which a freed one hands on (a
    # model that keeps its last cache frees the warm-up's when the measured generation replaces it, and
    # the new cache's storage could take its address and pass as pre-existing)
    held_before = [t for _, t in model_state_tensors(runner, set())]
    before = {storage_key(t) for t in held_before}
    capture = FusedCapture(modules)
    storages: dict[int, tuple[weakref.ref, str]] = {}

    def measure(step: Step, session, seq, mask):
        kv = named_kv(session.kv())
        tokens = cache_tokens(c, session)
        least, most = analytic_range(c, session)
        total, analytic, why = storage_report(c, kv, capture.outputs, tokens, most,
                                              analytic_bytes(c, session, stored=True), least)
        for layer, n, t in kv:  # the latest storage at an address (a freed one's address is reused)
            storages[storage_key(t)] = (weakref.ref(t.untyped_storage()), f"layer {layer} {n}")
        if why:  # the cached tensors hold the analytic bytes (a window: within its range) and pin nothing more
            excess = total - (most if total > most else least)
            raise PropertyFailure(f"family-memory after {step.name}: the cache's distinct storages hold {total} "
                                  f"bytes, the family's analytic K/V for {c.batch} x {tokens} tokens "
                                  f"{range_text(least, most, c)}: {excess:+d} bytes; " + "; ".join(why)
                                  + f" [{describe(c.ctx(step=step.name, operation=step.operation))}]")

    try:
        with torch.inference_mode():
            session = c.session(runner)
            drive(runner, c, session, measure, operations=True)
    finally:
        capture.close()
    pool = runner.capabilities.cache_pool
    del session
    gc.collect()
    alive = {key: (ref(), where) for key, (ref, where) in storages.items() if ref() is not None}
    kept = [(where, t) for where, t in model_state_tensors(runner, before) if not (pool and storage_key(t) in alive)]
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


def by_property(prop: index.Property):
    """The family check of `prop` called by property, `(implementation, family, variant, path, dtype,
    device)`: the run layer builds its runner and context as for `mpt_kv.CHECKS["<prop>/<path>"](target)`,
    and runs the same function (`running.call_family`), without the report's records."""
    function = globals()[prop.function.split(":")[1]]

    def check(implementation, family, variant: str, path: str = prop.paths[0], dtype=torch.float32,
              device="cpu", *, attention: str | None = None) -> list[str]:
        return running.call_family(prop.name, implementation, family, variant, path, dtype, device, attention)

    check.__name__, check.__qualname__, check.__doc__ = function.__name__, function.__qualname__, function.__doc__
    return check


# property -> its check by property (`CHECKS["family-P3"](implementation, family, variant, path)`;
# `mpt_kv.CHECKS["family-P3/concat"](target)` runs the same function on a FamilyTarget)
CHECKS = Registry("family check id", {p.name: by_property(p) for p in index.PROPERTIES if p.family})
