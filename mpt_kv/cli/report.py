"""`python -m mpt_kv report A.json [B.json ...]`: one conformance matrix from the JSON reports of
several runs (`pytest --mpt-kv-report FILE`, `python -m mpt_kv run --report FILE`).

The main job (`tox -m conformance`) runs the suite in two environments, because optimum-habana
pins an older transformers than the latest: the default env (reference, the latest
transformers) and the optimum-habana env. This prints their results as one matrix, with each
target's versions, and the memory table of both.

Merging: a target that could not run in one environment (skipped there: not installed) and ran
in another shows the run it had. Exit status 1 if any case failed, errored or passed while
expected to fail (XPASS), or if the reports hold no result at all; 2 for an unreadable report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BAD = ("failed", "error", "XPASS")


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"mpt-kv report: cannot read {path}: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise SystemExit(f"mpt-kv report: {path} is not an mpt-kv report (no 'results' list); "
                         "write one with pytest --mpt-kv-report FILE")
    return data


def merge(reports: list[dict]) -> dict:
    """One report from several: a target's skipped results are dropped where another report ran it."""
    ran = {r.get("target") for rep in reports for r in rep["results"] if r.get("outcome") != "skipped"}
    results = []
    for rep in reports:
        skipped_only = {r.get("target") for r in rep["results"]} - {r.get("target") for r in rep["results"]
                                                                    if r.get("outcome") != "skipped"}
        results += [r for r in rep["results"] if not (r.get("target") in skipped_only & ran)]
    # a device kind is absent if every report with cases of it had it absent
    absent = {}
    for kind in {r.get("device") for r in results}:
        reasons = [rep.get("absent_devices", {}).get(kind) for rep in reports
                   if any(r.get("device") == kind for r in rep["results"])]
        if reasons and all(reasons):
            absent[kind] = reasons[0]
    memory = [m for rep in reports for m in rep.get("memory", [])]
    capabilities = {t: u for rep in reports for t, u in rep.get("capabilities", {}).items()}
    unrecorded = {f"{u['target']}|{u['device']}|{u['file']}": u for rep in reports for u in rep.get("unrecorded", [])}
    profiles = sorted({rep.get("hypothesis_profile") for rep in reports if rep.get("hypothesis_profile")})
    return {"results": results, "memory": memory, "absent_devices": absent, "capabilities": capabilities,
            "unrecorded": unrecorded, "hypothesis_profile": "/".join(profiles) or None,
            "environments": [{"written": rep.get("written", "?"), **rep.get("environment", {})} for rep in reports]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="JSON reports (pytest --mpt-kv-report FILE)")
    p.add_argument("--json", type=Path, help="also write the merged report here")
    args = p.parse_args(argv)
    from mpt_kv.plugin.report import matrix_lines, project_lines

    merged = merge([load(path) for path in args.reports])
    print("=" * 30 + " mpt-kv conformance " + "=" * 30)
    for path, env in zip(args.reports, merged["environments"]):
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for line in matrix_lines(merged["results"], merged["absent_devices"], merged["hypothesis_profile"]):
        print(line)
    for line in project_lines({"capabilities": merged["capabilities"], "unrecorded": merged["unrecorded"]}):
        print(line)
    if merged["memory"]:
        from mpt_kv.checks.ceilings import table

        print("=" * 34 + " mpt-kv memory " + "=" * 33)
        print("\n".join(table(merged["memory"])))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**merged, "unrecorded": list(merged["unrecorded"].values())}, indent=1,
                                        default=str))
    bad = [r for r in merged["results"] if r.get("outcome") in BAD]
    if not merged["results"]:
        print("no results in the reports: nothing ran, which is not a pass", file=sys.stderr)
        return 1
    if bad:
        print(f"{len(bad)} cases failed, errored or passed unexpectedly (XPASS): see the runs above", file=sys.stderr)
        return 1
    return 0
