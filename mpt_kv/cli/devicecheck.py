"""`python -m mpt_kv devicecheck --out DIR`: mpt-kv on an accelerator, as one command with its own time
limits and one output folder: the seed table at MPT-7B's shapes, the shipped suite's cases of that
device, and the static decode step captured as a graph (docs/bench.md, "The device check").

    python -m mpt_kv devicecheck --out devicecheck                       # a GPU: cuda, MPT-7B's shapes
    python -m mpt_kv devicecheck --out dry --device cpu --model tiny     # its dry run, on any machine

Steps, in this order, each a subprocess with its own time limit, its output under OUT/<step>/:

  graphs        graph-capture on every target that declares static shapes (a static path; the others are listed
                with their reason): the static decode step compiled by torch.compile(fullgraph=True,
                backend="aot_eager") and, on cuda, captured as a torch.cuda.CUDAGraph and replayed, each step equal
                to eager (`python -m mpt_kv run --device D -m D -k graph-capture`)
  bench         `bench --model M` on the seed PR's rows (MPT-7B: batch 128, 128 in, 128 new, and batch 2, 1024 in,
                1024 new): the reference's concat and static paths, transformers (the installed 5.x) concat and
                static, and the catalogue's kv_views_of_mixed_qkv on its concat path (the seed bug), each with
                throughput, memory allocated and max memory allocated beside the analytic model
  suite-TARGET  the shipped suite's cases of the device (`python -m mpt_kv run --device D -m D`, graph-capture
                excepted: step graphs ran it), one target per step: reference, transformers, and llm-foundry's
                attn_impl torch and flash paths where installed ("not run: not installed here" otherwise)
  bench-legacy  the bench's rows on transformers 4.55.4, the release that shipped the seed bug in its
                DynamicCache (concat: its MPT has no static path), loaded from --legacy-transformers DIR (put
                first on that step's sys.path): a folder holding transformers 4.55.4 and what it needs beyond
                a transformers 5 environment (huggingface_hub<1, tokenizers<0.22, and the requests huggingface_hub
                0.x imports: `pip install --no-deps --target DIR` of their wheels, docs/bench.md)
  seed-gaudi-before, seed-gaudi-after
                the seed PR's before and after on a real allocator: optimum-habana's own MPT module, as the seed
                ran it (the recipe `seed`: bf16, static shapes, no reuse_cache; `mpt_kv.targets.gaudi:seed`), on
                the seed's four rows, from --gaudi-before DIR (optimum-habana 1.12.1, whose static cache holds
                views of mixed_qkv, with transformers 4.40.2) and --gaudi-after DIR (1.21.2 with 4.55.4), each
                folder first on its step's sys.path; memory allocated and max memory beside the seed's figures

Each step's limit (--timeout STEP=SECONDS changes one) is also cut to what is left of --budget: the whole
command ends within it (default 470 s, under 8 minutes with the start). A step that runs out of time is
killed with its subprocesses and reported so; the bench writes its rows as each config ends, so a bench
stopped late keeps the configs it finished.

Writes OUT/summary.md and OUT/summary.json (what is here, each step's status, time and command, the bench
rows beside the seed PR's Gaudi figures), each step's log as OUT/<step>.log, and its report and tables in
OUT/<step>/ (the folder its own command writes).

A step that did not run is never a pass: one whose prerequisite is not here (a target's package, --legacy-
transformers) is reported "not run" with the reason and named in the verdict line, and a step asked for with
--step that cannot run here is a usage error before any work.

Exit status: 0 every step that applies here ran and passed; 1 a step failed, crashed, ran out of time or
was left without budget (its log says why), or nothing ran; 2 a usage error (the device is not here, a bad
value, a step asked for that cannot run here), before any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mpt_kv import devices, versions
from mpt_kv.outputs import clash_problem, dir_problem, mark_output, path_arg

# the seed PR's rows at MPT-7B's shapes (the batch-128 row first: the headline), and rows of the same
# form that fit the small presets' max_seq_len (a dry run)
SEED_ROWS = {"mpt-7b": ["128,128,128", "2,1024,1024"], "mpt-30b": ["128,128,128", "2,1024,1024"]}
# all four of the seed PR's rows (the seed-gaudi steps: optimum-habana's MPT before and after the fix), headline first
SEED_FOUR = ["128,128,128", "16,128,1024", "2,1024,1024", "16,1024,1024"]
SEED_TARGET = "mpt_kv.targets.gaudi:seed"  # the optimum-habana target with the seed's recipe (mpt_kv/recipes.py)
SMALL_ROWS = ["4,16,16", "2,32,16"]
VIEWS = "mpt_kv.catalogue.variants:kv_views_of_mixed_qkv"
FOUNDRY_FLASH = "mpt_kv.targets.foundry:build_flash"
# each step's time limit in seconds (unmeasured on a GPU: docs/bench.md); suite-* applies to each target's step
TIMEOUTS = {"graphs": 45, "bench": 230, "suite": 55, "bench-legacy": 80, "seed-gaudi": 200}
STEPS = tuple(TIMEOUTS)  # --step's names: a step, or every step of that name (graphs-*, suite-*)
BUDGET = 470
LEGACY = "4.55.4"
NOT_SELECTED = "not run: not among --step"
NOT_HERE = "not run: not installed here"  # its prerequisite is missing: named in the verdict, never a pass
NO_STATIC = "not applicable: no static path"
RAN = ("passed", "failed", "timed out")  # the statuses of a step that ran


@dataclass
class Step:
    name: str
    command: list[str]
    limit: int
    env: dict = field(default_factory=dict)
    status: str = "not run"  # passed | failed (exit N) | timed out after S s | not run: why | not applicable: why
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Passed, or it does not apply here (what it needs is not installed, or --step left it out); a
        requested step that did not run at all fails the run anyway (`not_run_requested`)."""
        return self.status == "passed" or self.status.startswith((NOT_HERE, NOT_SELECTED, NO_STATIC))

    @property
    def ran(self) -> bool:
        return self.status.startswith(RAN)

    @property
    def runs(self) -> bool:
        """It ran, or it is planned to (not run yet, with a command)."""
        return self.ran or (self.status == "not run" and bool(self.command))

    @property
    def group(self) -> str:
        """Its --step name: graphs-reference -> graphs, suite-llm-foundry -> suite, seed-gaudi-before ->
        seed-gaudi, bench-legacy itself."""
        return self.name if self.name in STEPS else next(
            g for g in sorted(STEPS, key=len, reverse=True) if self.name.startswith(f"{g}-"))


