"""Analytic memory model of MPT generation with a KV cache (no weights needed).

Sizes in bytes. Notation: B batch, L cache length (= prompt + new tokens: the
cache is preallocated), q tokens in a forward (L at prefill, 1 at decode),
D d_model, H heads, hd = D / H, n layers, V vocab, e MLP expansion ratio,
s itemsize of the model dtype. One "unit" u = B * L * D * s: the size of one of
q, k, v for the whole sequence in one layer.

Cache kept as views vs clones. MPT projects q, k, v with one fused matmul
(Wqkv: mixed_qkv, B*L*3D) and chunks it into three views. A view keeps its
whole storage alive, so a cache that stores k and v as views pins all of
mixed_qkv, q included: 3 units per layer. Cloning k and v keeps 2 units and
lets mixed_qkv die with the layer's locals. That is the optimum-habana PR
"refine use cache for mpt model" (seeds/): the "before" rows kept views.

Two models:
- `estimate`: eager PyTorch (each op's output is its own allocation). Used by
  bench and the ceilings, and by `python -m mpt_kv memory` for any config.
- `gaudi_seed_terms`: the seed PR's run on Gaudi (lazy mode, HPU graphs,
  optimum-habana's text-generation example at the PR's commit), term by term
  from the code and documents that produce each term. `leave_one_out` checks it
  against the seed table. docs/memory-model.md has the sources and the result.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20

# ---------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class Shape:
    d_model: int
    n_heads: int
    n_layers: int
    vocab_size: int
    max_seq_len: int
    expansion_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, Shape] = {
    "tiny": Shape(d_model=64, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64),
    "small": Shape(d_model=256, n_heads=8, n_layers=4, vocab_size=1024, max_seq_len=512),
    # mosaicml/mpt-7b config.json; max_seq_len 2048 covers the seed's 1024 + 1024.
    "mpt-7b": Shape(d_model=4096, n_heads=32, n_layers=32, vocab_size=50432, max_seq_len=2048),
    # mosaicml/mpt-30b config.json.
    "mpt-30b": Shape(d_model=7168, n_heads=64, n_layers=48, vocab_size=50432, max_seq_len=8192),
}

DTYPES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


# ---------------------------------------------------------------------------
# Terms


def n_params(shape: Shape) -> int:
    """V*D (embedding, tied with lm_head) + n*((3 + 1 + 2e)*D^2 + 2D) + D.

    Per layer: Wqkv 3D^2, out_proj D^2, MLP up and down e*D^2 each, two
    LayerNorms with a weight and no bias (MPT's no_bias); then the final
    LayerNorm. No linear has a bias. mpt-7b: 6,649,286,656 ("6.7B").
    """
    D, e = shape.d_model, shape.expansion_ratio
    per_layer = (3 + 1 + 2 * e) * D * D + 2 * D
    return shape.vocab_size * D + shape.n_layers * per_layer + D


def weights_bytes(shape: Shape, itemsize: int) -> int:
    """n_params(shape) * s."""
    return n_params(shape) * itemsize


def kv_cache_bytes(shape: Shape, batch: int, length: int, itemsize: int) -> int:
    """2 (k and v) * n * B * H * L * hd * s = 2 units per layer."""
    return 2 * shape.n_layers * batch * shape.n_heads * length * shape.head_dim * itemsize


def view_retention_bytes(shape: Shape, batch: int, length: int, itemsize: int) -> int:
    """n * B * L * D * s: what a view-kept cache holds beyond a cloned one.

    Views of mixed_qkv pin its whole storage (q, k, v: 3 units per layer);
    clones hold only k and v (2 units). The difference is the q third, one
    unit per layer, for as long as the cache lives.
    """
    return shape.n_layers * batch * length * shape.d_model * itemsize


def scores_bytes(
    shape: Shape, batch: int, q_len: int, kv_len: int, itemsize: int,
    softmax_itemsize: int = 4, fused_softmax: bool = False,
) -> int:
    """Peak bytes of the attention-score chain of one layer; S = B * H * q * kv.

    Eager, softmax upcast (MPT: `softmax(scores.float()).to(dtype)`): the
    scores in the model dtype stay referenced while their upcast copy and the
    softmax output exist: S * (s + 2 * softmax_itemsize). Softmax in the model
    dtype: S * 2s (input and output). fused_softmax: a graph compiler fuses
    the elementwise chain (scale, +ALiBi, mask, softmax, cast), leaving one
    S * s tensor, the probabilities `attn_weights`.
    """
    n = batch * shape.n_heads * q_len * kv_len
    if fused_softmax:
        return n * itemsize
    if softmax_itemsize != itemsize:
        return n * (itemsize + 2 * softmax_itemsize)
    return n * 2 * itemsize


def layer_transients(
    shape: Shape, batch: int, q_len: int, kv_len: int, itemsize: int,
    softmax_itemsize: int = 4, fused_softmax: bool = False, qkv_retained: bool = False,
) -> int:
    """Peak bytes one MPT block holds beyond the cache; unit uq = B * q * D * s.

    attention: residual uq + norm_1 output uq + mixed_qkv 3uq (0 when the
        cache's views already hold it: qkv_retained) + score chain (scores_bytes);
    MLP: residual uq + norm_2 output uq + up_proj e*uq + GELU output e*uq
        (GELU is out of place, its input lives until it returns).
    Returns the larger. Ignores context/out_proj (1 uq each, after the scores
    die) and kernel workspaces.
    """
    uq = batch * q_len * shape.d_model * itemsize
    attention = 2 * uq + (0 if qkv_retained else 3 * uq) + scores_bytes(
        shape, batch, q_len, kv_len, itemsize, softmax_itemsize, fused_softmax
    )
    mlp = 2 * uq + 2 * shape.expansion_ratio * uq
    return max(attention, mlp)


def logits_bytes(shape: Shape, batch: int, q_len: int, trim: bool, itemsize: int = 2) -> int:
    """B * (1 if trim else q) * V * s: lm_head output in the model dtype.

    trim (trim_logits): the model keeps only the last position's hidden state
    before lm_head. Ignores generate's fp32 copy of the last row (B * V * 4).
    """
    return batch * (1 if trim else q_len) * shape.vocab_size * itemsize


# ---------------------------------------------------------------------------
# Whole generation


@dataclass(frozen=True)
class Estimate:
    """Bytes for one generate() call; see `estimate`."""

    weights: int
    kv_cache: int
    retained_views: int  # 0 for a fixed (cloned) cache
    held: int  # caches of earlier calls still referenced
    peak_transient: int  # largest excess over weights + held + cache, any phase
    allocated_after: int  # weights + held + cache (+ views): end of generation
    allocated_returned: int  # weights + held: after generate() dropped its cache
    max_allocated: int  # weights + held + cache (+ views) + peak_transient

    @staticmethod
    def header(unit: int = GiB) -> str:
        name = {GiB: "GiB", MiB: "MiB"}[unit]
        return f"{'weights':>8} {'kv':>7} {'views':>7} {'held':>7} {'transnt':>7} {'alloc':>7} {'max':>7}  ({name})"

    def row(self, unit: int = GiB) -> str:
        vals = (self.weights, self.kv_cache, self.retained_views, self.held,
                self.peak_transient, self.allocated_after, self.max_allocated)
        return f"{vals[0] / unit:8.2f} " + " ".join(f"{v / unit:7.2f}" for v in vals[1:])


def estimate(
    shape: Shape, batch: int, max_input: int, max_new: int, itemsize: int, fixed: bool,
    trim_logits: bool = True, softmax_itemsize: int = 4, fused_softmax: bool = False,
    held_caches: int = 0,
) -> Estimate:
    """Memory of a static-shape generation: cache preallocated for L = input + new.

    As in optimum-habana's default static shapes, the prompt is padded to L
    and prefill runs over all L positions; each decode step index_copy_'s
    one token into the cache (no growth). Resident R = weights + held +
    cache (+ n*u views if not fixed). Phases, each adding to R:
      prefill, last layer: its block transients (the causal mask B*L*L bool
        lives through the forward) -- mixed_qkv counted once when views keep it;
      end of prefill: final hidden u + logits over L (or 1 with trim_logits);
      decode step: block transients at q = 1, kv = L (small).
    held_caches: caches of earlier calls that something still references (an
    HPU graph keeps the tensors it was captured with); each is as big as this
    call's cache including pinned views.
    """
    L = max_input + max_new
    w = weights_bytes(shape, itemsize)
    kv = kv_cache_bytes(shape, batch, L, itemsize)
    views = 0 if fixed else view_retention_bytes(shape, batch, L, itemsize)
    held = held_caches * (kv + views)
    u = batch * L * shape.d_model * itemsize
    mask = batch * L * L  # bool causal mask of the prefill
    prefill = mask + layer_transients(
        shape, batch, L, L, itemsize, softmax_itemsize, fused_softmax, qkv_retained=not fixed
    )
    end_of_prefill = u + logits_bytes(shape, batch, L, trim_logits, itemsize)
    decode = layer_transients(shape, batch, 1, L, itemsize, softmax_itemsize, fused_softmax)
    decode += logits_bytes(shape, batch, 1, True, itemsize)
    transient = max(prefill, end_of_prefill, decode)
    resident = w + held + kv + views
    return Estimate(
        weights=w, kv_cache=kv, retained_views=views, held=held, peak_transient=transient,
        allocated_after=resident, allocated_returned=w + held, max_allocated=resident + transient,
    )


# ---------------------------------------------------------------------------
# The seed PR's table


@dataclass(frozen=True)
class SeedRow:
    version: str  # "before": cache kept as views of mixed_qkv; "after": clones
    batch: int
    max_input: int
    max_new: int
    throughput: float  # tokens/s, including tokenization
    allocated_gb: float  # "Memory allocated(GB)": InUse after the last generate()
    max_allocated_gb: float  # "Max memory allocated(GB)": MaxInUse, never reset


# mpt-7b, bf16, one Gaudi: run_generation.py --use_hpu_graphs --use_kv_cache
# --limit_hpu_graph --batch_size B --max_input_tokens I --max_new_tokens N
# --trim_logits --attn_softmax_bf16 --warmup 3 --n_iterations 1 --bf16
SEED_TABLE: list[SeedRow] = [
    SeedRow("before", 128, 128, 128, 2900, 37.28, 64.39),
    SeedRow("after", 128, 128, 128, 4803, 29.28, 48.39),
    SeedRow("before", 16, 128, 1024, 624, 26.55, 41.79),
    SeedRow("after", 16, 128, 1024, 1215, 23.04, 33.77),
    SeedRow("before", 2, 1024, 1024, 197, 16.27, 19.66),
    SeedRow("after", 2, 1024, 1024, 255, 15.27, 17.66),
    SeedRow("before", 16, 1024, 1024, 384, 40.78, 67.86),
    SeedRow("after", 16, 1024, 1024, 846, 32.78, 51.86),
]
SEED_ITEMSIZE = 2  # --bf16
TOLERANCE = 0.03  # rows further off than this get an explanation or "unexplained"

# ---------------------------------------------------------------------------
# The seed run on Gaudi, term by term
#
# Nothing here was run on a Gaudi. Each term is read from the code that made
# the table; citations use these sources:
#   [RG] optimum-habana @ 9a5fe2c (the PR's merge), examples/text-generation/run_generation.py
#   [EU]   same commit, examples/text-generation/utils.py
#   [GU]   same commit, optimum/habana/transformers/generation/utils.py
#   [MPT]  same commit, optimum/habana/transformers/models/mpt/modeling_mpt.py
#   [HG] HabanaAI/gaudi-pytorch-bridge 1.19.0, python_packages/habana_frameworks/torch/hpu/graphs.py
#   [WS]   same, python_packages/habana_frameworks/torch/core/weight_sharing.py and core/__init__.py
#   [DM]   same, backend/synapse_helpers/{graph.cpp, device.cpp, device_memory.cpp, device_mem_stats.h}
#   [HD] Intel Gaudi docs: "Weight Sharing" (PyTorch user guide), "HPU Graphs for Training"
# The bridge source is release 1.19 (Jan 2025); the PR ran on an older release
# (mid 2024). The optimum-habana side is read at the PR's own commit.
#
# When the two readings are taken ([RG] 468-509): after the warmup calls and the
# one measured generate(), which returned and was copied to the host; nothing
# resets the peak, so "max" is the peak of the whole process.


def attention_probs_bytes(shape: Shape, batch: int, q_len: int, kv_len: int, itemsize: int) -> int:
    """B * H * q * kv * s: one layer's attention probabilities in the model dtype."""
    return batch * shape.n_heads * q_len * kv_len * itemsize


def untied_lm_head_bytes(shape: Shape, itemsize: int) -> int:
    """V * D * s: lm_head's own copy of the embedding matrix, once the tie is broken.

    MPT ties lm_head.weight to transformer.wte.weight (one V x D matrix, counted
    once in n_params). In lazy mode the Gaudi bridge keeps shared parameters
    shared across `model.to("hpu")` only through its weight-sharing wrapper of
    Module.to, which "recreates shared parameters" after the move ([WS]
    weight_sharing.py wrapped_to; [HD] "Weight Sharing": a model may need its
    weights shared again after moving it to the HPU). The wrapper is installed
    when habana_frameworks.torch.core is imported, unless EXPERIMENTAL_WEIGHT_SHARING
    is false ([WS] core/__init__.py _enable_weight_sharing_if_needed). The
    example sets EXPERIMENTAL_WEIGHT_SHARING=FALSE in setup_env ([EU] 136) before
    setup_device imports the core ([EU] 571-572), then calls model.to(device)
    ([EU] 229): lm_head and wte come out as two matrices. Inferred from the
    wrapper's existence; the plain lazy-mode path was not read in the bridge's C++.
    """
    return shape.vocab_size * shape.d_model * itemsize


@dataclass(frozen=True)
class GaudiSeedTerms:
    """Bytes of each term of one seed row; scratch is the one term without a formula.

    "Memory allocated" = weights + untied_lm_head + graph_cache + graph_logits + scratch
    "Max memory allocated" = that + cache + prefill_logits + next_token_logits
    (the peak is the prefill of a call made while the graph holds an earlier call's cache).
    """

    weights: int  # n_params * s
    untied_lm_head: int  # see untied_lm_head_bytes
    # The decode step's HPU graph keeps the inputs it was captured with
    # ([HG] 615 graph_inputs = inputs, 632 cache[h] = CachedParams(...)) and copies
    # each later call's inputs into them (644). Its inputs include past_key_values,
    # so one whole cache stays alive after generate() returns, pinned views included
    # ("before": views of the capture call's mixed_qkv). optimum-habana frees them
    # only with --bucket_internal ([GU] 1886-1896 clear_inputs), which the seed run
    # did not pass. [HD] "HPU Graphs for Training": fixed memory for inputs and outputs.
    graph_cache: int
    graph_logits: int  # the graph's kept outputs ([HG] 656): decode logits B x 1 x V
    # This call's cache at the end of its prefill: 2 units per layer, 3 for views.
    cache: int
    # lm_head over every prefill position: GaudiMptForCausalLM.forward takes no
    # trim_logits ([MPT] 372), so --trim_logits (and --attn_softmax_bf16) never reach MPT;
    # prepare_inputs_for_generation passes only its own keys ([MPT] 329-336).
    prefill_logits: int  # B x L x V
    next_token_logits: int  # index_select of the prefill logits, B x V ([GU] 1792)
    # The bridge keeps one scratch buffer per device for recipe intermediates, grows
    # it to the largest recipe's need and keeps it ([DM] device_memory.cpp 432, device.cpp
    # 1598; graph.cpp 761: shrunk only when an allocation would fail), counted in
    # InUse ([DM] device_mem_stats.h 135-145). The largest recipe is the prefill (not
    # graphed: --limit_hpu_graphs bypasses the graph for the first token, [GU] 149-156),
    # run as one lazy-mode graph. How much scratch the graph compiler gives it is not
    # documented: the model counts it in one layer's attention probabilities,
    # scratch = k * probs, with k derived from other rows (leave_one_out).
    probs: int  # B x H x L x L x s

    def allocated(self, k: float) -> float:
        return self.weights + self.untied_lm_head + self.graph_cache + self.graph_logits + k * self.probs

    def max_allocated(self, k: float) -> float:
        return self.allocated(k) + self.cache + self.prefill_logits + self.next_token_logits


def gaudi_seed_terms(row: SeedRow, shape: Shape = PRESETS["mpt-7b"], itemsize: int = SEED_ITEMSIZE) -> GaudiSeedTerms:
    """The terms of one seed row: static shapes pad the prompt to L = input + new ([GU] 869-888),
    so the prefill runs over L positions and the cache holds L."""
    B, L, s = row.batch, row.max_input + row.max_new, itemsize
    cache = kv_cache_bytes(shape, B, L, s)
    if row.version == "before":
        cache += view_retention_bytes(shape, B, L, s)
    return GaudiSeedTerms(
        weights=weights_bytes(shape, s),
        untied_lm_head=untied_lm_head_bytes(shape, s),
        graph_cache=cache,
        graph_logits=logits_bytes(shape, B, 1, True, s),
        cache=cache,
        prefill_logits=logits_bytes(shape, B, L, False, s),
        next_token_logits=logits_bytes(shape, B, 1, True, s),
        probs=attention_probs_bytes(shape, B, L, L, s),
    )


def scratch_multiple(rows: list[SeedRow]) -> float:
    """k such that scratch = k * probs, derived from `rows`' "Memory allocated".

    Per row, scratch is the only unknown in that column: k_row = (measured -
    every other term) / probs. The median over rows, so that one row the model
    does not explain cannot move the others' predictions.
    """
    if not rows:
        raise ValueError("scratch_multiple needs at least one row")
    ks = []
    for row in rows:
        t = gaudi_seed_terms(row)
        ks.append((row.allocated_gb * GiB - t.allocated(0)) / t.probs)
    return statistics.median(ks)


@dataclass(frozen=True)
class SeedComparison:
    row: SeedRow
    terms: GaudiSeedTerms
    k: float  # scratch multiple derived from the other rows only
    model_allocated_gb: float
    allocated_error: float  # (model - measured) / measured
    model_max_gb: float
    max_error: float
    note: str  # "" within TOLERANCE; else the explanation, or "unexplained: ..."


def _pair(row: SeedRow, rows: list[SeedRow]) -> SeedRow | None:
    other = "after" if row.version == "before" else "before"
    key = (row.batch, row.max_input, row.max_new)
    return next((r for r in rows if r.version == other and (r.batch, r.max_input, r.max_new) == key), None)


def _misfit_note(row: SeedRow, model_alloc: float, model_max: float, rows: list[SeedRow]) -> str:
    """What the table itself says about a row the model misses (no explanation is invented)."""
    note = (f"unexplained: model - measured = {model_alloc - row.allocated_gb:+.2f} GiB (alloc), "
            f"{model_max - row.max_allocated_gb:+.2f} GiB (max)")
    pair = _pair(row, rows)
    if pair is not None:
        before, after = (row, pair) if row.version == "before" else (pair, row)
        L = row.max_input + row.max_new
        v = view_retention_bytes(PRESETS["mpt-7b"], row.batch, L, SEED_ITEMSIZE) / GiB
        note += (f"; its before-after gaps, alloc {before.allocated_gb - after.allocated_gb:.2f} and max "
                 f"{before.max_allocated_gb - after.max_allocated_gb:.2f} GiB, against the views' "
                 f"n*u = {v:.2f} and 2*n*u = {2 * v:.2f} GiB")
    return note


def leave_one_out(rows: list[SeedRow] = SEED_TABLE) -> list[SeedComparison]:
    """Each row predicted by the model with k derived from the other rows only.

    k is the one quantity taken from the table; every other term is a formula
    of the row's config. The "max" column is predicted with no quantity from it.
    """
    out = []
    for i, row in enumerate(rows):
        k = scratch_multiple(rows[:i] + rows[i + 1:])
        t = gaudi_seed_terms(row)
        alloc, peak = t.allocated(k) / GiB, t.max_allocated(k) / GiB
        a_err = (alloc - row.allocated_gb) / row.allocated_gb
        m_err = (peak - row.max_allocated_gb) / row.max_allocated_gb
        note = "" if max(abs(a_err), abs(m_err)) <= TOLERANCE else _misfit_note(row, alloc, peak, rows)
        out.append(SeedComparison(row, t, k, alloc, a_err, peak, m_err, note))
    return out


def seed_comparison() -> list[SeedComparison]:
    """The seed table against the Gaudi model, leave-one-out (see leave_one_out)."""
    return leave_one_out(SEED_TABLE)


def seed_units() -> dict[str, list[float]]:
    """Per before/after pair: |relative error| of the measured "Memory allocated"
    gap vs the views' extra (n * u), reading the table's GB as GiB or as 1e9 bytes.
    (optimum-habana's to_gb_rounded divides by 1024**3.)
    """
    shape = PRESETS["mpt-7b"]
    errs: dict[str, list[float]] = {"GiB": [], "GB": []}
    for b, a in zip(SEED_TABLE[0::2], SEED_TABLE[1::2]):
        v = view_retention_bytes(shape, b.batch, b.max_input + b.max_new, SEED_ITEMSIZE)
        gap = b.allocated_gb - a.allocated_gb
        errs["GiB"].append(abs(gap * GiB - v) / v)
        errs["GB"].append(abs(gap * 1e9 - v) / v)
    return errs


SEED_TERMS_TEXT = """\
model (GiB; sources in mpt_kv/memory/analytic.py and docs/memory-model.md; read from code, not run on a Gaudi):
  alloc = W + lm_head + graph cache + graph logits + scratch     max = alloc + cache + prefill logits + next logits
  W          n_params x 2 (bf16)
  lm_head    V x D x 2: EXPERIMENTAL_WEIGHT_SHARING=FALSE in the example unties lm_head from wte on .to("hpu")
  graph      the decode HPU graph keeps its captured inputs (one whole cache, pinned views included) and
             its output logits (B x V); optimum-habana clears them only with --bucket_internal
  cache      this call's cache at its prefill: 2 units per layer, 3 when kept as views (n*u = n x B x L x D x 2)
  logits     B x L x V x 2 over the padded prefill (MPT took no --trim_logits), and the next-token row B x V x 2
  scratch    the bridge's kept scratch buffer, sized by the graph compiler for the prefill (not documented):
             k x probs, probs = B x H x L^2 x 2, k = median over the OTHER rows' alloc (leave-one-out)"""


def seed_table_text() -> str:
    rows = seed_comparison()
    lines = [SEED_TERMS_TEXT, ""]
    lines.append(
        f"{'version':7} {'B':>4} {'in':>5} {'new':>5} | {'alloc':>6} {'model':>6} {'err':>7} | "
        f"{'max':>6} {'model':>6} {'err':>7} | {'k':>6}   (GiB)"
    )
    for c in rows:
        r = c.row
        lines.append(
            f"{r.version:7} {r.batch:4d} {r.max_input:5d} {r.max_new:5d} | "
            f"{r.allocated_gb:6.2f} {c.model_allocated_gb:6.2f} {c.allocated_error:+7.1%} | "
            f"{r.max_allocated_gb:6.2f} {c.model_max_gb:6.2f} {c.max_error:+7.1%} | {c.k:6.4f}"
        )
        if c.note:
            lines.append(f"    {c.note}")
    lines.append("")
    lines.append(f"terms per row (GiB): {'W':>6} {'lm_head':>7} {'graph':>6} {'g.log':>6} {'scratch':>7}"
                 f" | {'cache':>6} {'logits':>6} {'next':>6}")
    for c in rows:
        r, t = c.row, c.terms
        vals = (t.weights, t.untied_lm_head, t.graph_cache, t.graph_logits, c.k * t.probs)
        peak = (t.cache, t.prefill_logits, t.next_token_logits)
        lines.append(f"  {r.version:6} {r.batch:3d} {r.max_input:4d} {r.max_new:4d} "
                     + " ".join(f"{v / GiB:{w}.2f}" for v, w in zip(vals, (6, 7, 6, 6, 7)))
                     + " | " + " ".join(f"{v / GiB:6.2f}" for v in peak))
    within = sum(1 for c in rows if not c.note)
    worst = max(max(abs(c.allocated_error), abs(c.max_error)) for c in rows if not c.note) if within else 0.0
    ks = [c.k for c in rows]
    lines.append("")
    lines.append(f"leave-one-out: {within} of {len(rows)} rows within {TOLERANCE:.0%} in both columns "
                 f"(worst {worst:.2%}); k from the other rows {min(ks):.4f}-{max(ks):.4f}")
    units = seed_units()
    gib, gb = (" ".join(f"{e:.1%}" for e in units[k]) for k in ("GiB", "GB"))
    lines.append(f"units: before-after alloc gap vs views' n*u, per pair: GB read as GiB {gib};"
                 f" as 1e9 bytes {gb}")
    return "\n".join(lines)
