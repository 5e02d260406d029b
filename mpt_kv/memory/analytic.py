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

The model is for eager PyTorch; knobs (`held_caches`, `fused_softmax`,
`trim_logits`) describe what the seed's HPU run did differently. The
`seed_comparison()` notes say, row by row, what is left unexplained.
"""

from __future__ import annotations

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
    allocated_gb: float  # "Memory allocated(GB)": InUse after generation
    max_allocated_gb: float  # "Max memory allocated(GB)": MaxInUse


# mpt-7b, bf16, one Gaudi, run_generation.py --use_hpu_graphs --use_kv_cache
# --limit_hpu_graph --trim_logits --attn_softmax_bf16 --warmup 3 --n_iterations 1.
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

# How the seed run differs from eager PyTorch, each from the run itself:
SEED_SETUP = dict(
    # --bf16.
    itemsize=2,
    # optimum-habana's MPT at the PR (Jing1Ling/optimum-habana@dd29d3f, modeling_mpt.py)
    # upcasts unconditionally: softmax(attention_scores.float()); its forward
    # takes no attn_softmax_bf16, so that flag did not reach MPT.
    softmax_itemsize=4,
    # Same file: lm_logits = self.lm_head(hidden_states) over every position;
    # the forward takes no trim_logits, so --trim_logits did not reach MPT.
    trim_logits=False,
    # The prefill (not graphed: --limit_hpu_graph) runs in lazy mode and is
    # compiled as one graph. With eager score copies (bf16 scores + fp32 copy +
    # fp32 softmax) the model exceeds the measured max by 1.3-13.8 GiB on the
    # six rows with L >= 1152, so the compiler cannot have materialised them
    # all at once: the chain is taken as fused.
    fused_softmax=True,
    # "Memory allocated" is read after generate() returned, yet it holds a
    # whole cache (and, for "before", exactly the pinned q thirds, see the
    # before-after pairs): something outside generate() -- the decode-step
    # HPU graph, which keeps the tensors it was captured with -- holds a cache
    # from an earlier call while the next call builds its own.
    held_caches=1,
)


@dataclass(frozen=True)
class SeedComparison:
    row: SeedRow
    model_allocated_gb: float
    allocated_error: float  # (model - measured) / measured
    model_max_gb: float
    max_error: float
    note: str


def _seed_estimate(row: SeedRow) -> Estimate:
    return estimate(
        PRESETS["mpt-7b"], row.batch, row.max_input, row.max_new, fixed=row.version == "after", **SEED_SETUP
    )


def seed_comparison() -> list[SeedComparison]:
    """The model next to each seed row (GB read as GiB: see `seed_units`), with a note.

    Model: "Memory allocated" = allocated_returned (weights + the held cache),
    "Max memory allocated" = max_allocated, both with SEED_SETUP. The notes
    split what the model misses into tensors of recognisable sizes, P = one
    bf16 B*H*L*L tensor (the size of one prefill layer's attn_weights) and a
    constant close to V*D bf16 (0.38 GiB, one embedding-sized matrix). They
    are observations on the table, deliberately not part of the model: nothing
    in the code explains why they stay alive.
    """
    shape, s = PRESETS["mpt-7b"], SEED_SETUP["itemsize"]
    out = []
    for row in SEED_TABLE:
        est = _seed_estimate(row)
        L = row.max_input + row.max_new
        model_alloc, model_max = est.allocated_returned / GiB, est.max_allocated / GiB
        probs = row.batch * shape.n_heads * L * L * s / GiB
        cache = (est.kv_cache + est.retained_views) / GiB
        # The measured peaks line up with the end of prefill: weights, the held
        # cache, this call's cache and the untrimmed logits.
        prefill_end = est.weights / GiB + 2 * cache + logits_bytes(shape, row.batch, L, False, s) / GiB
        ra, rm = row.allocated_gb - model_alloc, row.max_allocated_gb - prefill_end
        note = (f"unmodelled: alloc {ra:+.2f} = P {probs:.2f} {ra - probs:+.2f}; "
                f"max - prefill end {rm:+.2f} = P {probs:.2f} {rm - probs:+.2f} "
                "(P: bf16 B*H*L^2; rest ~ V*D bf16 0.38)")
        if row.version == "before":
            after = next(r for r in SEED_TABLE if r.version == "after" and
                         (r.batch, r.max_input, r.max_new) == (row.batch, row.max_input, row.max_new))
            v = view_retention_bytes(shape, row.batch, L, s) / GiB
            da, dm = row.allocated_gb - after.allocated_gb, row.max_allocated_gb - after.max_allocated_gb
            fits = abs(da - v) < 0.02 and abs(dm - 2 * v) < 0.04
            note += f"; before-after: alloc {da:.2f} max {dm:.2f}, views predict {v:.2f} and 2x = {2 * v:.2f}"
            if not fits:
                note += (" -- does NOT fit: this 'before' row sits ~1 GiB below the pattern the"
                         " other 7 rows follow, in both columns; cause unknown")
        out.append(SeedComparison(
            row=row,
            model_allocated_gb=model_alloc,
            allocated_error=(model_alloc - row.allocated_gb) / row.allocated_gb,
            model_max_gb=model_max,
            max_error=(model_max - row.max_allocated_gb) / row.max_allocated_gb,
            note=note,
        ))
    return out


def seed_units() -> dict[str, list[float]]:
    """Per before/after pair: |relative error| of the measured "Memory allocated"
    gap vs the views' extra (n * u), reading the table's GB as GiB or as 1e9 bytes.
    (optimum-habana's to_gb_rounded divides by 1024**3.)
    """
    shape, s = PRESETS["mpt-7b"], SEED_SETUP["itemsize"]
    errs: dict[str, list[float]] = {"GiB": [], "GB": []}
    for b, a in zip(SEED_TABLE[0::2], SEED_TABLE[1::2]):
        v = view_retention_bytes(shape, b.batch, b.max_input + b.max_new, s)
        gap = b.allocated_gb - a.allocated_gb
        errs["GiB"].append(abs(gap * GiB - v) / v)
        errs["GB"].append(abs(gap * 1e9 - v) / v)
    return errs


def seed_table_text() -> str:
    lines = [
        f"{'version':7} {'B':>4} {'in':>5} {'new':>5} | {'alloc':>6} {'model':>6} {'err':>7} | "
        f"{'max':>6} {'model':>6} {'err':>7}   (GiB)"
    ]
    for c in seed_comparison():
        r = c.row
        lines.append(
            f"{r.version:7} {r.batch:4d} {r.max_input:5d} {r.max_new:5d} | "
            f"{r.allocated_gb:6.2f} {c.model_allocated_gb:6.2f} {c.allocated_error:+7.1%} | "
            f"{r.max_allocated_gb:6.2f} {c.model_max_gb:6.2f} {c.max_error:+7.1%}"
        )
        lines.append(f"    {c.note}")
    shape = PRESETS["mpt-7b"]
    lines.append(
        "P = one bf16 B*H*L^2 tensor (a prefill layer's attn_weights); prefill end = W + 2 caches"
        f" + untrimmed bf16 logits; V*D bf16 = {shape.vocab_size * shape.d_model * 2 / GiB:.2f} GiB"
    )
    units = seed_units()
    gib, gb = (" ".join(f"{e:.1%}" for e in units[k]) for k in ("GiB", "GB"))
    lines.append(f"units: before-after alloc gap vs views' extra, per pair: GB read as GiB {gib};"
                 f" as 1e9 bytes {gb}")
    return "\n".join(lines)
