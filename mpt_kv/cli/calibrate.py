"""Calibrate the tolerances (compare.py): run P0, P1 and P2 over thousands of drawn cases on a
target and record every comparison's error as a fraction of its bound.

    python -m mpt_kv calibrate run --target reference --cases 5000 [--shard 0/4] [--out calibration]
    python -m mpt_kv calibrate run --target reference --device cuda --tf32 off --sdpa-backend default ...
    python -m mpt_kv calibrate report calibration/*.jsonl
    python -m mpt_kv calibrate quantized --cases 400     the quantized caches' bounds
    python -m mpt_kv calibrate compiled --cases 200      the compiled decode step's bound (graph-capture)
    python -m mpt_kv calibrate families --seeds 3        the family checks' comparisons over the zoo
                                                         (mpt_kv/cli/calibrate_families.py)

`run` appends one JSON line per case to OUT/<target>-<transformers version>-<k>of<n>.jsonl and
skips the cases already there (resumable; shards split the case indices k, k + n, ...). Run it
per target in the environment that has it (optimum-habana: the .venv-oh / tox ohabana env) and
merge with `report`, which prints, per (dtype, compared quantity), the worst error as a fraction
of the current bound and the number of cases over it, per target, and the rtol that would put the
worst at half its bound.

Cases: first the fixed edge cases (strategies.EDGE_CASES), then case i drawn by
`strategies.RandomPicks(i)`: 64% from the default CPU space, 32% from the thorough space (head
dim to 128, d_model to 1024, prompts to 300), 4% long sequences to max_seq_len 2048
(`long_case_from`). Each case runs in fp32 and bf16: P0 on its three layouts, P1 on every cache
path the target supports and P2 on the static path, on the case's first layout (the tests'
second and third layouts are more layouts of the same space; running them here would triple the
time); bf16 against the fp32 twin, as the tests do.

What is stored per case and (dtype, quantity): the comparisons' (max |error|, max |expected|)
pairs that no other pair dominates (a larger error at a smaller scale). Any bound of the form
atol + rtol x scale is worst at one of them, so tolerances can be re-derived without rerunning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from mpt_kv.catalogue import designs, variants
from mpt_kv.cli import calibrate_families
from mpt_kv.checks import properties as P
from mpt_kv import devices
from mpt_kv import versions as installed_versions
from mpt_kv.checks import running
from mpt_kv.checks.compare import TOLERANCES, PropertyFailure, measuring
from mpt_kv.checks.quantized import QUANTIZED
from mpt_kv.checks.strategies import BF16_MIN_D_MODEL, EDGE_CASES, RandomPicks, case_from, long_case_from
from mpt_kv.errors import Unsupported
from mpt_kv.model.config import random_state_dict
from mpt_kv.findings import entries as known_failures
from mpt_kv.targets import resolve_target
from mpt_kv.plugin.parametrize import named_target_problem
from mpt_kv.outputs import dir_problem, mark_output, path_arg

PATHS = (("concat", None), ("static", None), ("static", 4))
DTYPES = (torch.float32, torch.bfloat16)


def case_at(i: int):
    """(family, Case) of index i: the edge cases first, then drawn ones."""
    edges = list(EDGE_CASES.items())
    if i < len(edges):
        return f"edge:{edges[i][0]}", edges[i][1]
    pick, slot = RandomPicks(i), i % 50
    if slot < 32:
        return "default", case_from(pick)
    if slot < 48:
        return "thorough", case_from(pick, thorough=True)
    return "long", long_case_from(pick)


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (err, scale) pairs not dominated by a pair with a larger error at a smaller scale."""
    out = []
    for err, scale in sorted(points, key=lambda p: (p[1], -p[0])):
        if not out or err > max(e for e, _ in out):
            out.append((err, scale))
    return out