# the step names whose steps are one comparison: asked for, every one of them must run (a before without its after
# compares nothing)
ALL_OR_NONE = ("seed-gaudi",)


def not_run_requested(requested: list[str] | None, steps: list[Step]) -> list[Step]:
    """The steps of each name asked for with --step of which none runs (all of them, where none does); of a name
    in ALL_OR_NONE, each that does not run."""
    out = []
    for name in requested or []:
        group = [s for s in steps if s.group == name]
        if name in ALL_OR_NONE:
            out += [s for s in group if not s.runs]
        elif not any(s.runs for s in group):
            out += group
    return out


def builtin_installed(name: str) -> str | None:
    """None if built-in target `name` can run here, else why not ("no such built-in target", "X is not installed")."""
    if name not in versions.BUILTIN:
        return f"this mpt-kv has no built-in target {name}"
    return versions.missing(name)


def foundry_flash() -> str | None:
    """None if llm-foundry's attn_impl="flash" factory is here (its target module and llm-foundry installed)."""
    missing = builtin_installed("llm-foundry")
    if missing:
        return missing
    if importlib.util.find_spec("mpt_kv.targets.foundry") is None:
        return "this mpt-kv has no llm-foundry target module"
    return None


def targets_here() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """([(label, spec)] to run, [(label, spec, why not)]): reference, transformers, llm-foundry's torch and flash."""
    wanted = [("reference", "reference", None), ("transformers", "transformers", builtin_installed("transformers")),
              ("llm-foundry", "llm-foundry", builtin_installed("llm-foundry")),
              ("llm-foundry-flash", FOUNDRY_FLASH, foundry_flash())]
    return ([(label, spec) for label, spec, why in wanted if why is None],
            [(label, spec, why) for label, spec, why in wanted if why is not None])


