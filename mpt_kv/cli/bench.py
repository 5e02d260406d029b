"""`python -m mpt_kv bench`: throughput and memory per (batch, max input, max new) config, in the
format of the table of the seed PR, optimum-habana's "refine use cache for mpt model".

    python -m mpt_kv bench --model small --batch-size 4 --max-input-tokens 128 --max-new-tokens 128 \
        --config 1,256,256 --config 16,64,64 --threads 1 --repeat 3

For every config, target and cache path it runs greedy generations with the same random weights
(`config.random_state_dict`) and the same prompts:

1. a warmup generation (untimed: compiles HPU graphs, warms caches);
2. a memory generation under the device's meter (`meter.meter_for`), reading memory allocated
   and the peak after every step (the per-step plot);
3. `--repeat` timed generations, round-robin over targets and paths so that machine drift
   spreads over all of them, the device synchronized inside the timed region. The medians go in
   the table: throughput = generated tokens / wall time (prefill included, as the seed's), and
   decode throughput = B * (N - 1) / time of the N - 1 decode steps.

Memory columns, in the seed's words: "Memory allocated" is read at the end of the generation
(cache still alive), "Max memory allocated" is the peak during it. Both are the model's own
weights (its parameter and buffer storages) plus what the generation added above the memory in
use before it started. So every target reads the same on every device although several models
are loaded at once, and on cpu, where the tracker sees only storages made while it is active,
the weights are still counted. GB = 2**30 bytes, as the seed's table reads (analytic.seed_units).

"analytic min" is `analytic_minimum`: weights + KV cache + the largest one-layer transient
(analytic.py's model of eager PyTorch). Writes bench.json, bench.md and bench_memory.png to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mpt_kv import devices, versions
from mpt_kv.errors import BuildError  # noqa: F401  (raised here; its home is errors.py)
from mpt_kv.outputs import dir_problem, mark_output, path_arg
from mpt_kv.memory import analytic
from mpt_kv.model.config import DTYPES, ModelConfig, random_state_dict
from mpt_kv.errors import TargetUnavailable
from mpt_kv.model.generate import greedy_generate
from mpt_kv.memory.meter import meter_for
from mpt_kv.model.session import Session, TokenIdxSession
from mpt_kv.targets import BUILTIN, PATHS, Runner, build, factory_error

GiB, MiB = 1 << 30, 1 << 20
BASELINE = ("reference", "static")  # the row the ratios are taken against


# --- model presets ---------------------------------------------------------------------------

def model_config(preset: str) -> ModelConfig:
    """A `ModelConfig` with the shape of `analytic.PRESETS[preset]` (random weights, no download)."""
    if preset not in analytic.PRESETS:
        raise ValueError(f"unknown model preset {preset!r}: expected one of {', '.join(analytic.PRESETS)}")
    s = analytic.PRESETS[preset]
    if s.expansion_ratio != 4:
        raise ValueError(f"preset {preset!r} has expansion_ratio={s.expansion_ratio}; ModelConfig builds 4")
    return ModelConfig(d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers,
                       vocab_size=s.vocab_size, max_seq_len=s.max_seq_len)


def shape_of(cfg: ModelConfig) -> analytic.Shape:
    return analytic.Shape(cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size, cfg.max_seq_len)


# --- the analytic minimum ------------------------------------------------------------------

def analytic_minimum(cfg: ModelConfig, batch: int, max_input: int, max_new: int, itemsize: int,
                     prefill: tuple[int, int]) -> int:
    """Bytes: weights + KV cache of L = input + new positions + the largest transient of one
    phase, each from analytic.py's model of eager PyTorch (softmax upcast to fp32, no trimmed
    logits: no target here trims):

      the prefill, Q queries over K keys (see prefill_shape): the causal mask B*Q*K bool + one
      layer's transients (analytic.layer_transients at q = Q, kv = K);
      end of prefill: final hidden B*Q*D + logits B*Q*V;
      a decode step: one layer's transients at q = 1, kv = L + logits B*V.

    With prefill = (L, L) this is analytic.estimate(fixed=True, trim_logits=False)."""
    s, L = shape_of(cfg), max_input + max_new
    q, k = prefill
    prefill_peak = batch * q * k + analytic.layer_transients(s, batch, q, k, itemsize)
    end_of_prefill = batch * q * cfg.d_model * itemsize + analytic.logits_bytes(s, batch, q, False, itemsize)
    decode = analytic.layer_transients(s, batch, 1, L, itemsize) + analytic.logits_bytes(s, batch, 1, True, itemsize)
    return (analytic.weights_bytes(s, itemsize) + analytic.kv_cache_bytes(s, batch, L, itemsize)
            + max(prefill_peak, end_of_prefill, decode))


def prefill_shape(session: Session, max_input: int) -> tuple[int, int]:
    """(queries, keys) of the prefill, I = max input, L = the cache length:
    - the static path of optimum-habana's protocol (TokenIdxSession: the reference and
      optimum-habana) pads the prompt to L and attends over its own L positions: (L, L);
    - its bucketed variant prefills just the prompt: (I, I);
    - any other static cache (transformers' StaticCache) returns its whole buffer: (I, L);
    - concat: (I, I)."""
    if session.path != "static":
        return max_input, max_input
    if isinstance(session, TokenIdxSession):
        return (max_input, max_input) if session.bucket is not None else (session.max_len, session.max_len)
    return max_input, session.max_len


# --- measuring -----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    batch: int
    max_input: int
    max_new: int

    def __str__(self):
        return f"B={self.batch} in={self.max_input} new={self.max_new}"


@dataclass
class MemoryTrace:
    """Bytes, weights included. steps[i] = (allocated after step i, peak during step i);
    step 0 is the prefill."""
    weights: int
    steps: list[tuple[int, int]]
    allocated: int   # end of generation, cache alive
    peak: int        # max over the generation
    returned: int    # after the session was dropped: weights alone unless something leaked
    prefill: tuple[int, int]  # (queries, keys) of the prefill (see prefill_shape)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameter and buffer storages, each storage once (tied lm_head)."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def prompt(cfg: ModelConfig, batch: int, length: int, device, seed: int = 0):
    """(B, I) random token ids and an all-ones mask: every row a full-length prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
    return ids.to(device), torch.ones(batch, length, dtype=torch.long, device=device)


def prepare_for_device(runner: Runner, kind: str) -> Runner:
    """HPU: decode through HPU graphs, as optimum-habana's --use_hpu_graphs (captured on the
    first call of each shape, so warm them up before timing), and drop the reference's in-forward
    input checks, whose host reads a graph cannot contain. Written against the documented API;
    not run here (no Gaudi)."""
    if kind == "hpu":
        from habana_frameworks.torch.hpu import wrap_in_hpu_graph

        if hasattr(runner.model, "validate"):
            runner.model.validate = False
        runner.model = wrap_in_hpu_graph(runner.model)
    return runner


def measure_memory(runner: Runner, kind: str, path: str, ids, mask, max_new: int, on_step=None) -> MemoryTrace:
    """One generation under the device's meter; memory read after every step (peaks reset
    between steps, so each step's own peak is seen)."""
    meter = meter_for(devices.torch_device(kind))
    weights = weights_bytes(runner.model)
    steps: list[tuple[int, int]] = []

    def read(step, token):
        steps.append((weights + meter.allocated() - base, weights + meter.peak() - base))
        meter.reset_peak()
        if on_step:
            on_step(step, token)

    # The cpu meter runs gc.collect() on every read: 0.7 s here once transformers is imported
    # (200k objects). Freezing what exists now (the generation neither makes nor frees any of
    # it) leaves gc only the generation's own objects to scan.
    gc.collect()
    gc.freeze()
    try:
        with torch.inference_mode(), meter:
            base = meter.allocated()
            meter.reset_peak()
            session = runner.session(path, ids.shape[1] + max_new)
            greedy_generate(session, ids, mask, max_new, read)
            allocated = weights + meter.allocated() - base
            prefill = prefill_shape(session, ids.shape[1])
            del session
            returned = weights + meter.allocated() - base
    finally:
        gc.unfreeze()
    return MemoryTrace(weights, steps, allocated, max(p for _, p in steps), returned, prefill)


@dataclass
class Timing:
    total_s: float
    prefill_s: float

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s


def timed_generation(runner: Runner, kind: str, path: str, ids, mask, max_new: int, on_step=None) -> Timing:
    """Wall time of one greedy generation, the device synchronized before each clock read
    (sessions sync after every forward; the last sync covers the last argmax)."""
    marks: dict[int, float] = {}

    def mark(step, token):
        if step == 0:
            devices.sync(kind)
            marks[0] = time.perf_counter()
        if on_step:
            on_step(step, token)

    devices.sync(kind)
    t0 = time.perf_counter()
    greedy_generate(runner.session(path, ids.shape[1] + max_new), ids, mask, max_new, mark)
    devices.sync(kind)
    t1 = time.perf_counter()
    return Timing(t1 - t0, marks[0] - t0)


# --- one run: every config x target x path -------------------------------------------------

@dataclass
class Row:
    target: str
    path: str
    batch: int
    max_input: int
    max_new: int
    throughput: float                # tokens/s: B * N / median wall time of a generation
    decode_throughput: float | None  # tokens/s of the N - 1 decode steps (None when N = 1)
    allocated: int                   # bytes at the end of generation (weights + cache)
    max_allocated: int               # peak bytes during generation
    kv_cache: int                    # analytic bytes of the cache of L = input + new positions
    analytic_min: int | None         # static path only: see analytic_minimum
    returned: int
    total_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    memory_steps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def key(self):
        return (self.target, self.path)

    @property
    def peak_over_min(self) -> float | None:
        return self.max_allocated / self.analytic_min if self.analytic_min else None


@dataclass
class Report:
    meta: dict
    rows: list[Row]
    skipped: list[dict]

    def ratios(self) -> list[dict]:
        """Per config: the baseline row's decode throughput over every other row's, and its
        peak over the analytic minimum."""
        out = []
        for cfg in dict.fromkeys((r.batch, r.max_input, r.max_new) for r in self.rows):
            rows = [r for r in self.rows if (r.batch, r.max_input, r.max_new) == cfg]
            base = next((r for r in rows if r.key == BASELINE), None)
            if base is None:
                continue
            entry = {"batch": cfg[0], "max_input": cfg[1], "max_new": cfg[2], "peak_over_min": base.peak_over_min,
                     "decode_ratio": {}, "decode_ratio_per_round": {}, "throughput_ratio": {}}
            for r in rows:
                if r is base:
                    continue
                name = f"{r.target}/{r.path}"
                entry["throughput_ratio"][name] = base.throughput / r.throughput
                if base.decode_throughput and r.decode_throughput:
                    entry["decode_ratio"][name] = base.decode_throughput / r.decode_throughput
                    # paired by round: both ran back to back, so a slow spell of the machine hits both
                    entry["decode_ratio_per_round"][name] = [
                        (t - p) / (bt - bp) for t, p, bt, bp in zip(r.total_s, r.prefill_s, base.total_s, base.prefill_s)]
            out.append(entry)
        return out


def load(cfg: ModelConfig, targets: list[str], paths: list[str], kind: str, dtype: torch.dtype, seed: int,
         log=print, skip: tuple[str, ...] = ()) -> tuple[dict[str, Runner], list[tuple[str, str]], list[dict]]:
    """Build every target with the same weights -> (runners, (target, path) pairs to run, skipped
    with the reason: targets that cannot be built here, paths a target does not have, the pairs
    `skip` names as "target/path").

    On cuda the weights are drawn on the GPU and every model is built under `torch.device`, so its
    parameters are made (and initialized) there: at MPT-7B's 6.7 billion parameters the CPU would
    take minutes per target (measured here: 0.5 s per 10**8 numbers drawn on one core)."""
    device = devices.torch_device(kind)
    on_device = kind == "cuda"
    state_dict = random_state_dict(cfg, seed=seed, device=device if on_device else None)
    runners, pairs, skipped = {}, [], []
    for spec in targets:
        try:
            with torch.device(device) if on_device else contextlib.nullcontext():
                runners[spec] = prepare_for_device(build(spec, cfg, state_dict, device, dtype), kind)
        except TargetUnavailable as e:
            skipped.append({"target": spec, "path": "*", "reason": str(e)})
            log(f"skipped {spec}: {e}")
            continue
        except Exception as e:  # noqa: BLE001  a factory that raises, or returns no Runner: its error, not a traceback
            e = factory_error(e)  # the factory's own error, as before
            raise BuildError(f"target {spec} does not build on {kind}: {type(e).__name__}: {e}") from e
        for path in paths:
            if path in runners[spec].unsupported:
                skipped.append({"target": spec, "path": path, "reason": runners[spec].unsupported[path]})
                log(f"skipped {spec}/{path}: {runners[spec].unsupported[path]}")
            elif f"{spec}/{path}" in skip:
                skipped.append({"target": spec, "path": path, "reason": "left out with --skip"})
            else:
                pairs.append((spec, path))
    return runners, pairs, skipped




def run(cfg: ModelConfig, configs: list[BenchConfig], runners: dict[str, Runner], pairs: list[tuple[str, str]],
        kind: str, dtype: torch.dtype, repeat: int, warmup: int, seed: int, progress) -> list[Row]:
    device = devices.torch_device(kind)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for n, bc in enumerate(configs, start=1):
        # one line per config, with or without a terminal (the bar is only drawn on one)
        progress.write(f"bench: config {n}/{len(configs)} {bc}: {len(pairs)} target/path pairs x "
                       f"({warmup} warmup + 1 memory + {repeat} timed) generations")
        ids, mask = prompt(cfg, bc.batch, bc.max_input, device, seed)
        step = lambda *_: progress.update(1)  # noqa: E731
        traces, timings = {}, {p: [] for p in pairs}
        for spec, path in pairs:
            progress.set_description(f"{bc} {spec}/{path} warmup+memory")
            for _ in range(warmup):
                timed_generation(runners[spec], kind, path, ids, mask, bc.max_new, step)
            traces[spec, path] = measure_memory(runners[spec], kind, path, ids, mask, bc.max_new, step)
        for r in range(repeat):
            for spec, path in pairs:
                progress.set_description(f"{bc} {spec}/{path} timing {r + 1}/{repeat}")
                timings[spec, path].append(timed_generation(runners[spec], kind, path, ids, mask, bc.max_new, step))
        for spec, path in pairs:
            t, m = timings[spec, path], traces[spec, path]
            total = statistics.median(x.total_s for x in t)
            decode = statistics.median(x.decode_s for x in t)
            rows.append(Row(
                target=spec, path=path, batch=bc.batch, max_input=bc.max_input, max_new=bc.max_new,
                throughput=bc.batch * bc.max_new / total,
                decode_throughput=bc.batch * (bc.max_new - 1) / decode if bc.max_new > 1 else None,
                allocated=m.allocated, max_allocated=m.peak,
                kv_cache=analytic.kv_cache_bytes(shape_of(cfg), bc.batch, bc.max_input + bc.max_new, itemsize),
                analytic_min=analytic_minimum(cfg, bc.batch, bc.max_input, bc.max_new, itemsize,
                                              m.prefill) if path == "static" else None,
                returned=m.returned, total_s=[x.total_s for x in t], prefill_s=[x.prefill_s for x in t],
                memory_steps=m.steps))
    return rows


# --- output --------------------------------------------------------------------------------

COLUMNS = ["target/path", "batch size", "max input tokens", "max new tokens", "throughput (tokens/s)",
           "memory allocated ({u})", "max memory allocated ({u})", "decode (tokens/s)", "analytic min ({u})",
           "max / min"]


def table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Header and cells; the unit is GB (2**30) when any value reaches 1 GB, else MB (2**20)."""
    big = any(r.max_allocated >= GiB for r in report.rows)
    unit, div = ("GB", GiB) if big else ("MB", MiB)
    fmt = (lambda b: f"{b / div:.2f}") if big else (lambda b: f"{b / div:.1f}")
    head = [c.format(u=unit) for c in COLUMNS]
    cells = []
    for r in report.rows:
        cells.append([f"{r.target}/{r.path}", str(r.batch), str(r.max_input), str(r.max_new), f"{r.throughput:.0f}",
                      fmt(r.allocated), fmt(r.max_allocated),
                      "-" if r.decode_throughput is None else f"{r.decode_throughput:.0f}",
                      "-" if r.analytic_min is None else fmt(r.analytic_min),
                      "-" if r.peak_over_min is None else f"{r.peak_over_min:.3f}"])
    return head, cells


def text_table(report: Report) -> str:
    head, cells = table(report)
    widths = [max(len(x) for x in col) for col in zip(head, *cells)]
    line = lambda xs: "  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(xs, widths)))  # noqa: E731
    return "\n".join([line(head), *(line(c) for c in cells)])


def ratio_lines(report: Report) -> list[str]:
    out = []
    for e in report.ratios():
        vs = ", ".join(f"{k} {v:.2f}x (rounds {min(e['decode_ratio_per_round'][k]):.2f}-"
                       f"{max(e['decode_ratio_per_round'][k]):.2f})" for k, v in e["decode_ratio"].items()) or "no other rows"
        pm = "-" if e["peak_over_min"] is None else f"{e['peak_over_min']:.3f}"
        out.append(f"B={e['batch']} in={e['max_input']} new={e['max_new']}: {'/'.join(BASELINE)} decode "
                   f"throughput over {vs}; its peak / analytic min {pm}")
    return out


def markdown(report: Report) -> str:
    head, cells = table(report)
    m = report.meta
    lines = [f"# mpt-kv bench: {m['model']} ({m['dtype']}) on {m['device']}", "",
             f"`{m['command']}`", "",
             f"torch {m['torch']}, transformers {m['transformers']}, torch threads {m['threads']}, "
             f"median of {m['repeat']} timed generations; memory in {head[5][-3:-1]} (2**{30 if 'GB' in head[5] else 20} bytes).",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    lines += ["", "Ratios (> 1: the baseline is faster):", ""] + [f"- {x}" for x in ratio_lines(report)]
    lines += [f"- skipped {s['target']}/{s['path']}: {s['reason']}" for s in report.skipped]
    return "\n".join(lines) + "\n"


def plot(report: Report, path: Path) -> None:
    """Memory per decode step, one panel per config, one line per target/path. Each step is
    drawn as its peak then what it left allocated, so the concat path's cat (old and new cache
    alive at once) shows as a growing sawtooth and the static path as a flat line. The prefill
    (step 0) is left out: its padded peak would flatten the scale (its peak is in the table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r.batch, r.max_input, r.max_new) for r in report.rows))
    cols = min(2, len(configs))
    rows = -(-len(configs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.5 * rows), squeeze=False)
    colors = {t: f"C{i}" for i, t in enumerate(dict.fromkeys(r.target for r in report.rows))}
    for ax in axes.flat[len(configs):]:
        ax.set_visible(False)
    for ax, bc in zip(axes.flat, configs):
        for r in (r for r in report.rows if (r.batch, r.max_input, r.max_new) == bc):
            xs, ys = [], []
            for i, (alloc, peak) in enumerate(r.memory_steps[1:], start=1):
                xs += [i - 0.5, i]
                ys += [peak / MiB, alloc / MiB]
            if xs:
                ax.plot(xs, ys, label=f"{r.target}/{r.path}", color=colors[r.target],
                        linestyle="-" if r.path == "concat" else "--", linewidth=0.8)
        ax.set_title(f"B={bc[0]} in={bc[1]} new={bc[2]}")
        ax.set_xlabel("decode step (peak within the step, then allocated after it)")
        ax.set_ylabel("MB (2**20 bytes), weights included")
        ax.legend(fontsize=7)
    fig.suptitle(f"{report.meta['model']} {report.meta['dtype']} on {report.meta['device']}: memory per decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: Report, out: Path, plot_memory: bool = True) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench_memory.png"}
    rows = []
    for r in report.rows:
        d = asdict(r)
        d["peak_over_min"] = r.peak_over_min
        rows.append(d)
    files["json"].write_text(json.dumps({"meta": report.meta, "rows": rows, "ratios": report.ratios(),
                                         "skipped": report.skipped}, indent=1))
    files["md"].write_text(markdown(report))
    if not plot_memory:
        del files["png"]
        return files
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # an optional extra: the table is still worth having
        print("no plot: matplotlib is not installed (pip install 'mpt-kv[bench]')", file=sys.stderr)
        del files["png"]
        return files
    plot(report, files["png"])
    return files


