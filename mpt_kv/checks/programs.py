"""Programs of cache operations: the roads beam search, assisted (speculative) decoding and
chunked prefill take through the cache (docs/operations.md): what a program is, how one is drawn,
and how it runs on a target. The six ops properties that judge a program (ops-P1 ... ops-retained)
are `mpt_kv.checks.operations`.

A `Program` is a prefill, then a list of `Op`s: one-token decodes, k-token extends (k 2-8, one
cached call), crops back by 1-k positions, and reorders of the rows by a drawn index (identity,
a permutation, repeats as beams do). Drawn in three styles: beam (a decode then a reorder every
step), speculative (extend k, crop back part of it, decode the bonus token) and mixed; every
program ends with a logits-producing call, so the effect of a last crop or reorder is checked.
Tokens are teacher-forced (seeded), not greedy: the properties do not need the model's choice.
`History` follows each row's surviving tokens and padding through the operations: the uncached
oracle's input.

The uncached oracle runs on the history right-padded to the program's cache length (the model
is causal: right padding does not reach earlier positions), so it is ONE input shape per
program: on HPU every new shape is a graph compile. HPU programs take k from `HPU_EXTEND_KS`;
each check notes how many distinct input shapes it fed the target (`shapes fed`, `Fed`).

A target whose operation raises (not an `InputError` of mpt-kv's own Session checks) fails the
property with the exception named and the steps judged before it that held (the crash rule,
`mpt_kv.checks.compare.Crash`, in `run_op`): beam search or assisted decoding would crash at that
step. Two exceptions are not the target's verdict but its environment's or its adapter's, and stay
errors: an `ImportError` (an adapter reaching for what the installed release lacks) and a
`NotImplementedError` (a session that neither implements an operation nor declares it
unsupported in its Capabilities).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from mpt_kv.checks.cases import MASK_DTYPES, Case, Context
from mpt_kv.checks.compare import NOT_CRASHES, crash_of, describe
from mpt_kv.checks.results import snapshot
from mpt_kv.checks.strategies import (BF16_MIN_D_MODEL, HPU_PROMPT_BUCKET, VOCAB_SIZES, HypothesisPicks, case_from,
                                     config_fields)
from mpt_kv.model.config import ModelConfig
from mpt_kv.model.session import pad_right

OPERATIONS = ("extend", "crop", "reorder")  # the Capabilities features; decode is always there
EXTEND_KS = tuple(range(2, 9))
HPU_EXTEND_KS = (4, 8)       # bucketed: every k is a graph compile on HPU
HPU_OPS_NEW_TOKENS = 16      # cache length on HPU: the 128-token prompt + 16
HPU_SHAPE_BUDGET = 12        # distinct input shapes one ops check may feed a target on HPU (tests/test_operations.py)
STYLES = ("beam", "speculative", "mixed")  # drawn; the fixed corner program's style is "corner"


@dataclass(frozen=True)
class Op:
    kind: str                    # "decode" | "extend" | "crop" | "reorder"
    k: int = 1                   # decode: 1; extend: tokens in the call; crop: positions removed
    index: tuple[int, ...] = ()  # reorder: row b takes row index[b]

    def describe(self) -> str:
        if self.kind == "extend":
            return f"extend {self.k}"
        if self.kind == "crop":
            return f"crop -{self.k}"
        if self.kind == "reorder":
            return f"reorder {list(self.index)}"
        return "decode"


@dataclass(frozen=True)
class Program:
    """A prefill of `case`'s prompt into a cache of `max_len` positions, then `ops`."""

    case: Case
    ops: tuple[Op, ...]
    style: str = "mixed"
    max_len: int = field(init=False)  # the case's prompt + new_tokens

    def __post_init__(self):
        S, B, t, top = self.case.prompt_len, self.case.batch, self.case.prompt_len, self.case.prompt_len
        for i, op in enumerate(self.ops):
            if op.kind in ("decode", "extend"):
                t += op.k
            elif op.kind == "crop":
                if not 1 <= op.k <= t - S:
                    raise ValueError(f"op {i} ({op.describe()}): crops into the prompt or past position 0 at {t}")
                t -= op.k
            elif op.kind == "reorder":
                if len(op.index) != B or not all(0 <= j < B for j in op.index):
                    raise ValueError(f"op {i} ({op.describe()}): expected {B} rows in 0..{B - 1}")
            else:
                raise ValueError(f"op {i}: unknown kind {op.kind!r}")
            top = max(top, t)
        if top > self.case.total_len:
            raise ValueError(f"program reaches {top} positions, beyond its cache length {self.case.total_len} "
                             "(prompt + new_tokens of its case)")
        # the cache length of every session, and the oracle's padded length: the case's, not the
        # positions reached, so that programs of one case have one shape (a graph compile each on HPU)
        object.__setattr__(self, "max_len", self.case.total_len)

    def kinds(self) -> set[str]:
        return {op.kind for op in self.ops}

    def tokens(self, step: int, k: int, device) -> torch.Tensor:
        """The (B, k) tokens op `step` feeds: seeded by the case's seed and the step."""
        g = torch.Generator().manual_seed(self.case.seed * 1009 + step)
        return torch.randint(0, self.case.cfg.vocab_size, (self.case.batch, k), generator=g).to(device)

    def describe(self) -> str:
        return f"{self.style}: prefill, " + ", ".join(op.describe() for op in self.ops) + f" (cache length {self.max_len})"