def run_case(target: str, case, entries, device: str = "cpu") -> dict:
    """P0 (its three layouts), P1 on every path and P2 on the static path, the case's first
    generation, fp32 and bf16: every comparison the tests make, on this layout, on `device`."""
    points, errors = defaultdict(list), []
    resolved, cpu = resolve_target(target), devices.torch_device(device)
    for dtype in DTYPES:
        runner = resolved.build(case.cfg, random_state_dict(case.cfg, seed=case.seed), cpu, dtype)
        caps = resolved.capabilities(cpu, dtype)
        # the run layer's oracles: P0's reference, and in bf16 the fp32 twin (the fp32-twin rule)
        oracles = {**running.oracles(resolved, caps, case.cfg, case.seed, cpu, dtype, "reference"),
                   **running.oracles(resolved, caps, case.cfg, case.seed, cpu, dtype, "twin")}
        twin = oracles.get("fp32")
        live, oracle = P.copied(runner), P.copied(twin)
        runs = [("P0", None, None, lambda c: P.check_oracle(runner, c))]
        runs += [("P1", path, bucket, lambda c: P.p1_generation(live, oracle, c)) for path, bucket in PATHS]
        runs += [("P2", "static", None, lambda c: P.p2_generation(live, oracle, c))]
        for prop, path, bucket, check in runs:
            c = P.Context(target, device, dtype, case, path, bucket, generation=1, **oracles)
            try:
                runner.require(path, "bucket" if bucket else None)
            except Unsupported:
                continue
            with measuring() as measured:
                try:
                    check(c)
                except (PropertyFailure, ValueError, RuntimeError) as e:
                    known = known_failures.match(target, prop, path, entries, bucket)
                    errors.append(dict(prop=prop, path=path, bucket=bucket, dtype=str(dtype)[6:], known=known,
                                       message=f"{type(e).__name__}: {str(e)[:600]}"))
            for m in measured:
                points[" ".join(m["key"])].append((m["err"], m["scale"]))
    return dict(points={k: frontier(v) for k, v in points.items()}, errors=errors)


def d_model(described: str) -> int:
    """d_model from a `Case.describe()` line ('... H=3 hd=8 ...')."""
    heads, head_dim = (int(x) for x in re.search(r"H=(\d+) hd=(\d+)", described).groups())
    return heads * head_dim


def versions(conditions: dict | None = None) -> dict:
    """What a result file was measured with: torch, transformers (optimum-habana), and on cuda the
    device's conditions (`conditions`: device, GPU, TF32, sdpa backend), which `report` keeps apart."""
    out = {"torch": torch.__version__, "transformers": installed_versions.transformers_version()}
    if installed_versions.installed("optimum-habana"):
        out["optimum-habana"] = installed_versions.installed("optimum-habana")
    return {**out, **(conditions or {})}


# sdpa backends `calibrate run --sdpa-backend` can pin (torch.nn.attention.SDPBackend); "default": torch chooses
SDPA_BACKENDS = ("default", "math", "flash", "efficient", "cudnn")


def conditions(args) -> dict:
    """The device and, on cuda, TF32 and the sdpa backend of a run: {} on cpu (the files of before)."""
    if args.device == "cpu":
        return {}
    return {"device": args.device, "gpu": torch.cuda.get_device_name(0), "tf32": args.tf32, "sdpa": args.sdpa_backend}


@contextlib.contextmanager
def under(args):
    """The run's TF32 and sdpa backend (cuda), set for its cases and put back after."""
    if args.device == "cpu":
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    try:
        if args.sdpa_backend == "default":
            yield
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backend = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
                       "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
            with sdpa_kernel(backend[args.sdpa_backend]):
                yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def label(target: str, vers: dict) -> str:
    """A result file's target as `report` lists it: with its cuda conditions where it has them."""
    if "device" not in vers:
        return target
    return f"{target} on {vers['device']} (TF32 {vers['tf32']}, sdpa {vers['sdpa']})"