# --- CLI -----------------------------------------------------------------------------------

class _NoProgress:
    """No bar: without a terminal (a CI log) the per-config lines still go to stderr."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def update(self, n=1): pass
    def set_description(self, s): pass
    def close(self): pass

    def write(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


def progress_bar(total: int, quiet: bool):
    """tqdm on stderr on a terminal; elsewhere (or without tqdm) a line per config; --quiet: nothing."""
    if quiet or not sys.stderr.isatty():
        return _NoProgress(quiet)
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    bar = tqdm(total=total, unit="step", file=sys.stderr, leave=False)
    bar.write = lambda line: tqdm.write(line, file=sys.stderr)  # above the bar, not through it
    return bar


def parse_config(text: str) -> BenchConfig:
    try:
        b, i, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--config {text!r}: expected BATCH,MAX_INPUT,MAX_NEW, e.g. 4,128,128")
    return BenchConfig(b, i, n)


def first_paragraph(doc: str) -> str:
    """A module doc's first paragraph as one line: --help's description, never cut mid-sentence."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpt_kv bench", description=first_paragraph(__doc__))
    p.add_argument("--batch-size", type=int, default=None, help="with --max-input-tokens and --max-new-tokens: one config")
    p.add_argument("--max-input-tokens", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--config", type=parse_config, action="append", default=[], metavar="B,I,N",
                   help="one more (batch, max input, max new) config (repeatable)")
    p.add_argument("--target", action="append", default=None, metavar="SPEC",
                   help=f"built-in ({', '.join(BUILTIN)}) or package.module:factory (repeatable; default: the built-ins, "
                        "unavailable ones skipped with the reason)")
    p.add_argument("--path", action="append", choices=PATHS, default=None, help="cache path (repeatable; default both)")
    p.add_argument("--skip", action="append", default=[], metavar="TARGET/PATH",
                   help="leave out one target's path (repeatable), e.g. a variant whose static path is the reference's")
    p.add_argument("--device", default="cpu", choices=devices.KINDS)
    p.add_argument("--model", default="tiny", choices=list(analytic.PRESETS), help="model shape (random weights)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on cpu, bf16 elsewhere")
    p.add_argument("--repeat", type=int, default=3, help="timed generations per row; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed generations per row first")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1 steadies cpu timings)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--out", type=path_arg, default=Path("reports/bench"), help="folder for bench.json, bench.md, bench_memory.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def config_problem(c: BenchConfig, cfg: ModelConfig, model: str) -> str | None:
    """Why a (batch, max input, max new) config cannot run on model preset `model` (None if it can): each
    value >= 1, the lengths within the preset's max_seq_len. Also `devicecheck --config`'s rule."""
    for name, value, low in (("--batch-size", c.batch, 1), ("--max-input-tokens", c.max_input, 1),
                             ("--max-new-tokens", c.max_new, 1)):
        if value < low:
            return f"{name} {value} (config {c}): must be >= {low}"
    if c.max_input + c.max_new > cfg.max_seq_len:
        return (f"max input {c.max_input} + max new {c.max_new} = {c.max_input + c.max_new} (config {c}) exceeds "
                f"max_seq_len {cfg.max_seq_len} of model preset {model!r} (ALiBi is built only that far)")
    return None


