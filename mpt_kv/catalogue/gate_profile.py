"""The gate profile: the per-pull-request subset of the conformance run, chosen from the catalogues.

    pytest --pyargs mpt_kv.conformance --target transformers --only-targets --mpt-kv-profile gate
    python -m mpt_kv gateprofile --check      # exit 1 when the stored profile is stale (cheap)
    python -m mpt_kv gateprofile --update     # recompute the kill data and the profile (minutes)

The whole run (every check id, every dtype, the families) stays the default and the nightly/main
job. The gate profile is the smallest set of conformance cases, (MPT check id, dtype), that still
kills every must-kill variant of the catalogue (`mpt_kv.catalogue.variants`) and passes every
must-pass design (`mpt_kv.catalogue.designs` and the reference). It is stored as data in the
package (`mpt_kv/data/gate-profile.json`), made by one repeatable rule:

1. Kill data. Each candidate (every MPT conformance check id of the registry, `mpt_kv.checks.registry.CHECKS`;
   the family checks' catalogue rows are the kill matrix's, not candidates here) is run once on the reference, fp32: its seconds are its cost
   (stored, so the rule is a function of the stored data; a bf16 case costs as its fp32 run), and one that
   fails the reference is excluded. Then each variant runs, as a target, the check ids of the kill-matrix
   columns it names as its expected killers (`Variant.killed_by`, which the kill matrix verifies in CI),
   cheapest first, until KILLS_PER_VARIANT (3) of them kill it; none killing it, the other columns' ids the
   same way. In the variant's dtype (fp32, or its own `dtype` for a bug that exists only below fp32), on
   cpu, under the `ci` hypothesis profile (derandomized, no example database: the same examples every
   time, as under `CI=true`). A check kills when it raises (a PropertyFailure, or any other exception:
   the kill matrix's crash rule).
2. Cover. Greedy set cover over (variant killed by case) and (required coverage met by case):
   repeatedly take the case that kills the most variants not yet killed, or meets the most
   requirements not yet met; ties go to the lower stored cost, then to the registry's order
   (CHECKS, fp32 before bf16). Then, in the order of decreasing cost, a chosen case whose every
   variant and requirement another chosen case also covers is dropped (the cover stays a cover, and
   smaller). The required coverage (`requirements`, from the index, not from kill data) is what the
   profile keeps whatever the catalogue's variants happen to need: a case of every column the
   variants name as their killers, and a value check (a property with an oracle) after an extend
   and after a reorder on every cache path, bucketed included, so that a bug on an operation no
   variant covers still meets a value check there. A requirement every candidate of which fails a
   must-pass design is given up, and the file says so (`gives_up`).
3. Must pass. Every chosen case is run on the reference and every design in that dtype; a case that
   fails one (a false positive) is removed from the candidates and step 2 is redone.

Variants that survive every check that ran (those waiting for a check feature, `Variant.waits_for`)
are listed as waiting, as the kill matrix lists them. The family checks (family-*) are not
candidates: their catalogue (`mpt_kv.catalogue.family_catalogue`) is the kill matrix's family rows, which
CI runs; the gate profile runs no family case, the whole run does.

The stored profile carries a fingerprint of what it was computed from: the catalogue modules' source
(variants.py, designs.py, assembly.py), the kill matrix's cases and columns, the candidate check ids,
the required coverage and the `ci` hypothesis profile's example count; and a digest of each of its own
parts (`digests`: the cases and what each kills, the killers, the fingerprint, ...), written with them,
so that a hand-edited file (a case cut, a killer emptied, a fingerprint pasted over a stale one) is
refused when loaded, naming the parts edited. A gate-profile run whose installed package does not
match the stored fingerprint, whose file was edited, or whose profile selects no case, fails before any
test, with the reason (mpt_kv/plugin/profile.py). tests/test_gate_profile.py fails when the catalogue
changed without `--update`, and reruns each variant's killer from the stored profile (it must still kill).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mpt_kv import package_data
from mpt_kv.errors import ProfileError  # defined with every exception mpt-kv raises (issue 48)

PROFILE_FILE = package_data.GATE_PROFILE
PROFILES = ("full", "gate")  # the names users pass (--mpt-kv-profile, ini mpt_kv_profile); full is the default
RULE = ("greedy set cover over (variant killed by case) and (required coverage met by case), ties to the lower stored "
        "cost then the registry's order; "
        "redundant cases dropped in decreasing cost; every chosen case passes every must-pass design "
        "(mpt_kv/catalogue/gate_profile.py)")
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}  # the case ids' dtype names


@dataclass(frozen=True, order=True)
class GateCase:
    """One conformance case of the profile: a check id of the registry and a dtype name (fp32, bf16)."""

    check: str
    dtype: str

    def __str__(self) -> str:
        return f"{self.check} [{self.dtype}]"


# --- what the profile is computed from --------------------------------------------------------------


def candidates() -> list[str]:
    """The MPT check ids of the registry, in its order (the family checks are not candidates: module doc)."""
    from mpt_kv.checks.registry import CHECKS, is_family

    return [c.id for c in CHECKS.values() if not is_family(c)]


VALUE_OPERATIONS = ("extend", "reorder")  # a value check after each, on every path (module doc: required coverage)


def path_label(check) -> str:
    """A check's cache path as the index names them: concat, static, static+bucket ('' uncached)."""
    return "static+bucket" if check.bucket else (check.path or "")