def static_path_missing(spec: str, device: str) -> str | None:
    """The target's own reason where it declares no static path (graph-capture has nothing to capture
    there), read from a tiny runner; None where it has one, or where the probe fails (its step says why)."""
    import torch

    from mpt_kv.targets import resolve_target

    try:
        return resolve_target(spec).capabilities(devices.torch_device(device), torch.float32).reason("static")
    except Exception:  # noqa: BLE001  a target that does not build: its graphs case reports the error
        return None


def mpt_kv(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpt_kv", *args]


def plan(a, out: Path) -> list[Step]:
    run_targets, absent = targets_here()
    device = a.device
    steps = []
    # the static decode step of every target that declares static shapes (a static path); the others say why
    no_static = {label: static_path_missing(spec, device) for label, spec in run_targets}
    target_args = [x for label, spec in run_targets if not no_static[label] for x in ("--target", spec)]
    graphs = out / "graphs"
    steps.append(Step("graphs", mpt_kv("run", "--device", device, "-m", device, *target_args, "--only-targets",
                                       "-k", "graph-capture", "--report", str(graphs / "report.json"),
                                       "--mpt-kv-markdown", str(graphs / "summary.md")), a.timeouts["graphs"]))
    steps += [Step(f"graphs-{label}", [], 0, status=f"{NO_STATIC}: {why}") for label, why in no_static.items() if why]
    rows = a.config or SEED_ROWS.get(a.model, SMALL_ROWS)
    bench_args = ["bench", "--device", device, "--model", a.model, "--repeat", "1", "--warmup", "0", "--quiet",
                  *[x for row in rows for x in ("--config", row)]]
    steps.append(Step("bench", mpt_kv(*bench_args, "--target", "reference", "--target", "transformers", "--target",
                                      VIEWS, "--skip", f"{VIEWS}/static", "--out", str(out / "bench")),
                      a.timeouts["bench"]))
    for label, spec in run_targets:
        where = out / f"suite-{label}"
        command = mpt_kv("run", "--device", device, "-m", device, "--target", spec, "--only-targets",
                         "-k", " and ".join(filter(None, ["not graph-capture", a.k and f"({a.k})"])),
                         "--report", str(where / "report.json"), "--mpt-kv-markdown", str(where / "summary.md"))
        steps.append(Step(f"suite-{label}", command, a.timeouts["suite"]))
    for label, spec, why in absent:
        steps.append(Step(f"suite-{label}", [], 0, status=f"{NOT_HERE}: {why}"))
    legacy = Step("bench-legacy", mpt_kv(*bench_args, "--target", "transformers", "--path", "concat", "--out",
                                         str(out / "bench-legacy")), a.timeouts["bench-legacy"])
    if a.legacy_transformers is None:
        legacy.status = (f"{NOT_HERE}: no --legacy-transformers DIR (transformers {LEGACY} with huggingface_hub<1, "
                         "tokenizers<0.22 and requests: docs/bench.md)")
    else:
        legacy.env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(a.legacy_transformers).resolve()),
                                                                  os.environ.get("PYTHONPATH")]))}
    steps.append(legacy)
    for when in ("before", "after"):
        folder = getattr(a, f"gaudi_{when}", None)
        seed = Step(f"seed-gaudi-{when}", mpt_kv(
            "bench", "--device", device, "--model", a.model, "--repeat", "1", "--warmup", "0", "--quiet",
            *[x for row in (a.config or (SEED_FOUR if a.model in SEED_ROWS else SMALL_ROWS)) for x in ("--config", row)],
            "--target", SEED_TARGET, "--path", "static", "--dtype", "bf16", "--out", str(out / f"seed-gaudi-{when}")),
            a.timeouts["seed-gaudi"])
        if folder is None:
            seed.status = (f"{NOT_HERE}: no --gaudi-{when} DIR (optimum-habana "
                           f"{'1.12.1 with transformers 4.40.2' if when == 'before' else '1.21.2 with transformers 4.55.4'}"
                           ": docs/bench.md)")
        else:
            seed.env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(folder).resolve()),
                                                                    os.environ.get("PYTHONPATH")]))}
        steps.append(seed)
    for s in steps:
        if a.step and s.status == "not run" and s.group not in a.step:
            s.command, s.status = [], NOT_SELECTED
    return steps