def check_args(p: argparse.ArgumentParser, a) -> tuple[ModelConfig, list[BenchConfig]]:
    """Every bad value is a usage error naming the value and its limit."""
    cfg = model_config(a.model)
    single = (a.batch_size, a.max_input_tokens, a.max_new_tokens)
    configs = list(a.config)
    if any(x is not None for x in single) or not configs:
        defaults = (1, 16, 16)
        configs.insert(0, BenchConfig(*(d if x is None else x for x, d in zip(single, defaults))))
    for c in configs:
        problem = config_problem(c, cfg, a.model)
        if problem:
            p.error(problem)
    for name, value, low in (("--repeat", a.repeat, 1), ("--warmup", a.warmup, 0)):
        if value < low:
            p.error(f"{name} {value}: must be >= {low}")
    if a.threads is not None and a.threads < 1:
        p.error(f"--threads {a.threads}: must be >= 1")
    reason = devices.unavailable_reason(a.device)
    if reason:
        p.error(f"--device {a.device} is not available here: {reason}")
    for spec in a.target or []:
        if spec not in BUILTIN and ":" not in spec:
            p.error(f"--target {spec!r}: neither built in ({', '.join(BUILTIN)}) nor package.module:factory")
    problem = dir_problem(a.out, "bench")
    if problem:
        p.error(f"--out {a.out}: {problem}")
    return cfg, list(dict.fromkeys(configs))