def operations_run(prop) -> tuple[str, ...]:
    """The cache operations a property's cases run besides prefill and decode: a program check's are its
    fixed programs' (every program check runs them: `mpt_kv.checks.programs.fixed_programs`), an
    operation check's its own (`Property.operations`); the other properties run none."""
    if prop.runs == "program":
        from mpt_kv.checks.programs import FIXED

        return tuple(sorted({op.kind for p in FIXED.values() for op in p.ops} - {"decode"}))
    return prop.operations


def requirements() -> dict[str, tuple[str, ...]]:
    """The required coverage (module doc, step 2), each with the candidate check ids that meet it, in the
    registry's order: a case of every column the catalogue's variants name as killers (`Variant.killed_by`),
    and a value check (a property with an oracle: it compares logits) after each of VALUE_OPERATIONS on
    every cache path of the index (`index.ALL_PATHS`, the bucketed static path included)."""
    from mpt_kv.catalogue.variants import VARIANTS
    from mpt_kv.checks import index
    from mpt_kv.checks.registry import CHECKS

    ids = candidates()
    prop = {i: index.by_name(CHECKS[i].property) for i in ids}
    named = {column for v in VARIANTS.values() for column in v.killed_by}
    out = {f"a case of column {column}": tuple(i for i in ids if prop[i].column == column)
           for column in index.COLUMNS if column in named}
    for path in index.ALL_PATHS:
        for op in VALUE_OPERATIONS:
            out[f"a value check after {op} on {path}"] = tuple(
                i for i in ids if prop[i].oracle and op in operations_run(prop[i]) and path_label(CHECKS[i]) == path)
    return out


def fingerprint() -> str:
    """sha256 of what the stored profile is computed from (module doc); a change of any makes it stale."""
    from hypothesis import settings

    from mpt_kv.catalogue import killmatrix
    from mpt_kv.checks import strategies  # noqa: F401  registers the ci profile

    h = hashlib.sha256()
    for path in package_data.CATALOGUE_SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(json.dumps([[mc.case.describe(), mc.bucket, list(mc.columns)] for mc in killmatrix.CASES]).encode())
    h.update(json.dumps(candidates()).encode())
    h.update(json.dumps(requirements()).encode())
    h.update(str(settings.get_profile("ci").max_examples).encode())
    return h.hexdigest()


# --- the rule ---------------------------------------------------------------------------------------