def run_step(step: Step, log: Path, limit: float) -> None:
    """Run `step` with its output in `log`, killed with its whole process group at `limit` seconds."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CI": "true", **step.env}
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(step.command) + "\n\n")
        f.flush()
        proc = subprocess.Popen(step.command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    step.seconds = round(time.monotonic() - t0, 1)
    if code is None:
        step.status = f"timed out after {limit:.0f} s"
    else:
        step.status = "passed" if code == 0 else f"failed (exit {code})"
    step.detail = tail(log)


def tail(log: Path, lines: int = 3) -> str:
    text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-600:]


def environment(a) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": versions.installed("transformers"), "mpt-kv": versions.installed("mpt-kv"),
           "llm-foundry": versions.installed("llm-foundry"), "device": a.device}
    if a.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.mem_get_info(0)[1] / 2**30, 1)
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    for when in ("before", "after"):
        folder = getattr(a, f"gaudi_{when}", None)
        if folder:
            probe = subprocess.run([sys.executable, "-c", "from importlib.metadata import version; print("
                                    "version('optimum-habana'), version('transformers'))"], capture_output=True,
                                   text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(folder).resolve())})
            env[f"gaudi-{when}"] = probe.stdout.strip() or f"does not import: {probe.stderr.strip().splitlines()[-1:]}"
    if a.legacy_transformers:
        probe = subprocess.run([sys.executable, "-c", "import transformers, huggingface_hub, tokenizers; print("
                                "transformers.__version__, huggingface_hub.__version__, tokenizers.__version__)"],
                               capture_output=True, text=True, timeout=120,
                               env={**os.environ, "PYTHONPATH": str(Path(a.legacy_transformers).resolve())})
        env["legacy"] = probe.stdout.strip() or f"does not import: {probe.stderr.strip().splitlines()[-1:]}"
    return env


# --- the summary ----------------------------------------------------------------------------------------------

def results(step: Step, out: Path) -> list[str]:
    """Per target of a run step's report: its cases by outcome, and the checks that failed."""
    path = out / step.name / "report.json"
    if not path.is_file():
        return []
    report = json.loads(path.read_text())
    by_target: dict[str, dict[str, list[str]]] = {}
    for r in report.get("results", []):
        by_target.setdefault(r["target"], {}).setdefault(r["outcome"], []).append(r["check"])
    lines = []
    for target, outcomes in by_target.items():
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(outcomes.items()))
        bad = sorted({c for k, v in outcomes.items() if k in ("failed", "error", "XPASS") for c in v})
        lines.append(f"{target}: {counts}" + (f"; failed: {', '.join(bad[:12])}" if bad else ""))
    return lines


def bench_rows(out: Path) -> list[dict]:
    rows = []
    for name in ("bench", "bench-legacy", "seed-gaudi-before", "seed-gaudi-after"):
        path = out / name / "bench.json"
        if path.is_file():
            data = json.loads(path.read_text())
            for r in data["rows"]:
                label = r["target"].replace(f"{VIEWS}", "kv_views_of_mixed_qkv (variant)")
                if name == "bench-legacy":
                    label = f"transformers {data['meta'].get('transformers')}"
                if name.startswith("seed-gaudi"):  # the release the folder held, as the seed ran it
                    label = f"optimum-habana {data['meta'].get('optimum-habana')} (seed recipe)"
                rows.append({**r, "label": f"{label}/{r['path']}", "complete": data["meta"].get("complete", True)})
    return rows


def seed_table(rows: list[dict]) -> list[str]:
    """Our rows beside the seed PR's Gaudi rows of the same shape."""
    from mpt_kv.memory.analytic import SEED_TABLE

    big = any(r["max_allocated"] >= 2**30 for r in rows)  # GB as the seed's table, MB for a dry run's tiny model
    unit, div = ("GB", 2**30) if big else ("MB", 2**20)
    out = [f"| row | batch, in, new | throughput (tokens/s) | memory allocated ({unit}) | max memory allocated ({unit}) | "
           f"analytic min ({unit}) |", "|---|---|---|---|---|---|"]
    shapes = list(dict.fromkeys((r["batch"], r["max_input"], r["max_new"]) for r in rows))
    for shape in shapes:
        for s in SEED_TABLE:
            if (s.batch, s.max_input, s.max_new) == shape:
                out.append(f"| seed PR, Gaudi, {s.version} | {s.batch}, {s.max_input}, {s.max_new} | {s.throughput:.0f} | "
                           f"{s.allocated_gb:.2f} | {s.max_allocated_gb:.2f} | - |")
        for r in (r for r in rows if (r["batch"], r["max_input"], r["max_new"]) == shape):
            analytic = "-" if r.get("analytic_min") is None else f"{r['analytic_min'] / div:.2f}"
            out.append(f"| {r['label']} | {r['batch']}, {r['max_input']}, {r['max_new']} | {r['throughput']:.0f} | "
                       f"{r['allocated'] / div:.2f} | {r['max_allocated'] / div:.2f} | {analytic} |")
    return out