# --- drawing programs --------------------------------------------------------------------------------------

def beam_index(pick, batch: int) -> tuple[int, ...]:
    """Identity, a permutation, or rows drawn with repeats (beams that survive twice)."""
    kind = pick.choice(["identity", "permutation", "repeats"])
    if kind == "identity":
        return tuple(range(batch))
    if kind == "permutation":
        rows = list(range(batch))
        for i in range(batch - 1, 0, -1):  # Fisher-Yates with drawn choices (shrinks towards identity)
            j = pick.integer(0, i)
            rows[i], rows[j] = rows[j], rows[i]
        return tuple(rows)
    return tuple(sorted(pick.integer(0, batch - 1) for _ in range(batch)))


def ops_from(pick, case: Case, style: str, allowed: set[str], ks: tuple[int, ...], n_ops: int,
             room: int) -> tuple[Op, ...]:
    """Up to `n_ops` groups of operations of `style` that fit in `room` positions after the prompt,
    ending with a decode or an extend (so the last crop or reorder is checked)."""
    ops, t, S = [], 0, case.prompt_len  # t: positions past the prompt
    for _ in range(n_ops):
        if style == "beam":
            group = ["decode", "reorder"]
        elif style == "speculative":
            group = ["extend", "crop", "decode"]
        else:
            group = [pick.choice(["decode", *sorted(allowed)])]
        for kind in group:
            if kind not in allowed and kind != "decode":
                continue
            if kind == "decode" and t + 1 <= room:
                ops.append(Op("decode"))
                t += 1
            elif kind == "extend":
                fits = [k for k in ks if t + k <= room]
                if fits:
                    k = pick.choice(fits)
                    ops.append(Op("extend", k))
                    t += k
            elif kind == "crop" and t >= 1:
                last = ops[-1].k if ops and ops[-1].kind == "extend" else t
                ops.append(Op("crop", pick.integer(1, min(last, t))))
                t -= ops[-1].k
            elif kind == "reorder":
                ops.append(Op("reorder", index=beam_index(pick, case.batch)))
    if t + 1 <= room and (not ops or ops[-1].kind in ("crop", "reorder")):
        ops.append(Op("decode"))
    return tuple(ops)


def small_case_from(pick, min_d_model: int = 1) -> Case:
    """The CPU space of the programs: the operations, not the model, are what is drawn wide, so the
    model is small (d_model <= 64, 1-2 layers; the properties' own cases cover the wide ones):
    head counts that are and are not powers of two, 1-3 rows of 1-10 prompt tokens, left-padded;
    the config fields the value checks draw (`strategies.config_fields`: clip_qkv, alibi_bias_max,
    layer_norm_epsilon) and their vocabulary sizes (`strategies.VOCAB_SIZES`)."""
    n_heads, head_dim = pick.choice([(h, d) for h in (1, 2, 3, 4) for d in (4, 8, 16) if h * d >= min_d_model])
    batch = pick.integer(1, 3)
    lens = tuple(pick.integer(1, 10) for _ in range(batch))
    cfg = ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=pick.integer(1, 2),
                      vocab_size=pick.choice(VOCAB_SIZES), max_seq_len=pick.choice([32, 64]), **config_fields(pick))
    return Case(cfg, lens, 12, seed=pick.integer(0, 2**16), mask_dtype=pick.choice(MASK_DTYPES))