def cover(kills: dict[str, set[GateCase]], cost: dict[GateCase, float], order: list[GateCase],
          excluded: set[GateCase] = frozenset()) -> list[GateCase]:
    """The greedy set cover of the module doc (step 2): `kills` maps each variant to the cases that kill
    it (and each requirement to the cases that meet it); `cost` each case's stored seconds; `order` the
    registry's order. What no case covers is left out (the caller lists the variants as waiting, the
    requirements as given up). Deterministic: the same data gives the same cases."""
    rank = {c: i for i, c in enumerate(order)}
    killed_by_case: dict[GateCase, set[str]] = {}
    for variant, cases in kills.items():
        for c in cases:
            if c not in excluded:
                killed_by_case.setdefault(c, set()).add(variant)
    left = {v for v, cases in kills.items() if any(c not in excluded for c in cases)}
    chosen: list[GateCase] = []
    while left:
        best = min(killed_by_case, key=lambda c: (-len(killed_by_case[c] & left), cost.get(c, 0.0),
                                                  rank.get(c, len(rank)), c))
        chosen.append(best)
        left -= killed_by_case[best]
    for c in sorted(chosen, key=lambda c: (-cost.get(c, 0.0), -rank.get(c, len(rank)))):
        others = set().union(*(killed_by_case[o] for o in chosen if o != c))
        if killed_by_case[c] <= others:
            chosen.remove(c)
    return sorted(chosen, key=lambda c: rank.get(c, len(rank)))


def drawn(check_id: str) -> bool:
    """Whether a check's cases are drawn by hypothesis (not one fixed case): its draws, although
    derandomized under `ci`, can differ between processes (hypothesis also draws constants it finds in
    the modules loaded), so a kill by a drawn case is the weaker evidence."""
    from mpt_kv.checks import index
    from mpt_kv.checks.registry import CHECKS

    check = CHECKS[check_id]
    return index.by_name(check.property).runs in ("case", "program") and not check.edge and not check.graphs


def killer_of(variant_kills: set[GateCase], chosen: list[GateCase], cost: dict[GateCase, float]) -> GateCase:
    """The chosen case tests/test_gate_profile.py reruns for a variant: a fixed case before a drawn one,
    then the cheapest."""
    return min((c for c in chosen if c in variant_kills), key=lambda c: (drawn(c.check), cost.get(c, 0.0), c))


# --- the stored profile -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredProfile:
    cases: tuple[GateCase, ...]
    fingerprint: str
    killers: dict          # variant -> GateCase (its cheapest killer among the cases)
    waiting: tuple[str, ...]
    data: dict             # the whole file

    def selects(self, check: str, dtype: str) -> bool:
        return GateCase(check, dtype) in self.cases

    def _lists(self, field: str) -> dict[GateCase, tuple[str, ...]]:
        return {GateCase(c["check"], c["dtype"]): tuple(c.get(field, ())) for c in self.data.get("cases", ())}

    def unkilled(self, kept) -> list[str]:
        """The variants the profile kills that no case of `kept` is known to kill (its cases' kill data)."""
        kills = self._lists("kills")
        return sorted(v for v in self.killers if not any(v in kills.get(c, ()) for c in kept))

    def unmet(self, kept) -> list[str]:
        """The required coverage the profile meets that no case of `kept` meets."""
        meets = self._lists("meets")
        return [r for r in dict.fromkeys(r for c in self.cases for r in meets.get(c, ()))
                if not any(r in meets.get(c, ()) for c in kept)]


UPDATE = "python -m mpt_kv gateprofile --update"


def digests(data: dict) -> dict[str, str]:
    """A sha256 (16 hex digits) of each part of a profile file but the digests themselves: written with them."""
    return {key: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
            for key, value in data.items() if key != "digests"}


def edited_parts(data: dict) -> list[str]:
    """The parts of a profile file whose content differs from the digest written with it (removed and added
    parts too), each with its size where it is a list or a map: `cases (1 now)`."""
    stored, now = data.get("digests") or {}, digests(data)
    out = []
    for key in dict.fromkeys([*stored, *now]):
        if key not in now:
            out.append(f"{key} (removed)")
        elif key not in stored:
            out.append(f"{key} (added)")
        elif stored[key] != now[key]:
            size = f" ({len(data[key])} now)" if isinstance(data[key], (list, dict)) else ""
            out.append(f"{key}{size}")
    return out