def verdict(a, steps: list[Step]) -> list[str]:
    """Why the check is not a pass ([] if it is): a step that failed, timed out or was left without
    budget, a step asked for with --step of which nothing ran, or no step run at all."""
    problems = [f"{s.name}: {s.status}" for s in steps if not s.ok]
    problems += [f"{s.name} was asked for (--step {s.group}) and did not run: {s.status}"
                 for s in not_run_requested(getattr(a, "step", None), steps) if s.ok]
    if not any(s.ran for s in steps):
        problems.append("no step ran: a device check that ran nothing is not a pass")
    return problems


def summarize(a, out: Path, env: dict, steps: list[Step], seconds: float, command: list[str]) -> int:
    problems = verdict(a, steps)
    ok = not problems
    not_here = [s for s in steps if s.status.startswith(NOT_HERE)]
    rows = bench_rows(out)
    data = {"command": " ".join(command), "environment": env, "seconds": round(seconds, 1), "budget": a.budget,
            "passed": ok, "problems": problems, "steps": [{**asdict(s), "results": results(s, out)} for s in steps],
            "bench": rows}
    (out / "summary.json").write_text(json.dumps(data, indent=1))
    head = f"{'PASSED' if ok else 'FAILED'} in {seconds:.0f} s (budget {a.budget} s)"
    if not_here:
        head += f"; not run here: {', '.join(s.name for s in not_here)} (their rows below say why)"
    md = [f"# mpt-kv device check: {env.get('gpu', a.device)}", "", f"`{data['command']}`", "",
          ", ".join(f"{k} {v}" for k, v in env.items() if v is not None), "",
          head, "", *([f"- {p}" for p in problems] + [""] if problems else []),
          "| step | status | seconds | limit |", "|---|---|---|---|"]
    md += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.limit} |" for s in steps]
    for s in steps:
        lines = results(s, out)
        if lines or (s.detail and not s.ok):
            md += ["", f"## {s.name}", ""] + [f"- {line}" for line in lines]
            if s.detail and not s.ok:
                md.append(f"- last lines of {s.name}.log: `{s.detail}`")
    if rows:
        md += ["", "## The seed table on this device", "",
               "The seed PR's rows (Gaudi, optimum-habana's MPT before and after the fix) beside this run's "
               f"({env.get('gpu', a.device)}, random weights, {'complete' if all(r['complete'] for r in rows) else 'partial: the bench ran out of time'})."
               " GB = 2**30 bytes, MB = 2**20; ours are the model's weights plus what the generation added.", ""]
        md += seed_table(rows)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return 0 if ok else 1


# --- the command ------------------------------------------------------------------------------------------------

