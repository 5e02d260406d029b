"""The generate checks: an implementation's own `generate`, driven as users run it
(`mpt_kv.checks.generate_driver`), judged at every forward call it made by the rules the direct drive
applies (docs/generate.md). One check per cache path and mode (`generate/<path>/<mode>`):

- the cache each call received (after whatever generate did between calls: a beam reorder, an assisted
  crop, a rebuild) and returned: its storages hold nothing but the cached tensors (P3's coverage rule,
  `family_storage.pinning_problems`: a view of a fused projection's output, the tail a crop by slicing
  keeps) and exactly the analytic K/V of the positions generate holds, or on the static path of the
  cache's slots (the memory checks' analytic bytes; `Subject.analytic`);
- each call's logits equal an uncached forward of the same weights over the sequence generate held for
  that call (cached = uncached at every step: the oracle of P1, of family-P1; whatever
  `prepare_inputs_for_generation` sliced, padded or masked shows here);
- static: every call equals the concat path's call over the same sequence, and the K/V at the written
  positions after the last call too (P2's rule); the never-written slots of the static cache are
  poisoned after the prefill (a call that attends them fails);
- the tokens generate returned (greedy and both assisted modes, which are greedy-exact) equal the
  oracle's greedy tokens, teacher-forced on them, by P1's near-tie rule (`properties.check_token`);
- after generate returned and its output is gone, none of the cache storages it made is alive (by identity,
  as the cpu meter counts a storage until its last view dies): a cache kept by generate or by the model
  fails, unless the implementation declares a cache pool (`Capabilities(cache_pool=True)`) or it is the pool
  generate itself keeps by design (transformers 4.x's static cache on the model, `Flavour.pool`).

A generate that raises fails the check with its exception named (the crash rule,
`mpt_kv.checks.compare.crash_of`), after every call it made before is judged (a wrong value there is the
verdict). A mode the implementation does not take (`Unsupported`, its reason) never passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from mpt_kv.checks.compare import PropertyFailure, assert_close, crash_of, describe, tolerance
from mpt_kv.checks.family_storage import aligned_written, token_positions
from mpt_kv.checks.generate_flavours import CHUNK, FORCED, TOP_K
from mpt_kv.checks.generate_driver import ASSISTED, Drive, Subject, is_static, observe, reordered
from mpt_kv.checks.properties import check_token
from mpt_kv.errors import ObserverError

GREEDY_EXACT = ("greedy", "prompt-lookup", "draft", "chunked", "multi-turn")  # the modes whose tokens are the oracle's greedy ones


def base_path(path: str) -> str:
    """The cache path whose tolerances a generate path takes: static for a static cache (optimum-habana's
    reuse_cache and recipes too), else concat."""
    return "static" if is_static(path) else "concat"


@dataclass
class GenerateContext:
    """Where a generate check runs, for its messages, and what it drives (`Subject`)."""

    target: str
    check: str
    mode: str
    path: str
    dtype: torch.dtype
    subject: Subject
    notes: list = field(default_factory=list)
    record: Callable[[str, object], None] = lambda name, value: None

    def ctx(self, **more) -> dict:
        return dict(target=self.target, check=self.check, generate=self.subject.flavour.name, mode=self.mode,
                    path=self.path, dtype=str(self.dtype).replace("torch.", ""), **more)

    def tol(self, quantity: str):
        return tolerance(self.dtype, quantity)


def check_generate(runner, c: GenerateContext) -> list[str]:
    """The generate check of one mode and path (module doc)."""
    drive = observe(c.subject, c.mode, c.path)
    concat = observe(c.subject, c.mode, "concat") if is_static(c.path) else None
    judged: list[str] = []
    try:
        judge_calls(c, drive, concat, judged)
    except PropertyFailure as failure:
        if drive.crash is not None:  # the earlier step's wrong value is the verdict, the crash noted
            raise PropertyFailure(f"{failure}; generate did not get past {drive.crashed_in}, where it raised "
                                  f"{type(drive.crash).__name__} (not judged here: a finding of its own)") from drive.crash
        raise
    if drive.crash is not None:
        if drive.crashed_in.startswith("call"):
            at = f" in {drive.crashed_in}"
        else:
            at = f" between calls, after {judged[-1]}" if judged else " before its first call"
        raise crash_of(c.check, "the implementation", "generate", drive.crash, c.ctx(step=drive.crashed_in),
                       at=at).held(judged) from drive.crash
    reached(c, drive)
    if c.mode in GREEDY_EXACT:
        judge_tokens(c, drive)
    if c.mode == "constrained":
        judge_forced(c, drive)
    judge_kept(c, drive)
    return c.notes


def fail(c: GenerateContext, drive: Drive, what: str, step: str) -> PropertyFailure:
    ops = drive.operations()
    done = ", ".join(f"{v} {k}" for k, v in ops.items() if v and k != "calls")
    return PropertyFailure(f"{c.check} {step}: {what} [{describe(c.ctx(step=step, calls=ops['calls'], seen=done or None))}]")


def judge_calls(c: GenerateContext, drive: Drive, concat: Drive | None, judged: list[str]) -> None:
    """Every call in order: the cache it received, its logits against the oracle (and on the static path
    against the concat path's call over the same sequence), the cache it returned."""
    tol = c.tol(f"logits:{base_path(c.path)}")
    previous = None
    for call in drive.calls:
        since = between(previous, call)
        for problem in call.problems.get("received", ()):
            raise fail(c, drive, f"the cache it received{since} {problem}", call.name)
        if call.logits is not None and call.history_unknown:
            c.notes.append(f"{c.check} {call.name}: a contrastive candidate call of a run that returned no tokens: its "
                           "logits not judged (the history it follows is what generate returns), its caches judged")
        elif call.logits is not None:
            k = call.logits.shape[1]
            if k > call.ids.shape[1]:
                raise fail(c, drive, f"logits for {k} positions, the sequence generate held has {call.ids.shape[1]}",
                           call.name)
            expected = c.subject.oracle(call.ids, call.mask if call.mask is not None else torch.ones_like(call.ids))
            where = None if call.mask is None else call.mask[:, -k:].bool()[:, :, None]
            if where is not None and not where.any():  # fail closed: a comparison of nothing passes anything
                raise ObserverError(f"{c.check} {call.name}: its {k} logits positions are all padding in the sequence "
                                    "the drive read for the call: the drive's reading of it is wrong, nothing compared")
            assert_close(call.logits.float(), expected[:, -k:], tol,
                         f"{c.check} {call.name}: logits (batch, query, vocab) vs an uncached forward of the same "
                         f"weights over the {call.ids.shape[1]} positions generate held{since}",
                         c.ctx(step=call.name, fed=call.fed), where=where)
            twin = concat.calls[call.index] if concat is not None and call.index < len(concat.calls) else None
            if twin is not None and twin.logits is not None and torch.equal(twin.ids, call.ids):
                # --trim_logits: a k-token call returns its last position's logits only (recipes.Recipe)
                assert_close(call.logits.float(), twin.logits[:, -k:].float(), c.tol("logits:static"),
                             f"{c.check} {call.name}: static-path logits vs the concat path's call over the same "
                             "sequence", c.ctx(step=call.name), where=where)
        if call.logits is None:  # the call raised inside the model: the crash rule's, after the calls before it
            break
        for problem in call.problems.get("returned", ()):
            raise fail(c, drive, f"the cache it returned {problem}", call.name)
        judged.append(call.name)
        previous = call
    if concat is not None and drive.calls and concat.calls and drive.crash is None:
        compare_written(c, drive.calls[-1], concat.calls[-1])


def between(previous, call) -> str:
    """What generate did to the cache between two calls, as read from them."""
    if previous is None or previous.returned is None or call.received is None:
        return ""
    if call.received < previous.returned:
        return f" (cropped by generate from {previous.returned} to {call.received} positions after {previous.name})"
    if reordered(previous, call):
        return f" (rows reordered by generate after {previous.name})"
    return ""


def compare_written(c: GenerateContext, static, concat) -> None:
    """P2's rule on generate's last calls: the static cache's K/V at the written positions equal the concat
    path's, real tokens only (a padding position's K/V past layer 0 come from fully masked queries)."""
    if static.kv is None or concat.kv is None or not torch.equal(static.ids, concat.ids) or \
            len(static.kv) != len(concat.kv):
        return
    written = static.ids.shape[1]
    mask = static.mask if static.mask is not None else torch.ones_like(static.ids)
    compared = 0
    for (layer, n, t), (_, n2, ref) in zip(static.kv, concat.kv):
        aligned = aligned_written(t, ref, written) if n == n2 else None
        real = None if aligned is None else token_positions(ref, aligned[1], mask)
        if real is None:
            continue
        compared += 1
        assert_close(aligned[0].clone(), ref, c.tol("kv:static"), f"{c.check} after {static.name}: static-path cached "
                     f"{n} of layer {layer} at the {written} written positions vs the concat path's",
                     c.ctx(step=static.name, layer=layer), where=real)
    if not compared:
        c.notes.append(f"{c.check}: the static and concat K/V layouts do not line up: logits compared only")


def judge_tokens(c: GenerateContext, drive: Drive) -> None:
    """The tokens generate returned: `new_tokens` per row (in each turn), each the oracle's greedy choice after
    the ones before it (one uncached forward over the returned sequence; P1's near-tie rule)."""
    seq, S = drive.sequences, drive.prompt_ids.shape[1]
    last, n = drive.turns[-1]
    if seq is None or seq.shape[1] != last + n:
        got = None if seq is None else seq.shape[1] - S
        raise fail(c, drive, f"generate returned {got} positions past the prompt per row, asked for {last + n - S} "
                   "(no end-of-sequence token was given)", "the returned tokens")
    mask = torch.cat([drive.prompt_mask, torch.ones_like(seq[:, S:])], dim=1)
    oracle = c.subject.oracle(seq, mask)
    tol = c.tol(f"logits:{base_path(c.path)}")
    for turn, (start, count) in enumerate(drive.turns):
        for t in range(count):
            name = f"token {t}" if len(drive.turns) == 1 else f"turn {turn + 1} token {t}"
            check_token(seq[:, start + t:start + t + 1], oracle[:, start + t - 1], tol, c, name, what=c.check)


def judge_forced(c: GenerateContext, drive: Drive) -> None:
    """Constrained beam search's contract: every row's new tokens contain the forced one (`FORCED`)."""
    forced = FORCED % c.subject.vocab_size
    S = drive.prompt_ids.shape[1]
    missing = [row for row in range(drive.sequences.shape[0]) if forced not in drive.sequences[row, S:].tolist()]
    if missing:
        raise fail(c, drive, f"rows {missing} of the returned tokens lack the forced token {forced} "
                   f"(force_words_ids=[[{forced}]]): {drive.sequences[:, S:].tolist()}", "the returned tokens")


def reached(c: GenerateContext, drive: Drive) -> None:
    """What the run did to the cache (its calls, k-token calls, crops, reorders), for the report. A run in
    which no forward call was observed, or no call handed or returned a cache, checked nothing of the cache;
    an assisted run that made no k-token call checked nothing of assisted decoding: errors, never a pass."""
    ops = drive.operations()
    c.record("mpt_kv_reach", {"check": c.check, "knobs": {"generate": c.subject.flavour.name, "mode": c.mode,
                                                           "path": c.path, **ops}})
    if not drive.calls:
        raise RuntimeError(f"{c.check}: {c.subject.name}'s generate returned without a forward call of its model "
                           f"({type(c.subject.model).__name__}) the drive could observe: nothing was checked")
    if all(call.returned is None for call in drive.calls):
        raise RuntimeError(f"{c.check}: none of the {len(drive.calls)} calls of {c.subject.name}'s generate returned a "
                           "cache the drive could read: nothing of the cache was checked")
    if c.mode in ASSISTED and not ops["extends"]:
        raise RuntimeError(f"{c.check}: {c.subject.name}'s assisted generate verified no candidates in a k-token call "
                           f"({ops['calls']} calls): nothing of assisted decoding was checked")
    if c.mode == "chunked" and not chunked(drive):
        raise RuntimeError(f"{c.check}: {c.subject.name}'s generate ran the prefill whole though asked for "
                           f"prefill_chunk_size={CHUNK} ({ops['calls']} calls): nothing of chunked prefill was checked")
    if c.mode == "contrastive" and not any(call.ids.shape[0] == drive.prompt_ids.shape[0] * TOP_K
                                           for call in drive.calls[1:]):
        raise RuntimeError(f"{c.check}: {c.subject.name}'s generate scored no candidates in a call of batch x top_k "
                           f"rows ({ops['calls']} calls): nothing of contrastive search was checked")
    if c.mode == "multi-turn" and not continued(drive):
        raise RuntimeError(f"{c.check}: {c.subject.name}'s second turn did not continue the cache the first filled (no "
                           f"call of it received that cache and was fed less than its sequence; {ops['calls']} calls): "
                           "nothing of a continued cache was checked")
    c.notes.append(f"{c.check}: generate made {ops['calls']} calls: {ops['extends']} k-token calls, {ops['crops']} "
                   f"crops, {ops['reorders']} reorders seen [{describe(c.ctx())}]")


def chunked(drive: Drive) -> bool:
    """The prefill ran in chunks: its first call was fed less than the prompt, or it received a cache already
    (transformers 4.x's `_prefill_chunking` calls the model's forward method itself, past the module's hooks:
    the chunks are not observed, the cache they wrote is)."""
    first = drive.calls[0] if drive.calls else None
    return first is not None and (first.fed < drive.prompt_ids.shape[1] or bool(first.received))


def continued(drive: Drive) -> bool:
    """The second turn of a multi-turn run continued the first's cache: its first call received a cache that held
    positions and was fed less than the sequence generate held (the reply and the first turn's last token)."""
    start = drive.turns[-1][0]
    second = next((call for call in drive.calls if call.ids.shape[1] >= start), None)
    return second is not None and bool(second.received) and second.fed < second.ids.shape[1]


def judge_kept(c: GenerateContext, drive: Drive) -> None:
    """Nothing of generate's caches after it returned (module doc): its cache storages still alive are a
    cache kept after the call, unless the implementation declares a cache pool
    (`Capabilities(cache_pool=True)`) or they are the pool generate itself keeps by design (`Flavour.pool`)."""
    from mpt_kv.checks.storages import storage_key

    if not drive.alive:
        return
    if getattr(getattr(c.subject.runner, "capabilities", None), "cache_pool", False):
        c.notes.append(f"{c.check}: cache_pool declared: {len(drive.alive)} cache storages kept for the next generate "
                       f"({sum(n for _, n, _ in drive.alive)} bytes) [{describe(c.ctx())}]")
        return
    pooled, why = c.subject.flavour.pool(c.subject.model) if c.subject.flavour.pool else ([], "")
    pool = {storage_key(t) for t in pooled}
    kept = [(where, n) for where, n, key in drive.alive if key not in pool]
    if len(kept) < len(drive.alive):
        c.notes.append(f"{c.check}: {why}: {len(drive.alive) - len(kept)} cache storages kept by design "
                       f"[{describe(c.ctx())}]")
    if not kept:
        return
    where = "; ".join(f"{w} ({n} bytes)" for w, n in kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "")
    raise PropertyFailure(
        f"{c.check} after generate returned: {len(kept)} cache storages it made are still alive, "
        f"{sum(n for _, n in kept)} bytes: {where} (a cache kept after generate is held between calls: declare "
        f"Capabilities(cache_pool=True) where that is the design) [{describe(c.ctx(step='after generate'))}]")