def load(path: Path | str | None = None) -> StoredProfile:
    """The stored profile (default: the package's file); ProfileError naming the file and the problem: missing,
    malformed, or edited since `--update` wrote it (its parts' digests)."""
    path = PROFILE_FILE if path is None else path
    try:
        data = json.loads(Path(path).read_text())
        cases = tuple(GateCase(c["check"], c["dtype"]) for c in data["cases"])
        killers = {v: GateCase(*k) for v, k in data["killers"].items()}
        profile = StoredProfile(cases, data["fingerprint"], killers, tuple(data.get("waiting", ())), data)
        if not isinstance(data.get("digests"), dict):
            raise ProfileError(f"the gate profile {path} has no digests of its parts: it was not written by "
                               f"`{UPDATE}` (or was edited since): run it")
    except FileNotFoundError:
        raise ProfileError(f"the gate profile {path} is missing: the package is incomplete; a checkout makes it "
                           f"with `{UPDATE}`") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProfileError(f"the gate profile {path} is malformed ({type(e).__name__}: {e}): run `{UPDATE}`") from None
    edited = edited_parts(data)
    if edited:
        raise ProfileError(f"the gate profile {path} was edited after `{UPDATE}` wrote it: its {', '.join(edited)} "
                           "differ from the digests written with them (the profile is the rule's output, not a "
                           f"list to edit; a stale one is brought up to date by `{UPDATE}`)")
    return profile


def stale_reason(profile: StoredProfile) -> str | None:
    """Why the stored profile does not match the installed catalogue (None: it does)."""
    problems = []
    now = fingerprint()
    if profile.fingerprint != now:
        problems.append(f"the catalogue, the kill matrix's cases or the check ids changed since it was computed "
                        f"(fingerprint {profile.fingerprint[:12]} stored, {now[:12]} installed)")
    ids = set(candidates())
    gone = [str(c) for c in profile.cases if c.check not in ids]
    if gone:
        problems.append(f"it names check ids the registry lacks: {', '.join(gone)}")
    from mpt_kv.catalogue.variants import VARIANTS

    covered = set(profile.killers) | set(profile.waiting)
    missing = [v for v in VARIANTS if v not in covered]
    if missing:
        problems.append(f"no case of it kills the variants {', '.join(missing)}")
    if not problems:
        return None
    return f"the stored gate profile ({Path(PROFILE_FILE).name}) is stale: " + "; ".join(problems) + f": run `{UPDATE}`"


# --- computing it (python -m mpt_kv gateprofile --update) --------------------------------------------


def _dtype_name(dtype) -> str:
    return DTYPE_NAMES[str(dtype).replace("torch.", "")]


def run_one(check_id: str, build, dtype_name: str) -> tuple[bool, float, str]:
    """(killed, seconds, first line) of one conformance check on one catalogue row, cpu, ci profile."""
    import time

    import torch

    from mpt_kv.checks.registry import CHECKS
    from mpt_kv.errors import Unsupported

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    start = time.perf_counter()
    try:
        CHECKS[check_id](build, "cpu", dtype)
        return False, time.perf_counter() - start, ""
    except Unsupported as e:  # a pytest skip: not a kill, not an Exception
        return False, time.perf_counter() - start, f"unsupported: {e.msg}"
    except Exception as e:  # noqa: BLE001  the kill matrix's crash rule: any exception kills
        return True, time.perf_counter() - start, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def use_data_profile() -> None:
    """The `ci` hypothesis profile (derandomized) without the example database: what the kill data is
    drawn under, in every process that computes it (a database would replay failures of earlier runs)."""
    from hypothesis import settings

    from mpt_kv.checks.profiles import use_profile

    use_profile("ci")
    settings.register_profile("mpt-kv-gate-data", settings.get_profile("ci"), database=None)
    settings.load_profile("mpt-kv-gate-data")


