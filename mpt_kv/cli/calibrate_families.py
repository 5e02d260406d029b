"""`python -m mpt_kv calibrate families`: the family checks' comparisons over the zoo, recorded instead
of judged, in fp32 and bf16, so their bounds come from a measurement (docs/calibration.md, "The family
checks").

    python -m mpt_kv calibrate families --seeds 3 --out calibration/families-cpu.jsonl
    python -m mpt_kv calibrate families --report calibration/families-*.jsonl

Every value check of the family matrix (family-P0, family-P1, family-P2, family-ops) on every
implementation installed here, every variant of the registry and every path the implementation has,
on CPU, in fp32 and bf16, for weight and prompt seeds 0 .. N-1 (the checks run seed 0): the check's own
function on the runner and context the run layer builds (`mpt_kv.checks.family_driver`), every
`assert_close` recorded (`compare.measuring`) as err / bound per (dtype, compared quantity). A cell an
applicable known-failures entry covers (its dtype's) is not measured: its values are known to be wrong.
A cell that raises anyway (a crash, a shape) is counted as an error, with its message.

Each run appends one JSON line per cell to --out; --report merges files (several environments: the cpu
env's transformers, the ohabana env's ports and 4.55's transformers) and prints, per (dtype, quantity),
the worst error as a fraction of the bound in `compare.TOLERANCES`, the cells over it, and the rtol
that would put the worst at half its bound.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

DTYPES = (torch.float32, torch.bfloat16)
VALUE_CHECKS = ("family-P0", "family-P1", "family-P2", "family-ops")


def cells(implementations):
    """(implementation, FamilyTarget, check) of every value check's cell of the family matrix."""
    from mpt_kv.checks.registry import CHECKS, applies
    from mpt_kv.families.implementations import family_targets

    return [(t.implementation, t, c) for t in family_targets(implementations) for c in CHECKS.values()
            if c.property in VALUE_CHECKS and applies(c, t)]


def measure(target, check, dtype: torch.dtype, seed: int, entries) -> dict:
    """One cell on CPU: {"quantities": {quantity: [worst err / bound, worst err / scale]}, "outcome"}."""
    from mpt_kv.checks import family_driver, index, running
    from mpt_kv.checks.compare import measuring
    from mpt_kv.errors import TargetUnavailable, Unsupported
    from mpt_kv.findings.entries import match

    dname = str(dtype).replace("torch.", "")
    known = match(target.name, check.property, check.path, entries, dtype=dname, device="cpu")
    out = {"target": target.name, "check": check.id, "dtype": dname, "seed": seed, "quantities": {}}
    if known is not None:
        return {**out, "outcome": f"known: {known.name}"}
    try:
        c = family_driver.context_of(target.implementation, target.family, target.variant, check.path, dtype,
                                     check.property, "cpu", seed)
        runner = family_driver.runner_for(target.implementation, c.family, c.variant, dtype, c.options, "cpu", seed)
    except TargetUnavailable as e:
        return {**out, "outcome": f"unsupported: {e}"}
    outcome = "measured"
    with measuring() as measured:
        try:
            running.function_of(index.by_name(check.property))(runner, c)
        except Unsupported as e:  # a program it lacks: the other one was measured
            outcome = f"measured, part unsupported: {str(e)[:200]}"
        except Exception as e:  # noqa: BLE001  recorded, never a verdict here
            outcome = f"error: {type(e).__name__}: {str(e)[:300]}"
    for m in measured:
        worst = out["quantities"].setdefault(m["key"][1], [0.0, 0.0])
        worst[0] = max(worst[0], m["frac"])
        worst[1] = max(worst[1], m["err"] / max(m["scale"], 1e-30))
    return {**out, "outcome": outcome}


def run(a) -> int:
    from mpt_kv import versions
    from mpt_kv.families.implementations import IMPLEMENTATIONS
    from mpt_kv.findings.entries import load_families

    torch.set_num_threads(1)
    implementations = a.implementation or [i for i in IMPLEMENTATIONS if versions.missing(i) is None]
    chosen = [x for x in cells(implementations) if not a.family or x[1].family_name in a.family]
    entries = load_families()
    env = {"transformers": versions.transformers_version(),
           "optimum-habana": None if versions.missing("optimum-habana") else versions.optimum_habana_release()}
    records = []
    for seed in range(a.seeds):
        for dtype in DTYPES:
            for _, target, check in chosen:
                records.append({**measure(target, check, dtype, seed, entries), **env})
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    print_report(records)
    return 0


def report(a) -> int:
    records = [json.loads(line) for path in a.report for line in Path(path).read_text().splitlines() if line.strip()]
    print_report(records)
    return 0


def print_report(records: list[dict]) -> None:
    from mpt_kv.checks.compare import TOLERANCES

    outcomes = defaultdict(int)
    for r in records:
        outcomes[r["outcome"].split(":")[0]] += 1
    print(f"{len(records)} cells (value check x family target x dtype x seed): "
          + ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items())))
    worst: dict = {}
    over: dict = defaultdict(int)
    count: dict = defaultdict(int)
    for r in records:
        for quantity, (frac, rel) in r["quantities"].items():
            key = (r["dtype"], quantity)
            count[key] += 1
            over[key] += frac > 1
            if key not in worst or frac > worst[key][0]:
                where = f"{r['target']} {r['check']} seed {r['seed']} (transformers {r.get('transformers')})"
                worst[key] = (frac, rel, where)
    print("| dtype | quantity | atol | rtol | worst err / bound | cells over the bound | worst err / scale | "
          "rtol for worst = 0.5 bound | cells | worst cell |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(worst):
        tol = TOLERANCES[key]
        frac, rel, where = worst[key]
        print(f"| {key[0]} | {key[1]} | {tol.atol:g} | {tol.rtol:g} | {frac:.3f} | {over[key]} | {rel:.2e} | "
              f"{2 * rel:.3g} | {count[key]} | {where} |")
    errors = [r for r in records if r["outcome"].startswith("error")]
    for r in errors[:10]:
        print(f"error: {r['target']} {r['check']} {r['dtype']} seed {r['seed']}: {r['outcome']}")


def add_parser(sub) -> None:
    f = sub.add_parser("families", help="the family checks' comparisons over the zoo, fp32 and bf16 (their bounds)")
    f.add_argument("--seeds", type=int, default=3, help="weight and prompt seeds 0..N-1 (the checks run seed 0)")
    f.add_argument("--implementation", action="append", default=None,
                   help="implementations (default: every one installed here)")
    f.add_argument("--family", action="append", default=None, help="families (default: the registry's)")
    f.add_argument("--out", default=None, help="append one JSON line per cell to this file")
    f.add_argument("--report", nargs="+", default=None, metavar="FILE",
                   help="print the merged table of these files instead of running")


def families(a) -> int:
    return report(a) if a.report else run(a)
