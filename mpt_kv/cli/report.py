"""`python -m mpt_kv report A.json [B.json ...]`: one conformance matrix from the JSON reports of
several runs (`pytest --mpt-kv-report FILE`, `python -m mpt_kv run --report FILE`).

The main job (`tox -m conformance`) runs the suite in two environments, because optimum-habana
pins an older transformers than the latest: the default env (reference, the latest
transformers) and the optimum-habana env. This prints their results as one matrix, with each
target's versions, and the memory table of both.

Merging: a target that could not run in one environment (skipped there: not installed) and ran
in another shows the run it had; what the checks reached ("reach") is concatenated. Exit status
1 if any case failed, errored or passed while expected to fail (XPASS), if the reports hold no
result at all, if their conformance cases all skipped (unless every run was made with
--allow-missing-device), or if a target that ran had no cache property pass (unless every run was
made with --allow-no-cache-check): the plugin's own rule, mpt_kv.plugin.gate.run_problems; 2 for a report that is missing, unreadable or not an mpt-kv report, or
a --json path that cannot be written (checked before any work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from mpt_kv.outputs import clash_problem, file_problem, path_arg, write_text
from mpt_kv.plugin.gate import run_problems
from mpt_kv import versions
from mpt_kv.plugin.report import header, matrix_lines, project_lines
from mpt_kv.checks import reach
from mpt_kv.checks.stored_ceilings import table
from mpt_kv.plugin.report import reach_summary
from mpt_kv.plugin.markdown import render

BAD = ("failed", "error", "XPASS")


RESULT_FIELDS = ("target", "property", "outcome")  # what the matrix reads of every result
# every outcome the plugin writes (mpt_kv.plugin.outcomes): another word would be counted as neither good nor bad
OUTCOMES = ("passed", "failed", "error", "skipped", "xfail", "XPASS", "unsupported")
# the optional fields the merge reads, with their type: another type would be a traceback in merge()
REPORT_FIELDS = {"absent_devices": dict, "memory": list, "capabilities": dict, "unrecorded": list, "reach": list,
                 "allow_missing_device": bool, "environment": dict, "hypothesis_profile": (str, type(None))}


def usage_error(message: str):
    """Exit 2, as the help says, with one line naming the file and what is wrong."""
    print(f"mpt-kv report: {message}", file=sys.stderr)
    raise SystemExit(2)


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # missing, a folder, not UTF-8 (a binary file), not JSON
        usage_error(f"cannot read {path}: {type(e).__name__}: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        usage_error(f"{path} is not an mpt-kv report (no 'results' list); write one with pytest --mpt-kv-report FILE")
    for i, r in enumerate(data["results"]):
        missing = [k for k in RESULT_FIELDS if not isinstance(r, dict) or not isinstance(r.get(k), str)]
        if missing:
            usage_error(f"{path}: result {i} has no {' or '.join(map(repr, missing))} (every result of an mpt-kv "
                        f"report has {', '.join(RESULT_FIELDS)}): not a report pytest --mpt-kv-report wrote")
        if r["outcome"] not in OUTCOMES:
            usage_error(f"{path}: result {i} has outcome {r['outcome']!r}: expected one of {', '.join(OUTCOMES)}")
        if not isinstance(r.get("device", ""), str):
            usage_error(f"{path}: result {i} has device {r['device']!r} ({type(r['device']).__name__}): expected a str")
        if not isinstance(r.get("cache", {}), dict):  # the evidence that a cache exists (gate.checked_cache)
            usage_error(f"{path}: result {i} has cache {r['cache']!r:.60} ({type(r['cache']).__name__}): expected a dict")
    check_report_fields(path, data)
    return data


def check_report_fields(path: Path, data: dict) -> None:
    """Each optional field the merge reads has its type (REPORT_FIELDS), or the report is refused."""
    for name, kind in REPORT_FIELDS.items():
        if name in data and not isinstance(data[name], kind):
            want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            usage_error(f"{path}: field {name!r} is {type(data[name]).__name__} ({data[name]!r:.60}): expected {want}")


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
    return {"mpt_kv_version": versions.mpt_kv(),  # the mpt-kv that merged and judged them; each run's: "environments"
            "results": results, "memory": memory, "absent_devices": absent, "capabilities": capabilities,
            "unrecorded": unrecorded, "hypothesis_profile": "/".join(profiles) or None,
            "reach": [r for rep in reports for r in rep.get("reach", [])],
            "allow_missing_device": all(rep.get("allow_missing_device", False) for rep in reports),
            "allow_no_cache_check": all(rep.get("allow_no_cache_check", False) for rep in reports),
            "environments": [{"written": rep.get("written", "?"), **rep.get("environment", {})} for rep in reports]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m mpt_kv report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=path_arg, help="JSON reports (pytest --mpt-kv-report FILE)")
    p.add_argument("--json", help="also write the merged report here (checked before any work)")
    p.add_argument("--markdown", metavar="FILE",
                   help="also write a short Markdown summary (verdict, what broke, known failures, the matrix "
                        "collapsed) for a CI job summary or a pull-request comment")
    p.add_argument("--previous", metavar="REPORT", type=path_arg,
                   help="a stored run's JSON report: the summary also lists every case whose outcome changed")
    args = p.parse_args(argv)

    for flag, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = path is not None and file_problem(path)
        if problem:
            usage_error(f"{flag} {path!r}: {problem}")
    problem = clash_problem([("--json", args.json), ("--markdown", args.markdown)],
                            [*(("the report", path) for path in args.reports), ("--previous", args.previous)])
    if problem:
        usage_error(problem)
    if args.previous is not None and args.markdown is None:
        usage_error("--previous is only read with --markdown")
    previous = load(args.previous)["results"] if args.previous is not None else None

    merged = merge([load(path) for path in args.reports])
    print(f" {header()} ".center(80, "="))
    for path, env in zip(args.reports, merged["environments"]):
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    for line in matrix_lines(merged["results"], merged["absent_devices"], merged["hypothesis_profile"]):
        print(line)
    for line in project_lines({"capabilities": merged["capabilities"], "unrecorded": merged["unrecorded"]}):
        print(line)
    if merged["reach"]:

        print("=" * 34 + " mpt-kv reach " + "=" * 34)
        print("\n".join(reach.table_lines(reach.summarize(merged["reach"]), reach.load_reference_model())))
    if merged["memory"]:
        print("=" * 34 + " mpt-kv memory " + "=" * 33)
        print("\n".join(table(merged["memory"])))
    if args.json:
        write_text(args.json, json.dumps({**merged, "unrecorded": list(merged["unrecorded"].values()),
                                          "reach_summary": reach_summary(merged["reach"])}, indent=1, default=str))
    bad = [r for r in merged["results"] if r.get("outcome") in BAD]
    problems = run_problems(merged["results"], merged["allow_missing_device"], merged["allow_no_cache_check"])
    if args.markdown:

        verdict = (["no results in the reports: nothing ran, which is not a pass"] if not merged["results"]
                   else problems)
        runs = {str(path): env.get("mpt-kv", "unknown") for path, env in zip(args.reports, merged["environments"])}
        write_text(args.markdown, render(merged["results"], verdict, merged["absent_devices"],
                                         merged["hypothesis_profile"], previous, runs))
    if not merged["results"]:
        print("no results in the reports: nothing ran, which is not a pass", file=sys.stderr)
        return 1
    if bad:
        print(f"{len(bad)} cases failed, errored or passed unexpectedly (XPASS): see the runs above", file=sys.stderr)
        return 1
    for line in problems:  # the plugin's own end-of-run rule, over the same records
        print(line, file=sys.stderr)
    return 1 if problems else 0