KILLS_PER_VARIANT = 3  # a variant's candidates run, cheapest first, until this many kill it


def _row_kills(job: tuple[str, str, tuple[str, ...], tuple[str, ...]]) -> dict:
    """One variant's kill data (module doc, step 1): its expected killers' check ids, cheapest first,
    until KILLS_PER_VARIANT kill it; none killing it, the other columns' ids the same way."""
    import torch

    from mpt_kv.catalogue.variants import VARIANTS

    name, dtype_name, first, then = job
    torch.set_num_threads(1)
    use_data_profile()
    out = {}
    for ids in (first, then):
        for check_id in ids:
            if sum(cell["killed"] for cell in out.values()) >= KILLS_PER_VARIANT:
                break
            killed, seconds, line = run_one(check_id, VARIANTS[name].build, dtype_name)
            out[check_id] = {"killed": killed, "seconds": round(seconds, 3), "first": line}
        if any(cell["killed"] for cell in out.values()):
            break
    return {"variant": name, "dtype": dtype_name, "cells": out}


def _costs(job: tuple[str, tuple[str, ...]]) -> dict:
    """The reference's seconds for each candidate in a dtype (the cost the rule reads), and whether it passed."""
    import torch

    torch.set_num_threads(1)
    use_data_profile()
    dtype_name, ids = job
    out = {}
    for check_id in ids:
        killed, seconds, line = run_one(check_id, "reference", dtype_name)
        out[check_id] = {"seconds": round(seconds, 2), "failed": line if killed else ""}
    return {"dtype": dtype_name, "cells": out}


def _design_passes(job: tuple[str, tuple[tuple[str, str], ...]]) -> dict:
    import torch

    from mpt_kv.catalogue.killmatrix import must_pass

    torch.set_num_threads(1)
    use_data_profile()
    name, cases = job
    build = must_pass()[name].build
    return {"design": name, "failed": {f"{c}|{d}": line for c, d in cases
                                       for killed, _, line in [run_one(c, build, d)] if killed}}


def _pool_map(fn, jobs: list, processes: int) -> list:
    import multiprocessing

    if processes <= 1:
        return [fn(j) for j in jobs]
    # fork: the catalogue's builds are closures (not picklable), made before the fork; cpu only
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(fn, jobs, chunksize=1)


def given_up_because(cases: set[GateCase], failing_reference: set[str], false_positives: dict[str, list[str]]) -> str:
    """Why the profile gives a requirement up: no candidate meets it, or each that does fails the reference or
    a must-pass design (module doc, step 3)."""
    if not cases:
        return "no check id of the registry meets it"
    why = [f"{c} fails the reference" if c.check in failing_reference else
           f"{c} fails {'; '.join(false_positives.get(f'{c.check}|{c.dtype}', ['a must-pass design']))}"
           for c in sorted(cases)]
    return "every case that meets it fails a must-pass row: " + "; ".join(why)