def parse_timeout(text: str) -> tuple[str, int]:
    name, _, value = text.partition("=")
    if name not in TIMEOUTS or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--timeout {text!r}: expected STEP=SECONDS, STEP one of "
                                         f"{', '.join(TIMEOUTS)} (suite: each target's suite step), SECONDS >= 1")
    return name, int(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpt_kv devicecheck", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=path_arg,
                   help="the output folder: new, empty, or an earlier device check's (created)")
    p.add_argument("--device", default="cuda", choices=[k for k in devices.KINDS if k != "hpu"],
                   help="the device to check (default cuda); cpu with --model tiny is the dry run")
    p.add_argument("--model", default="mpt-7b", help="the bench's model preset (default mpt-7b; tiny for a dry run)")
    p.add_argument("--config", action="append", default=None, metavar="B,I,N",
                   help="a bench row instead of the model's seed rows (repeatable)")
    p.add_argument("--legacy-transformers", type=path_arg, default=None, metavar="DIR",
                   help=f"a folder with transformers {LEGACY} and what it needs beyond a transformers 5 environment "
                        "(huggingface_hub<1, tokenizers<0.22, requests): step bench-legacy (docs/bench.md)")
    for when, release in (("before", "1.12.1 (the cache as views of mixed_qkv) with transformers 4.40.2"),
                          ("after", "1.21.2 with transformers 4.55.4")):
        p.add_argument(f"--gaudi-{when}", type=path_arg, default=None, metavar="DIR",
                       help=f"a folder with optimum-habana {release} and what they need beyond this environment: "
                            f"step seed-gaudi-{when} (docs/bench.md)")
    p.add_argument("--timeout", action="append", type=parse_timeout, default=[], metavar="STEP=SECONDS",
                   help=f"one step's time limit (defaults: {', '.join(f'{k}={v}' for k, v in TIMEOUTS.items())})")
    p.add_argument("--budget", type=int, default=BUDGET, help=f"seconds for the whole command (default {BUDGET})")
    p.add_argument("--step", action="append", default=None, choices=STEPS,
                   help="run only these steps (repeatable; default all)")
    p.add_argument("-k", default=None, help="a pytest -k expression narrowing the suite steps' cases")
    return p


def main(argv: list[str] | None = None) -> int:
    from mpt_kv.memory.analytic import PRESETS

    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    a = p.parse_args(argv)
    a.timeouts = {**TIMEOUTS, **dict(a.timeout)}
    reason = devices.unavailable_reason(a.device)
    if reason:
        p.error(f"--device {a.device} is not available here: {reason}")
    if a.model not in PRESETS:
        p.error(f"--model {a.model!r}: expected one of {', '.join(PRESETS)}")
    if a.budget < 1:
        p.error(f"--budget {a.budget}: must be >= 1")
    problem = dir_problem(a.out, "devicecheck")
    if problem:
        p.error(f"--out {a.out}: {problem}")
    for option, folder in (("--legacy-transformers", a.legacy_transformers), ("--gaudi-before", a.gaudi_before),
                           ("--gaudi-after", a.gaudi_after)):
        if folder is not None and not Path(folder).is_dir():
            p.error(f"{option} {folder}: not a folder")
    problem = clash_problem([("--out", a.out)], [("--legacy-transformers", a.legacy_transformers),
                                                 ("--gaudi-before", a.gaudi_before), ("--gaudi-after", a.gaudi_after)])
    if problem:
        p.error(problem)
    if a.config:  # the bench's rule, here: a bad row is a usage error now, not a failed bench step later
        from mpt_kv.cli import bench

        for row in a.config:
            try:
                config = bench.parse_config(row)
            except argparse.ArgumentTypeError as e:
                p.error(str(e))
            problem = bench.config_problem(config, bench.model_config(a.model), a.model)
            if problem:
                p.error(f"--config {row}: {problem}")
    out = Path(a.out)
    steps = plan(a, out)  # before anything is written: a step asked for that cannot run here is a usage error
    for s in not_run_requested(a.step, steps):
        p.error(f"--step {s.group}: {s.name} cannot run here ({s.status}); a device check that skips the step it was "
                "asked for is not a pass")
    out.mkdir(parents=True, exist_ok=True)
    mark_output(out, "devicecheck")  # a rerun may write here again (its steps' folders are marked by their own commands)
    t0 = time.monotonic()
    env = environment(a)
    for step in steps:
        if step.status != "not run" or not step.command:
            continue
        left = a.budget - (time.monotonic() - t0)
        if left < 5:
            step.status = f"not run: the {a.budget} s budget was spent"
            continue
        limit = min(step.limit, left)
        print(f"devicecheck: {step.name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        run_step(step, out / f"{step.name}.log", limit)  # beside, not in, the folder its command writes
        print(f"devicecheck: {step.name}: {step.status} in {step.seconds:.0f} s", file=sys.stderr, flush=True)
    code = summarize(a, out, env, steps, time.monotonic() - t0, ["python", "-m", "mpt_kv", "devicecheck", *argv])
    print((out / "summary.md").read_text())
    return code