def run(args) -> int:
    problem = dir_problem(args.out, "calibrate run")  # before any case: never into a folder of other files
    if problem:
        print(f"python -m mpt_kv calibrate run: error: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    k, n = args.shard
    torch.set_num_threads(1)
    vers = versions(conditions(args))
    where = "" if args.device == "cpu" else f"-{args.device}-tf32{args.tf32}-sdpa{args.sdpa_backend}"
    out = Path(args.out) / f"{file_safe(args.target)}-tf{vers['transformers']}{where}-{k}of{n}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    mark_output(out.parent, "calibrate run")  # a resumed run appends here
    done = set()
    if out.exists():
        done = {json.loads(line)["index"] for line in out.read_text().splitlines() if line.strip()}
    entries = known_failures.load()
    todo = [i for i in range(k, args.cases, n) if i not in done]
    print(f"{out}: {len(done)} cases done, {len(todo)} to go", flush=True)
    with out.open("a") as f, progress(len(todo)) as bar, under(args):
        for i in todo:
            family, case = case_at(i)
            t0 = time.process_time()
            result = run_case(args.target, case, entries, args.device)
            line = dict(index=i, family=family, case=case.describe(), target=args.target, versions=vers,
                        cpu_seconds=round(time.process_time() - t0, 3), **result)
            f.write(json.dumps(line) + "\n")
            f.flush()
            bar.update(1)
            if args.verbose:
                bar.write(f"{i} {family} {line['cpu_seconds']:.2f}s {case.describe()}")
    return 0


def file_safe(target: str) -> str:
    """A target spec as a file name CI artifact uploaders take (`pkg.mod:build` -> `pkg.mod_build`)."""
    return re.sub(r"[^\w.-]", "_", target)


def progress(total: int):
    """A tqdm bar on stderr (an hour-long run says how far it is and when it ends); without tqdm, a
    line every 50 cases."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total)
    return tqdm(total=total, unit="case", file=sys.stderr, mininterval=5)


class _Lines:
    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.done += n
        if self.done % 50 == 0 or self.done == self.total:
            print(f"{self.done}/{self.total} cases, {time.monotonic() - self.t0:.0f} s", file=sys.stderr, flush=True)

    def write(self, line):
        print(line, flush=True)


def read_results(paths: list[Path]) -> dict:
    """Every case line of the result files `run` wrote, by (target, transformers, index); a file that is
    missing, a folder, not JSON lines of cases or that holds none is a usage error naming it (exit 2)."""
    rows = {}
    for path in paths:
        try:
            lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            cases = [json.loads(line) for line in lines]
            for r in cases:
                rows[(label(r["target"], r["versions"]), r["versions"]["transformers"], r["index"])] = r
        except (OSError, ValueError, KeyError, TypeError) as e:  # missing, a folder, not JSON, not a case line
            what = f"no {e} in a line" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            usage_error(f"{path} is not a result file of `calibrate run` (JSON lines of cases): {what}")
        if not cases:
            usage_error(f"{path} holds no case: nothing to report (a result file of `calibrate run` has a line per case)")
    return rows


def usage_error(message: str):
    print(f"python -m mpt_kv calibrate: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def report(args) -> int:
    """Merge result files; print the worst fraction of the bound per (dtype, quantity) and target."""
    rows = read_results(args.files)
    targets = sorted({(t, v) for t, v, _ in rows})
    cases = {t: [r for (tt, v, _), r in rows.items() if (tt, v) == t] for t in targets}
    print("| target | transformers | cases | CPU time | unexpected errors | known failures |")
    print("|---|---|---|---|---|---|")
    for t in targets:
        rs = cases[t]
        unexpected = sum(1 for r in rs for e in r["errors"] if not e["known"])
        known = sum(1 for r in rs for e in r["errors"] if e["known"])
        print(f"| {t[0]} | {t[1]} | {len(rs)} | {sum(r['cpu_seconds'] for r in rs) / 3600:.2f} h | {unexpected} | {known} |")
    print()
    print("| dtype | quantity | atol | rtol | worst err / bound | cases over the bound | worst err / scale "
          "| rtol for worst = 0.5 bound | worst case |")
    print("|---|---|---|---|---|---|---|---|---|")
    keys = sorted({k for r in rows.values() for k in r["points"]})
    narrow = 0
    for key in keys:
        dtype, quantity = key.split(" ")
        tol = TOLERANCES[(dtype, quantity)]
        worst, over, worst_rel, need, where = 0.0, 0, 0.0, 0.0, ""
        for (target, _, _), r in rows.items():
            if dtype == "bfloat16" and d_model(r["case"]) < BF16_MIN_D_MODEL:
                narrow += 1
                continue  # outside the bf16 test space (strategies.BF16_MIN_D_MODEL): shown below
            pts = r["points"].get(key, [])
            if not pts:
                continue
            fracs = [e / (tol.atol + tol.rtol * s) for e, s in pts]
            over += max(fracs) > 1
            if max(fracs) > worst:
                worst, where = max(fracs), f"{target} #{r['index']} {r['case']}"
            worst_rel = max(worst_rel, *(e / max(s, 1e-30) for e, s in pts))
            need = max(need, *((2 * e - tol.atol) / max(s, 1e-30) for e, s in pts))
        print(f"| {dtype} | {quantity} | {tol.atol:g} | {tol.rtol:g} | {worst:.3f} | {over} | {worst_rel:.2e} "
              f"| {max(need, 0):.3g} | {where} |")
    if narrow:
        rel = max((e / max(s, 1e-30) for r in rows.values() if d_model(r["case"]) < BF16_MIN_D_MODEL
                   for k, pts in r["points"].items() if k.startswith("bfloat16 logits") for e, s in pts), default=0)
        print(f"\nbf16 rows leave out the cases with d_model < {BF16_MIN_D_MODEL}, which the bf16 tests do not draw: "
              f"{narrow // max(1, sum(k.startswith('bfloat16') for k in keys))} case runs, worst bf16 logits error "
              f"{rel:.3f} x scale")
    unexpected = [(t, r["index"], e) for (t, _, _), r in rows.items() for e in r["errors"] if not e["known"]]
    for t, i, e in unexpected[:args.show]:
        print(f"\nunexpected: {t} #{i} {e['prop']} {e['dtype']} path={e['path']} bucket={e['bucket']}: {e['message']}")
    return 1 if unexpected else 0


# --- the quantized caches' bounds (checks/quantized.py): `calibrate quantized` --------------------------

def quantizers():
    """name -> (target factory, storage dtype, correct?): the correct per-token quantizer in int8
    and fp8, and the two wrong ones the bound must kill."""
    return {"int8 correct": (designs.quantized_kv_int8, "int8", True),
            "fp8 correct": (designs.quantized_kv_fp8, "float8_e4m3fn", True),
            "int8 wrong scale": (variants.quantized_kv_wrong_scale, "int8", False),
            "int8 wrong row": (variants.quantized_kv_wrong_row, "int8", False)}


def measure_quantized(factory, case) -> dict[str, float]:
    """Worst err / max|expected| per quantity kind ("logits", "kv") of P1 (concat and static paths)
    and P2 on one case, fp32, every comparison recorded (compare.measuring) instead of judged;
    "token": 1.0 where a greedy token differed beyond a near-tie (P1 raises that even while
    measuring, under the calibrated bound), else 0.0."""
    runner = P.copied(factory(case.cfg, random_state_dict(case.cfg, seed=case.seed), torch.device("cpu"),
                              torch.float32))
    worst = {"logits": 0.0, "kv": 0.0, "token": 0.0}
    runs = [("concat", lambda c: P.p1_generation(runner, None, c)), ("static", lambda c: P.p1_generation(runner, None, c)),
            ("static", lambda c: P.p2_generation(runner, None, c))]
    for path, check in runs:
        c = P.Context("calibration", "cpu", torch.float32, case, path)
        with measuring() as measured:
            try:
                check(c)
            except PropertyFailure:  # a greedy token beyond a near-tie: the steps before it were recorded
                worst["token"] = 1.0
        for m in measured:
            if "uncached" in m["key"][1]:
                continue
            kind = "kv" if m["key"][1].startswith("kv") else "logits"
            worst[kind] = max(worst[kind], m["err"] / max(m["scale"], 1e-30))
    return worst


def calibrate_quantized(cases: int) -> dict[str, dict[str, float]]:
    out = {}
    drawn = [case_from(RandomPicks(i)) for i in range(cases)]
    for name, (factory, _, _) in quantizers().items():
        per_case = [measure_quantized(factory, case) for case in drawn]
        out[name] = {kind: [w[kind] for w in per_case] for kind in ("logits", "kv", "token")}
    return out


def quantized(a) -> int:
    torch.set_num_threads(1)
    result = calibrate_quantized(a.cases)
    print(f"{a.cases} drawn cases, fp32, P1 (concat, static) and P2; worst err / max|expected| over every compared "
          "tensor of a case (logits of the cached paths; cached K/V)")
    print("| quantizer | quantity | worst | median of the per-case worst | smallest per-case worst | bound rtol | "
          "cases within the bound |")
    print("|---|---|---|---|---|---|---|")
    for name, (_, dtype, _) in quantizers().items():
        for kind, values in result[name].items():
            if kind == "token":
                continue
            v = sorted(values)
            bound = QUANTIZED[(dtype, kind)]
            within = sum(x <= bound.rtol for x in v)
            print(f"| {name} | {kind} | {v[-1]:.3e} | {v[len(v) // 2]:.3e} | {v[0]:.3e} | {bound.rtol:g} | "
                  f"{within}/{len(v)} |")
        print(f"| {name} | greedy token beyond a near-tie | {int(sum(result[name]['token']))} of {a.cases} cases "
              "| | | | |")
        over = sum(t > 0 or any(result[name][k][i] > QUANTIZED[(dtype, k)].rtol for k in ("logits", "kv"))
                   for i, t in enumerate(result[name]["token"]))
        print(f"| {name} | any (a case P1 or P2 fails under the bound) | {over} of {a.cases} cases | | | | |")
    return 0



# --- the compiled decode step's bound (capture.py: logits:compiled): `calibrate compiled` ---------------------

def measure_compiled(target: str, case, dtype: torch.dtype) -> tuple[float, float] | None:
    """(worst err / max|expected|, worst err / bound) of graph-capture's comparison of the compiled decode
    steps with the eager ones on one case (cpu), recorded instead of judged (compare.measuring); None where
    the target declares something the case needs unsupported."""
    from mpt_kv.checks import capture
    from mpt_kv.targets import required_features

    resolved, cpu = resolve_target(target), torch.device("cpu")
    caps = resolved.capabilities(cpu, dtype)
    if any(caps.reason(f) for f in required_features("static", None, dtype, cpu, case.cfg.clip_qkv)):
        return None
    runner = resolved.build(case.cfg, random_state_dict(case.cfg, seed=case.seed), cpu, dtype)
    with measuring() as measured:
        capture.check_graph_capture(runner, P.Context(target, "cpu", dtype, case, "static"))
    mine = [m for m in measured if m["key"][1] == "logits:compiled"]
    return (max(m["err"] / max(m["scale"], 1e-30) for m in mine), max(m["frac"] for m in mine)) if mine else None


def compiled(a) -> int:
    torch.set_num_threads(1)
    targets = a.target or ["reference", *[f"mpt_kv.catalogue.designs:{d}" for d in designs.DESIGNS]]
    drawn = [case_from(RandomPicks(i)) for i in range(a.cases)]
    print(f"{a.cases} drawn cases x {len(targets)} targets, the static decode steps compiled (torch.compile fullgraph, "
          "aot_eager) vs eager, cpu; worst err / max|expected| of a case's decode-step logits")
    print("| dtype | compiled step vs eager: worst | median of the per-case worst | cases | bound (atol, rtol) | "
          "worst / bound | rtol for worst = 0.5 bound | worst case |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in DTYPES:
        per_case = []
        for target in targets:
            for i, case in enumerate(drawn):
                if dtype != torch.float32 and d_model(case.describe()) < BF16_MIN_D_MODEL:
                    continue
                worst = measure_compiled(target, case, dtype)
                if worst is not None:
                    per_case.append((*worst, f"{target} #{i} {case.describe()}"))
        values = sorted(w for w, _, _ in per_case)
        tol = TOLERANCES[(str(dtype)[6:], "logits:compiled")]
        worst, frac, where = max(per_case)
        print(f"| {str(dtype)[6:]} | {worst:.3e} | {values[len(values) // 2]:.3e} | {len(values)} | "
              f"{tol.atol:g}, {tol.rtol:g} | {max(f for _, f, _ in per_case):.3f} | {2 * worst:.3g} | {where} |")
    return 0


def parse_shard(text: str) -> tuple[int, int]:
    """--shard K/N: this process runs case indices K, K + N, ...; 0 <= K < N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected K/N with 0 <= K < N (shard K of N), e.g. 0/4")
    return int(k), int(n)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv calibrate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cases of one shard on one target, appending to OUT")
    r.add_argument("--target", required=True, help="a built-in target or package.module:factory")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the cases run (default cpu)")
    r.add_argument("--tf32", default=None, choices=["on", "off"],
                   help="cuda: TF32 matmuls (torch.backends.cuda.matmul.allow_tf32) on or off (required there)")
    r.add_argument("--sdpa-backend", default=None, choices=SDPA_BACKENDS,
                   help="cuda: the one scaled_dot_product_attention backend allowed (torch.nn.attention.sdpa_kernel; "
                        "required there; default: torch chooses)")
    r.add_argument("--cases", type=int, default=5000, help="case indices 0 .. CASES-1 (default 5000)")
    r.add_argument("--shard", type=parse_shard, default=(0, 1), help="k/n: this process runs case indices k, k + n, ...")
    r.add_argument("--out", type=path_arg, default=Path("calibration"))
    r.add_argument("-v", "--verbose", action="store_true")
    s = sub.add_parser("report", help="merge result files and print the tables")
    s.add_argument("files", nargs="+", type=path_arg)
    s.add_argument("--show", type=int, default=10, help="how many unexpected errors to print")
    q = sub.add_parser("quantized", help="the quantized caches' bounds (checks/quantized.py): correct vs wrong quantizers")
    q.add_argument("--cases", type=int, default=200, help="drawn cases (strategies.case_from(RandomPicks(i)))")
    c = sub.add_parser("compiled", help="the compiled decode step's bound (logits:compiled): torch.compile vs eager")
    c.add_argument("--cases", type=int, default=200, help="drawn cases (strategies.case_from(RandomPicks(i)))")
    c.add_argument("--target", action="append", default=None, help="targets (default: reference and the designs)")
    calibrate_families.add_parser(sub)
    a = p.parse_args(argv)
    # every value before any work: a case count, the targets (built-in and installed, or a spec that loads)
    if a.command in ("run", "quantized", "compiled") and a.cases < 1:
        p.error(f"--cases {a.cases}: give 1 or more cases")
    if a.command == "report" and a.show < 0:
        p.error(f"--show {a.show}: give 0 or more")
    for spec in ([a.target] if a.command == "run" else a.target or [] if a.command == "compiled" else []):
        problem = named_target_problem(spec, resolve_target)
        if problem:
            p.error(f"--target {spec}: {problem}")
    if a.command == "run":
        if a.device == "cpu" and (a.tf32 or a.sdpa_backend):
            p.error(f"--tf32 and --sdpa-backend are cuda's conditions; --device {a.device} has neither")
        if a.device == "cuda":
            reason = devices.unavailable_reason("cuda")
            if reason:
                p.error(f"--device cuda is not available here: {reason}")
            if a.tf32 is None or a.sdpa_backend is None:
                p.error("--device cuda: give --tf32 on|off and --sdpa-backend (default|math|flash|efficient|cudnn): "
                        "the bounds depend on both, and each run records them")
    return {"run": run, "report": report, "quantized": quantized, "compiled": compiled,
            "families": calibrate_families.families}[a.command](a)