def program_from(pick, device: str, allowed: set[str], dtype=None, capabilities=None, style=None) -> Program:
    min_d = BF16_MIN_D_MODEL if dtype == torch.bfloat16 else 1
    case = case_from(pick, device, False, min_d) if device == "hpu" else small_case_from(pick, min_d)
    if capabilities is not None and capabilities.reason("clip_qkv") and case.cfg.clip_qkv is not None:
        case = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, clip_qkv=None))
    styles = [s for s in STYLES if s == "mixed" or (s == "beam" and "reorder" in allowed)
              or (s == "speculative" and {"extend", "crop"} <= allowed)]
    style = style or pick.choice(styles)
    if device == "hpu":
        room, ks = HPU_OPS_NEW_TOKENS, HPU_EXTEND_KS
        cfg = dataclasses.replace(case.cfg, max_seq_len=max(case.cfg.max_seq_len, HPU_PROMPT_BUCKET + room))
        case = dataclasses.replace(case, cfg=cfg, new_tokens=room)
    else:
        room, ks = max(case.new_tokens, 12), EXTEND_KS
        room = min(room, case.cfg.max_seq_len - case.prompt_len)
        if room < 1:  # the drawn prompt fills max_seq_len: make room for the program
            cfg = dataclasses.replace(case.cfg, max_seq_len=case.cfg.max_seq_len + 12)
            case, room = dataclasses.replace(case, cfg=cfg), 12
        case = dataclasses.replace(case, new_tokens=room)
    ops = ops_from(pick, case, style, allowed, ks, pick.integer(2, 5), room)
    return Program(case, ops, style)


def programs(device: str = "cpu", allowed: set[str] = frozenset(OPERATIONS), dtype=None, capabilities=None):
    """Hypothesis strategy of `Program`s using only the `allowed` operations."""
    @st.composite
    def draw(d):
        return program_from(HypothesisPicks(d), device, set(allowed), dtype, capabilities)

    return draw()


def _cfg(n_heads, head_dim, n_layers, max_seq_len, clip_qkv=None):
    return ModelConfig(d_model=n_heads * head_dim, n_heads=n_heads, n_layers=n_layers, vocab_size=64,
                       max_seq_len=max_seq_len, clip_qkv=clip_qkv)


# Every run reaches both styles, whatever hypothesis draws: a beam search of 3 beams (a reorder every
# step: a permutation, repeats, identity) and an assisted decoding (extend k, crop, bonus token).
FIXED = {
    "beam": Program(Case(_cfg(3, 8, 2, 32), (5, 3, 4), 8, seed=21), (
        Op("decode"), Op("reorder", index=(2, 0, 1)), Op("decode"), Op("reorder", index=(1, 1, 0)),
        Op("decode"), Op("reorder", index=(0, 1, 2)), Op("decode"), Op("reorder", index=(2, 2, 2)), Op("decode")),
        "beam"),
    "speculative": Program(Case(_cfg(2, 8, 2, 32), (6, 2), 14, seed=22), (
        Op("extend", 5), Op("crop", 3), Op("decode"), Op("extend", 8), Op("crop", 1), Op("decode"),
        Op("extend", 2), Op("crop", 2), Op("decode")), "speculative"),
}
HPU_FIXED = {
    "beam": Program(Case(_cfg(4, 32, 1, 256), (128, 60), 16, seed=21), (
        Op("decode"), Op("reorder", index=(1, 0)), Op("decode"), Op("reorder", index=(1, 1)), Op("decode")), "beam"),
    "speculative": Program(Case(_cfg(4, 32, 1, 256), (128, 60), 16, seed=22), (
        Op("extend", 8), Op("crop", 3), Op("decode"), Op("extend", 4), Op("crop", 4), Op("decode")), "speculative"),
}


# The corner: batch 1, one head, one layer, a prompt of 1, where a slice of the cache is contiguous
# and `.contiguous()` of it is no copy (size-1 dimensions make every (1, 1, n, hd) slice so); the
# drawn programs rarely get there. Its groups of operations, each kept where the target implements
# all of it: an assisted decoding's extend and crop, a beam step's reorder (batch 1: the identity),
# a chunk, and a crop back to the prompt.
CORNER_CASE = Case(_cfg(1, 8, 1, 16), (1,), 9, seed=23)
CORNER_GROUPS = (
    (Op("extend", 3), Op("crop", 2), Op("decode")),
    (Op("reorder", index=(0,)), Op("decode")),
    (Op("extend", 4), Op("crop", 6), Op("decode")),  # back past the chunk, into the first group's tokens
)