def compute(processes: int = 1, progress=print) -> dict:
    """The whole profile file (module doc: kill data, cover, must pass), as a dict."""
    import time

    import torch

    from mpt_kv.catalogue import killmatrix
    from mpt_kv.catalogue.variants import VARIANTS
    from mpt_kv.checks import index
    from mpt_kv.checks.registry import CHECKS

    start = time.perf_counter()
    torch.set_num_threads(1)
    use_data_profile()
    ids = candidates()
    progress(f"gateprofile: the reference's cost of {len(ids)} check ids (fp32)")
    costs_rows = _pool_map(_costs, [("fp32", tuple(ids[i::processes])) for i in range(processes)], processes)
    seconds = {i: cell["seconds"] for r in costs_rows for i, cell in r["cells"].items()}
    failing_reference = {i for r in costs_rows for i, cell in r["cells"].items() if cell["failed"]}
    cheapest = sorted(ids, key=lambda i: (seconds[i], ids.index(i)))
    jobs = []
    for v in VARIANTS.values():
        expected = {p.name for col in v.killed_by for p in index.of_column(col)}
        first = tuple(i for i in cheapest if CHECKS[i].property in expected)
        jobs.append((v.name, _dtype_name(v.dtype or torch.float32), first, tuple(i for i in cheapest if i not in first)))
    progress(f"gateprofile: {len(jobs)} variants, their expected killers' check ids cheapest first, until "
             f"{KILLS_PER_VARIANT} kill each ({time.perf_counter() - start:.0f} s)")
    rows = _pool_map(_row_kills, jobs, processes)
    dtypes = sorted({r["dtype"] for r in rows}, key=["fp32", "bf16"].index)
    cost = {GateCase(i, d): seconds[i] for d in dtypes for i in ids}  # a bf16 case costs as its fp32 run
    excluded = {GateCase(i, d) for d in dtypes for i in failing_reference}
    kills = {r["variant"]: {GateCase(i, r["dtype"]) for i, cell in r["cells"].items() if cell["killed"]} for r in rows}
    order = [GateCase(i, d) for d in dtypes for i in ids]
    order.sort(key=lambda c: (ids.index(c.check), dtypes.index(c.dtype)))
    required = {r: {GateCase(i, d) for i in meeting for d in dtypes} for r, meeting in requirements().items()}
    designs = [n for n in killmatrix.must_pass() if n != "reference"]
    false_positives: dict[str, list[str]] = {}
    while True:
        chosen = cover({**kills, **required}, cost, order, excluded)
        progress(f"gateprofile: {len(chosen)} cases chosen; checking {len(designs)} designs pass them "
                 f"({time.perf_counter() - start:.0f} s)")
        results = _pool_map(_design_passes, [(n, tuple((c.check, c.dtype) for c in chosen)) for n in designs],
                            processes)
        failing = {key: f"{r['design']}: {line}" for r in results for key, line in r["failed"].items()}
        if not failing:
            break
        for key, why in failing.items():
            check, dtype = key.split("|")
            excluded.add(GateCase(check, dtype))
            false_positives.setdefault(key, []).append(why)
    waiting = sorted(v for v, cases in kills.items() if not (cases - excluded))
    killers = {v: killer_of(kills[v], chosen, cost) for v in kills if v not in waiting}
    gives_up = {r: given_up_because(cases, failing_reference, false_positives) for r, cases in required.items()
                if not (cases - excluded)}
    return {
        "about": "the gate profile (mpt_kv/catalogue/gate_profile.py); made by `" + UPDATE + "`, do not edit",
        "rule": RULE,
        "fingerprint": fingerprint(),
        "hypothesis_profile": "ci",
        "cases": [{"check": c.check, "dtype": c.dtype, "kills": sorted(v for v in kills if c in kills[v]),
                   "meets": [r for r in required if c in required[r]], "reference_seconds": cost.get(c)}
                  for c in chosen],
        "killers": {v: [c.check, c.dtype] for v, c in sorted(killers.items())},
        "waiting": waiting,
        "required": {r: next([c.check, c.dtype] for c in chosen if c in cases)
                     for r, cases in required.items() if r not in gives_up},
        "gives_up": gives_up,
        "excluded_false_positives": {k: v for k, v in sorted(false_positives.items())},
        "candidates": len(order),
        "reference_seconds": {"gate": round(sum(cost.get(c, 0.0) for c in chosen), 2),
                              "all candidates": round(sum(cost.values()), 2)},
        "kill_data": {r["variant"]: {"dtype": r["dtype"],
                                     "killed_by": [i for i, cell in r["cells"].items() if cell["killed"]],
                                     "ran": len(r["cells"])} for r in rows},
        "reference_cost_fp32": seconds,
        "seconds": round(time.perf_counter() - start, 1),
    }


def write(data: dict, path: Path | str) -> None:
    # the seconds of this computation change from run to run: kept out of the file (its diff is the profile's)
    data = {k: v for k, v in data.items() if k not in ("seconds", "digests")}
    data["digests"] = digests(data)
    Path(path).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