# Eager code keeps more alive than the analytic minimum: measured peaks reach 1.29x of it
# (transformers' static path, README "Benchmarks"), so a config is refused unless this much fits.
FIT_MARGIN = 1.3


def memory_needed(cfg: ModelConfig, bc: BenchConfig, n_targets: int, paths: list[str], itemsize: int) -> int:
    """Bytes a config needs at its peak, from the analytic model: every target's weights stay
    loaded (they are built together) + the largest generation, i.e. `analytic_minimum` with the
    padded static prefill (L x L scores) + a second KV cache where the concat path's torch.cat
    holds the old and the new cache at once."""
    L = bc.max_input + bc.max_new
    one = analytic_minimum(cfg, bc.batch, bc.max_input, bc.max_new, itemsize, (L, L))
    extra_cache = analytic.kv_cache_bytes(shape_of(cfg), bc.batch, L, itemsize) if "concat" in paths else 0
    return (n_targets - 1) * analytic.weights_bytes(shape_of(cfg), itemsize) + one + extra_cache


def check_fits(p: argparse.ArgumentParser, cfg: ModelConfig, configs: list[BenchConfig], n_targets: int,
               paths: list[str], kind: str, dtype: torch.dtype, model: str) -> None:
    """Refuse, before anything is allocated, a config whose estimate does not fit in what the
    device has free (the OOM killer is a worse error message)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    free, source = devices.available_memory(kind)
    for bc in configs:
        need = memory_needed(cfg, bc, n_targets, paths, itemsize)
        if need * FIT_MARGIN > free:
            p.error(f"config {bc} of model {model!r} ({str(dtype).replace('torch.', '')}, {n_targets} targets loaded "
                    f"together) needs about {need * FIT_MARGIN / GiB:.1f} GiB on {kind} (analytic estimate "
                    f"{need / GiB:.2f} GiB x {FIT_MARGIN} margin), but only {free / GiB:.1f} GiB is free ({source}); "
                    "use a smaller model, batch or length, fewer --target, or bf16")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(argv)
    cfg, configs = check_args(p, a)
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype_name = a.dtype or ("fp32" if a.device == "cpu" else "bf16")
    targets = a.target or list(BUILTIN)
    paths = a.path or list(PATHS)
    dtype = DTYPES[dtype_name]
    check_fits(p, cfg, configs, len([t for t in targets if not versions.missing(t)]), paths, a.device, dtype, a.model)

    for pair in a.skip:
        spec, _, path = pair.rpartition("/")
        if spec not in targets or path not in PATHS:
            p.error(f"--skip {pair!r}: expected TARGET/PATH with TARGET one of the run's targets ({', '.join(targets)}) "
                    f"and PATH one of {', '.join(PATHS)}")

    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    try:
        runners, pairs, skipped = load(cfg, targets, paths, a.device, dtype, a.seed, log, tuple(a.skip))
    except BuildError as e:  # as `run` reports it: the target and its error, no traceback
        p.error(str(e))
    missing = [s for s in skipped if s["path"] == "*" and s["target"] in set(a.target or [])]
    if missing:  # asked for by name: an error, not a silent skip
        p.error("; ".join(f"--target {s['target']} cannot run here: {s['reason']}" for s in missing))
    if not pairs:
        p.error("no (target, path) pair can run here: " + "; ".join(f"{s['target']}/{s['path']}: {s['reason']}" for s in skipped))
    report = Report(meta={}, rows=[], skipped=skipped)
    report.meta = {"command": "python -m mpt_kv bench " + " ".join(argv), "model": a.model, "model_config": asdict(cfg),
                   "device": a.device, "dtype": dtype_name, "threads": torch.get_num_threads(), "repeat": a.repeat,
                   "warmup": a.warmup, "seed": a.seed, "torch": torch.__version__,
                   "transformers": versions.transformers_version(),
                   "optimum-habana": versions.installed("optimum-habana"), "python": platform.python_version(),
                   "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "complete": False}
    progress = progress_bar(sum(c.max_new for c in configs) * len(pairs) * (a.warmup + 1 + a.repeat), a.quiet)
    try:
        for bc in configs:  # written after each config: a run stopped by a time limit keeps the configs it finished
            report.rows += run(cfg, [bc], runners, pairs, a.device, dtype, a.repeat, a.warmup, a.seed, progress)
            if bc != configs[-1]:
                write(report, Path(a.out), plot_memory=False)
                mark_output(a.out, "bench")  # its own output already: a rerun after a time limit may replace it
    finally:
        progress.close()
    report.meta["complete"] = True
    print(f"{a.model} ({dtype_name}) on {a.device}, torch threads {torch.get_num_threads()}, median of {a.repeat}:")
    print(text_table(report))
    for line in ratio_lines(report):
        print(line)
    for s in report.skipped:
        print(f"skipped {s['target']}/{s['path']}: {s['reason']}")
    files = write(report, Path(a.out))
    mark_output(a.out, "bench")
    print("wrote " + ", ".join(str(f) for f in files.values()))
    return 0