def corner_program(allowed: set[str]) -> Program | None:
    """The corner program of the operations in `allowed` (None where it would have none)."""
    ops = tuple(op for group in CORNER_GROUPS if {op.kind for op in group} - {"decode"} <= allowed for op in group)
    return Program(CORNER_CASE, ops, "corner") if ops else None


def fixed_programs(device: str, allowed: set[str]) -> list[Program]:
    """The fixed programs the target can run: a beam search and an assisted decoding (`FIXED`), and
    on CPU and CUDA the corner (`corner_program`; on HPU each shape is a graph compile: not there)."""
    chosen = HPU_FIXED if device == "hpu" else FIXED
    out = [p for p in chosen.values() if p.kinds() - {"decode"} <= allowed]
    corner = corner_program(allowed) if device != "hpu" else None
    return out + ([corner] if corner is not None else [])


# --- running a program --------------------------------------------------------------------------------------

class Fed:
    """The distinct input shapes a check fed one target (on HPU each is a graph compile)."""

    def __init__(self):
        self.shapes: set[tuple] = set()

    def add(self, call: str, t: torch.Tensor) -> None:
        self.shapes.add((call, tuple(t.shape)))


class History:
    """Each row's surviving tokens and padding (the oracle's input), following every operation."""

    def __init__(self, ids, mask):
        self.ids, self.mask = ids, mask

    def apply(self, op: Op, tokens):
        if op.kind in ("decode", "extend"):
            self.ids = torch.cat([self.ids, tokens], dim=1)
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, tokens.shape[1])], dim=1)
        elif op.kind == "crop":
            self.ids, self.mask = self.ids[:, :-op.k], self.mask[:, :-op.k]
        elif op.kind == "reorder":
            index = torch.tensor(op.index, device=self.ids.device)
            self.ids, self.mask = self.ids[index], self.mask[index]

    def padded(self, length: int):
        """(ids, mask) right-padded to `length`: one oracle shape per program."""
        return pad_right(self.ids, length, 0), pad_right(self.mask, length, 0)


def run_op(session, op: Op, tokens, step, what: str, c: Context, fed: Fed, held=()):
    """One operation on the target's live session; logits (B, k, V) copied at once, or None. A
    target that raises fails the property, the exception named (the crash rule,
    `mpt_kv.checks.compare.Crash`; `held`: the steps judged before it that held), unless it is an
    ImportError or NotImplementedError (module doc)."""
    live = getattr(session, "live", session)
    try:
        if op.kind == "decode":
            fed.add("decode", tokens)
            return snapshot(live.decode(tokens))[:, None]
        if op.kind == "extend":
            fed.add("extend", tokens)
            return snapshot(live.extend(tokens))
        if op.kind == "crop":
            live.crop(live.written - op.k)
        else:
            live.reorder(torch.tensor(op.index, device=live.device))
        return None
    except (*NOT_CRASHES, ImportError, NotImplementedError):
        raise  # ImportError, NotImplementedError: the environment's or the adapter's, an error (module doc)
    except Exception as e:  # noqa: BLE001  the target's own operation crashed
        raise crash_of(what, "the target", op.kind, e, c.ctx(step=step, operation=op.kind),
                       at=f" at step {step} ({op.describe()})").held(held) from e


def ctx_of(c: Context, program: Program, **more) -> dict:
    return c.ctx(program=program.describe(), **more)


def program_of(c: Context, program, fed) -> tuple[Program, Fed]:
    """The program an ops check runs (`c.program`, set by the run layer, or given) and what records
    the shapes it feeds (`c.fed`, or a fresh one)."""
    program = program if program is not None else c.program
    if program is None:
        raise ValueError(f"an ops check runs a program of cache operations: give Context(..., program=Program(...)) "
                         f"[{describe(c.ctx())}]")
    return program, fed if fed is not None else (c.fed if c.fed is not None else Fed())


# one fixed case per path: 3 layers (a whole-cache copy is 3 x the per-layer bound), 3 rows; a prompt
# of 16 then the operation: a reorder with repeats, or an extend of 8 to the cache length 24, or
# (ops-retained) 8 decode steps to it and a crop of 5; then the same on the corner: batch 1, one
# head, one layer, a prompt of 1 (where `.contiguous()` of a slice is no copy)
MEMORY_CASE = Case(_cfg(4, 8, 3, 64), (16, 12, 14), 8, seed=31)
MEMORY_CORNER = Case(_cfg(1, 8, 1, 16), (1,), 8, seed=32)
MEMORY_CASES = (MEMORY_CASE, MEMORY_CORNER)
