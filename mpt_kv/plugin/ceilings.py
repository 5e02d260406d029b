"""Memory ceilings in a run (mpt_kv/checks/stored_ceilings.py, mpt_kv/conformance/test_memory.py): the
project's stored ceilings given to the memory checks, --update-ceilings (on the controller: one
writer, a safe merge whatever -n), the memory table, and what the summary says when memory cases
fail: an analytic failure first (a bug, never a baseline to record), then how to record the
ceilings a target lacks.
"""

from __future__ import annotations

import shlex
from collections import defaultdict

from mpt_kv.checks import stored_ceilings as ceiling_file
from mpt_kv.plugin.state import run_state
from mpt_kv.plugin.options import ceilings_dir, required_ceilings


def stored_ceilings(config):
    """The project's StoredCeilings for the memory checks (mpt_kv.checks.ceilings), made once."""
    state = run_state(config)
    if state.stored_ceilings is None:
        state.stored_ceilings = ceiling_file.StoredCeilings(ceilings_dir(config), required_ceilings(config),
                                                            bool(config.getoption("update_ceilings")))
    return state.stored_ceilings


def record_command(config) -> str:
    """The command that records this run's memory ceilings: the run's own arguments (its
    --target, ini and selection), memory cases only, under `python -m pytest` (which puts the
    current folder on sys.path, where a project's target module often is)."""
    params = getattr(config, "invocation_params", None)
    args = [a for a in (params.args if params is not None else ("--pyargs", "mpt_kv.conformance"))
            if a != "--update-ceilings"]
    if not any(a == "-k" or a.startswith("-k") for a in args):
        args += ["-k", "memory"]
    return shlex.join(["python", "-m", "pytest", *args, "--update-ceilings"])


def update_ceilings(config) -> bool:
    """--update-ceilings, on the controller: merge the measurements into each device's baseline.
    A measurement that failed the analytic check is never recorded. Returns True if the run must
    fail (a loosening refused, or a corrupt file)."""
    if not config.getoption("update_ceilings") or getattr(config, "workerinput", None) is not None:
        return False
    memory = run_state(config).memory
    run_state(config).ceilings_diff = lines = []
    failed = False
    for kind in sorted({m["device"] for m in memory}):
        path = ceiling_file.baseline_path(kind, ceilings_dir(config))
        measured = [m for m in memory if m["device"] == kind and not m.get("problems")]
        broken = [m for m in memory if m["device"] == kind and m.get("problems")]
        if broken:
            lines.append(f"NOT recorded: {len(broken)} {kind} measurements failed the analytic check (a bug in the "
                         "target, never a baseline): fix it first")
        try:
            written, refused = ceiling_file.update_baseline(path, kind, measured,
                                                            config.getoption("allow_looser_ceilings"))
        except ceiling_file.BaselineError as e:
            lines.append(f"NOT written: {e}")
            failed = True
            continue
        lines.append(f"{path}: {len(measured)} measurements, {len(written)} values written "
                     f"({sum(c.kind == 'new' for c in written)} new, {sum(c.kind == 'tighter' for c in written)} "
                     f"tighter, {sum(c.kind == 'looser' for c in written)} looser)")
        lines += ceiling_file.diff_lines(written)
        if refused:
            failed = True
            lines.append(f"NOT written: {len({c.key for c in refused})} entries would loosen their ceilings "
                         "(rerun with --allow-looser-ceilings to accept):")
            lines += ceiling_file.diff_lines(refused)
    if not memory:
        lines.append("--update-ceilings: no memory measurement ran, nothing written")
    return failed


def failure_lines(config) -> list[str]:
    """Why memory cases failed, per device and target version: first those the analytic check
    failed (measured bytes the cache should not hold: a bug to fix, never offered for recording),
    then those that failed only because no ceiling is stored (a BaselineError), with the command
    that records them locally, not under CI."""
    if config.getoption("update_ceilings"):
        return []
    stored, analytic, missing = {}, defaultdict(int), defaultdict(int)
    for m in run_state(config).memory:
        if m["outcome"] not in ("failed", "error"):
            continue
        target = m["target"] + (f" ({m['target_version']})" if m.get("target_version") else "")
        if m.get("problems"):  # a PropertyFailure of the analytic check
            analytic[(m["device"], target)] += 1
            continue
        if m["outcome"] != "error":  # a stored ceiling exceeded: the failure says by how much
            continue
        if m["device"] not in stored:
            path = ceiling_file.baseline_path(m["device"], ceilings_dir(config))
            try:
                stored[m["device"]] = (path, ceiling_file.load_baseline(path, m["device"]))
            except ceiling_file.BaselineError:
                stored[m["device"]] = (path, None)  # corrupt: its cases' errors say so; nothing to record over it
        path, entries = stored[m["device"]]
        if entries is not None and ceiling_file.key_of(m) not in entries:
            missing[(m["device"], target, str(path))] += 1
    lines = [f"memory: {target} on {kind}: {n} cases failed the analytic memory check (the bytes it retains or "
             f"allocates are not what its KV cache needs: see each failure above); that is a bug to fix in the target, "
             f"not a baseline to record" for (kind, target), n in analytic.items()]
    lines += [f"memory ceilings: none stored for {target} on {kind} ({n} cases failed for that alone): record them "
              f"locally, not under CI, with `{record_command(config)}`, review the diff and commit {path}"
              for (kind, target, path), n in missing.items()]
    return lines


def summary(tw, config) -> None:
    if getattr(config, "workerinput", None) is not None:
        return
    state = run_state(config)
    if state.memory and not config.getoption("no_mpt_kv_matrix"):
        tw.write_sep("=", "mpt-kv memory")
        for line in ceiling_file.table(state.memory):
            tw.write_line(line)
    diff = state.ceilings_diff
    if diff is not None:
        tw.write_sep("=", "mpt-kv memory ceilings updated")
        for line in diff:
            tw.write_line(line, red=line.startswith(("NOT", "  !")))
    for line in failure_lines(config):
        tw.write_line(line, red=True)
