"""The run layer: everything that runs a check, written once.

A check (`mpt_kv.checks.registry.Check`: its property, path, bucket and fixed case) runs here:

    run(check, target, device, dtype)             every case of the check: notes, or it raises
    run_one(check, target, device, dtype, case)   one case (a `Case`; a `Program` for ops-*)

`run` resolves the target once (`ResolvedTarget`) and makes a `Run`: the check on that target,
device and dtype. A Run reads what the target declares (`Capabilities`), refuses what it lacks
(`Unsupported`, with the target's reason) and builds every runner the check needs from the resolved
target, with the oracles its property compares with (`Run.context`); nothing else builds one. How
the check's cases come is its property's `runs` in the index (`mpt_kv.checks.index`), one driver
each (`DRIVERS`):

    case       hypothesis's drawn cases, or the check's fixed edge case, or its run under graphs
    fixed      one fixed case (static-shape)
    memory     one memory config (`mpt_kv.checks.ceilings.CONFIGS`), its stored ceilings compared
    program    the fixed beam and speculative programs, then hypothesis's drawn ones (ops-P1/P2/P3)
    operation  one reorder, extend or crop on a filled cache, measured exactly (ops-memory,
               ops-retained, cpu), on the fixed case and the corner (`programs.MEMORY_CASES`)
    family     one family target (`mpt_kv.targets.FamilyTarget`: an implementation of a variant of
               another decoder family) on one path, on the run's device and dtype (family-P0 ...
               family-memory)

The property's function, named in the index, checks one case: `fn(runner, c)`, where `c` is a
`mpt_kv.checks.cases.Context` (a family check's: a `mpt_kv.checks.family_driver.FamilyContext`, its
runner the implementation's, built once per process by `family_driver.runner_for`). The rules every
check shares are here: the one hypothesis driver
(`drive`: mpt-kv's profile, shrinking, the example database's key), the fp32-twin rule
(`oracles`: a lower precision is compared with the same target in float32 from the rounded
weights, the reference where the target declares no float32) and what a run under pytest plugs in
(`RunContext`: where checks record, the project's stored ceilings, whether a failure is expected).
The crash rule, which the property functions apply as they drive a target, is
`mpt_kv.checks.compare.crash_of`, for the MPT and the family checks alike.

A property's function is imported by its dotted name when it first runs: the index names it
without importing torch (the pytest plugin reads the index before a worker's card is pinned).

Each property drives its own generation on a case, on purpose: P1 compares every path with the
target's own uncached forward on that path's greedy tokens; P2 feeds the concat path's tokens to both
paths, poisoning never-written static slots first; P3 holds every Wqkv output alive until it is
compared (a freed view's address could be reused), which changes what memory measures; P4 interleaves
two uncached forwards of one shape with the generation to see a reused output buffer; memory needs a
quiet allocator (nothing else alive) and three generations for a leak; the ops checks run their own
programs. Measured (docs/cost.md): P3 and P4, the drives P1's could carry, are 8% of a conformance
run's call time; sharing them would couple three verdicts to one drive for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from hypothesis import Phase, given, settings

from mpt_kv.checks import evidence, family_driver, index, profiles, programs, reach
from mpt_kv.checks.cases import Case, Context, fp32_twin, reference_oracle
from mpt_kv.checks.graphs import graphed
from mpt_kv.checks.profiles import SHRINKING_PROFILES
from mpt_kv.checks.strategies import GRAPH_CASE, STATIC_SHAPE_CASE, cases, edge_cases
from mpt_kv.devices import as_device
from mpt_kv.errors import TargetUnavailable, Unsupported, independently
from mpt_kv.model.config import as_dtype, random_state_dict
from mpt_kv.targets import (Capabilities, FamilyDeclaration, FamilyTarget, ResolvedTarget, Runner, Target,
                            family_target, required_features, resolve_mpt)

# --- what a run under pytest plugs in -------------------------------------------------------------------------


@dataclass(frozen=True)
class RunContext:
    """What the pytest plugin gives a check while a test runs: where to record measurements and
    notes (they travel to the report), the project's stored ceilings, and whether a failure is
    expected (an xfail only has to fail: hypothesis then skips shrinking, which can take long)."""

    record: Callable[[str, object], None]
    ceilings: object | None = None  # mpt_kv.checks.ceilings.StoredCeilings
    expected_to_fail: bool = False


_context: ContextVar[RunContext | None] = ContextVar("mpt_kv_run_context", default=None)


@contextlib.contextmanager
def running(context: RunContext):
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def current() -> RunContext | None:
    return _context.get()


def record(name: str, value) -> None:
    ctx = _context.get()
    if ctx is not None:
        ctx.record(name, value)


@contextlib.contextmanager
def one_thread(device: torch.device):
    """The checks' models are tiny: on CPU a second intra-op thread only contends (measured 3-30x
    slower on a loaded 2-core machine, where pytest -n 2 already runs one worker per core)."""
    if device.type != "cpu":
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


# --- the one hypothesis driver ------------------------------------------------------------------------------

def hypothesis_profile():
    """(settings, name) of mpt-kv's hypothesis profile (dev; ci under CI=true;
    MPT_KV_HYPOTHESIS_PROFILE): `mpt_kv.checks.profiles`, loaded once per process (under pytest the
    plugin loads it)."""
    return settings.default, profiles.current()


def drive(key: str, strategy, one: Callable, argname: str = "case", fraction: int = 1) -> None:
    """Run `one(example)` on hypothesis's examples of `strategy` under mpt-kv's profile (`fraction`:
    a share of its examples, at least 2), the first failure only, never shrunk for an expected
    failure; `key` names the example database's entry (check, target, device, dtype)."""
    test = given(**{argname: strategy})(lambda **kw: one(kw[argname]))
    test.__name__ = f"one_{argname}"  # hypothesis prints "Falsifying example: one_case(case=...)"
    profile, name = hypothesis_profile()
    ctx = _context.get()
    shrink = name in SHRINKING_PROFILES and not (ctx and ctx.expected_to_fail)
    phases = [p for p in profile.phases if p != Phase.shrink or shrink]
    # the first (shrunk) failure only: a group of several would not read as a PropertyFailure
    test = settings(profile, max_examples=max(2, profile.max_examples // fraction), report_multiple_bugs=False,
                    print_blob=False, phases=phases)(test)
    test.hypothesis.inner_test._hypothesis_internal_add_digest = key.encode()
    test()


# --- one check on one target, device and dtype -------------------------------------------------------------


def function_of(prop: index.Property) -> Callable:
    """The property's function, by its dotted name in the index."""
    module, name = prop.function.split(":")
    return getattr(importlib.import_module(module), name)


def oracles(target: ResolvedTarget, caps: Capabilities, cfg, seed: int, device, dtype: torch.dtype,
            oracle: str | None) -> dict:
    """What a property compares with in `dtype` (the index's `Property.oracle`), as Context fields:
    "reference" (P0) the reference in float32 from the weights rounded to `dtype`; "twin" (P1, P2,
    ops-P1, ops-P2) the fp32-twin rule (`cases.fp32_twin`: in a lower precision, the same target in
    float32 from the rounded weights)."""
    if oracle == "reference":
        return {"reference": reference_oracle(cfg, random_state_dict(cfg, seed=seed), device, dtype)}
    if oracle == "twin" and dtype != torch.float32:
        return {"fp32": fp32_twin(target, cfg, random_state_dict(cfg, seed=seed), device, dtype, caps)}
    return {}


@dataclass
class Run:
    """A check on one resolved target, device and dtype (module doc)."""

    check: object  # mpt_kv.checks.registry.Check
    target: ResolvedTarget
    device: torch.device
    dtype: torch.dtype
    ceilings: object | None = None

    def __post_init__(self):
        self.prop = index.by_name(self.check.property)
        # a family target's implementation declares its capabilities on each runner (the family checks read them)
        self.caps = Capabilities() if self.on_family else self.target.capabilities(self.device, self.dtype)

    @property
    def on_family(self) -> bool:
        """A family target (a family check's, or a generate check's on a family target)."""
        return isinstance(self.target, FamilyTarget)

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def key(self) -> str:
        return f"{self.check.id}|{self.name}|{self.device}|{self.dtype}"

    def require(self, features: Iterable[str | None]) -> None:
        """Unsupported, with the target's own reason, if it declares one of `features` unsupported."""
        for feature in features:
            reason = self.caps.reason(feature)
            if reason:
                raise Unsupported(f"{self.name}: {reason}")

    def features(self, case: Case | None = None, operations=()) -> list[str]:
        clip = case.cfg.clip_qkv if case is not None else None
        return required_features(self.check.path, self.check.bucket, self.dtype, self.device, clip, operations)

    def runner(self, case: Case, features=()) -> Runner:
        """The target's runner for `case`'s model, with the case's seeded weights (the reference's)."""
        self.require(features)
        runner = self.target.build(case.cfg, random_state_dict(case.cfg, seed=case.seed), self.device, self.dtype)
        runner.require(*features)
        return runner

    def context(self, case: Case, **inputs) -> Context:
        """The Context of one case, with the oracles the property compares with (`oracles`)."""
        ctx = _context.get()
        stored = self.ceilings if self.ceilings is not None else (ctx.ceilings if ctx else None)
        return Context(self.name, self.device.type, self.dtype, case, self.check.path, self.check.bucket,
                       ceilings=stored, record=record, **inputs,
                       **oracles(self.target, self.caps, case.cfg, case.seed, self.device, self.dtype, self.prop.oracle))

    def family_case(self, check: str) -> tuple[Runner, family_driver.FamilyContext]:
        """A family check's runner and context: the family target's implementation of its variant on
        this path (`family_driver.runner_for`: built once per process for a named implementation and
        this Family object) and what the check reads (`family_driver.context_of`); `check` names the
        check in a failed call's message."""
        t = self.target
        c = family_driver.context_of(t.implementation, t.family, t.variant, self.check.path, self.dtype, check,
                                     self.device, attention=t.attention)
        return family_driver.runner_for(t.implementation, c.family, c.variant, c.dtype, c.options, c.device), c

    def check_case(self, runner, c) -> list[str]:
        """The property's function on one case: `fn(runner, c)`, its notes (or the context's)."""
        return list(function_of(self.prop)(runner, c) or c.notes)

    def without_clip(self, case: Case) -> Case:
        """A fixed case without clip_qkv where the target declares it unsupported: the property
        does not need it, so it still runs (a drawn case never draws it, `strategies.cases`)."""
        if self.caps.reason("clip_qkv") and case.cfg.clip_qkv is not None:
            case = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, clip_qkv=None))
        return case


def run(check, target: Target, device="cpu", dtype=torch.float32, ceilings=None) -> list[str]:
    """Every case of `check` on `target` (module doc): its notes, recorded for the report."""
    # a spec string, a factory or already resolved; for a family check, a FamilyTarget or its spec
    target = resolved_for(check, target)
    device, dtype = as_device(device), as_dtype(dtype)
    with one_thread(device):
        r = Run(check, target, device, dtype, ceilings)
        if r.caps.unsupported:
            record("mpt_kv_capabilities", {"target": r.name, "unsupported": dict(r.caps.unsupported)})
        r.require(r.features())
        notes = DRIVERS[r.prop.runs](r)
        if r.prop.cache and r.check.path:  # a cache property passed: what shows the target has a cache
            record("mpt_kv_cache", evidence.cache_evidence(r))
    for note in dict.fromkeys(notes):
        record("mpt_kv_note", note)
    return notes


def resolved_for(check, target: Target):
    """The target a check runs on, resolved once: a family check's FamilyTarget (or its spec); a generate
    check's either kind (a FamilyTarget, a family declaration or an "<implementation>/<family>/<variant>"
    spec is a family target; anything else an MPT target); every other check's MPT target."""
    runs = index.by_name(check.property).runs
    if runs == "family":
        return family_target(target)
    if runs == "generate" and (isinstance(target, (FamilyTarget, FamilyDeclaration))
                               or (isinstance(target, str) and target.count("/") == 2)):
        return family_target(target)
    return resolve_mpt(target)


def run_one(check, target: Target, device, dtype, case) -> list[str]:
    """One case of `check` (no hypothesis): to reproduce a failure, or for fixed cases. `case` is a
    `Case`, or for the program checks a `programs.Program` (hypothesis prints either)."""
    r = Run(check, resolve_mpt(target), as_device(device), as_dtype(dtype))
    if r.prop.runs == "program":
        return one_program(r, case, programs.Fed())
    if r.prop.runs not in ("case", "fixed"):
        raise ValueError(f"{check.id}: run_one takes one case of a check whose cases are drawn or fixed; "
                         f"{r.prop.runs} checks run their own fixed case")
    return one_case(r, case)


# --- the drivers: how each kind of check's cases come ---------------------------------------------------------


def one_case(r: Run, case: Case) -> list[str]:
    features = r.features(case)
    r.require(features)
    runner = r.runner(case, features)
    record("mpt_kv_reach", {"check": r.check.id,
                            "knobs": reach.knobs(case, r.check.path, r.check.bucket, r.device, r.dtype)})
    if r.check.graphs:
        runner = graphed(runner, r.device.type)
    return r.check_case(runner, r.context(case))


def by_case(r: Run) -> list[str]:
    """Drawn cases; or the check's fixed edge case; or its run under graphs."""
    if r.check.edge:
        return one_case(r, r.without_clip(edge_cases(r.device.type)[r.check.edge]))
    if r.check.graphs:
        case = edge_cases("hpu")["bucket-128"] if r.device.type == "hpu" else GRAPH_CASE
        notes = one_case(r, r.without_clip(case))
        if r.prop.name == "P4" and r.device.type == "cpu" and not any("as declared" in n for n in notes):
            raise RuntimeError(f"{r.check.id}: the CPU stand-in for graphs (graphs.StaticOutputs) reused no "
                               f"output buffer, so this check checked nothing: {notes}")
        return notes
    notes: list[str] = []
    strategy = cases(r.device.type, dtype=r.dtype, capabilities=r.caps, prop=r.prop.name)
    drive(r.key, strategy, lambda case: notes.extend(one_case(r, case)))
    return notes


def by_fixed_case(r: Run) -> list[str]:
    return one_case(r, r.without_clip(STATIC_SHAPE_CASE))


def by_memory_config(r: Run) -> list[str]:
    case = r.check.config.case()
    runner = r.runner(case)
    record("mpt_kv_reach", {"check": r.check.id,
                            "knobs": reach.knobs(case, r.check.path, r.check.bucket, r.device, r.dtype)})
    return r.check_case(runner, r.context(case))


def allowed_operations(r: Run) -> set[str]:
    """The operations the target implements; Unsupported (its reasons) when it implements none."""
    allowed = {op for op in programs.OPERATIONS if r.caps.reason(op) is None}
    if not allowed:
        raise Unsupported(f"{r.name}: " + "; ".join(f"{op}: {r.caps.reason(op)}" for op in programs.OPERATIONS))
    return allowed


def one_program(r: Run, program, fed) -> list[str]:
    """One program on a fresh runner of the target."""
    case = program.case
    features = r.features(case)
    r.require(features)
    runner = r.runner(case, features)
    for knobs in program_knobs(program, r.check.path, r.check.bucket, r.device, r.dtype):
        record("mpt_kv_reach", {"check": r.check.id, "knobs": knobs})
    return r.check_case(runner, r.context(case, program=program, fed=fed))


def program_knobs(program, path, bucket, device, dtype) -> list[dict]:
    """A program's reach: its case's knobs (batch, heads, padding, lengths, ...), then each cached
    operation's kind and tokens per cached call."""
    out = [reach.knobs(program.case, path, bucket, device, dtype)]
    out += [{"tokens_per_call": op.k if op.kind == "extend" else 1, "operation": op.kind}
            for op in program.ops if op.kind != "decode"]
    return out


def by_program(r: Run) -> list[str]:
    """The fixed beam and speculative programs (each on a fresh runner, each run whatever the other did: two
    failing are `Failures`), then hypothesis's drawn ones (a third of the profile's examples: each program is
    several cached calls, each checked; ci: 2 drawn + 2 fixed per check). Notes: the distinct input shapes fed to the target, and the operations it
    declares unsupported (not drawn; its other operations ran)."""
    allowed = allowed_operations(r)
    fed, notes = programs.Fed(), []
    # each on a fresh runner: a failing program hides none of the others; the drawn programs mix the same
    # operations: drawn once the fixed ones hold
    independently(functools.partial(lambda p: notes.extend(one_program(r, p, fed)), program)
                  for program in programs.fixed_programs(r.device.type, allowed))
    strategy = programs.programs(r.device.type, allowed, r.dtype, r.caps)
    drive(r.key, strategy, lambda program: notes.extend(one_program(r, program, fed)), "program", fraction=3)
    missing = [f"{op} ({r.caps.reason(op)})" for op in programs.OPERATIONS if op not in allowed]
    if missing:
        notes.append(f"{r.check.id}: {r.name} declares unsupported: {', '.join(missing)}: not drawn, its other "
                     "operations ran")
    notes.append(f"{r.check.id}: shapes fed {r.name} on {r.device.type}: {len(fed.shapes)} distinct input shapes "
                 f"({', '.join(f'{call} {shape}' for call, shape in sorted(fed.shapes))})")
    record("mpt_kv_ops_shapes", {"check": r.check.id, "target": r.name, "device": r.device.type,
                                 "shapes": len(fed.shapes)})
    return notes


def by_operation(r: Run) -> list[str]:
    operation = r.check.operation
    r.require([operation])
    if r.device.type != "cpu":
        raise Unsupported(f"{r.check.id}: the exact transient of one operation is measured on cpu (CpuTracker); "
                          f"{r.device.type}'s allocator rounds per block")
    notes = []
    for case in programs.MEMORY_CASES:  # the fixed case, then the corner (batch 1, one head, one layer, prompt 1)
        runner = r.runner(case, [operation])
        record("mpt_kv_reach", {"check": r.check.id,
                                "knobs": reach.knobs(case, r.check.path, r.check.bucket, r.device, r.dtype)})
        notes += r.check_case(runner, r.context(case, operation=operation))
    return notes


def by_generate(r: Run) -> list[str]:
    """One generate check (its path and mode, `check.operation`) on an MPT target or a family target: the
    implementation's own generate, every forward call observed (`mpt_kv.checks.generate_driver`), cpu,
    float32 (the oracle's greedy tokens are judged, not a lower precision's rounding)."""
    from mpt_kv.checks import generate, generate_driver  # lazy: transformers' generation code

    if r.device.type != "cpu":
        raise Unsupported(f"{r.check.id}: the generate drive runs on cpu (tiny models; the exact reading of what "
                          f"generate leaves allocated is the cpu meter's), not {r.device.type}")
    if r.dtype != torch.float32:
        raise Unsupported(f"{r.check.id}: the generate drive runs in float32 (generate's tokens are judged against "
                          f"the oracle's greedy ones), not {str(r.dtype).replace('torch.', '')}")
    if not r.on_family and r.check.path not in ("concat", "static"):
        raise Unsupported(f"{r.check.id}: optimum-habana's own generate paths (reuse_cache, its recipes' flags) are "
                          f"its ports' (family targets), not {r.name}'s")
    if r.on_family:
        try:
            runner, fc = r.family_case(r.check.id)
        except TargetUnavailable as e:
            raise Unsupported(f"{r.name}: {e}") from e
        runner.require(fc.session_path)
        # the draft: the same implementation's model of the variant with other weights
        subject = generate_driver.family_subject(runner, fc, lambda: draft_runner(r.target.implementation, fc))
    else:
        case = generate_driver.MPT_CASE
        runner = r.runner(case, r.features(case))
        seed = dataclasses.replace(case, seed=case.seed + 1)
        subject = generate_driver.mpt_subject(r.name, runner, case.cfg, lambda: r.runner(seed))
    c = generate.GenerateContext(r.name, r.check.id, r.check.operation, r.check.path, r.dtype, subject, record=record)
    return r.check_case(runner, c)


_drafts: dict = {}


def draft_runner(implementation, fc):
    """A family implementation's runner of the variant with other weights (seed 1): assisted decoding's draft,
    built once per process for a named implementation."""
    from mpt_kv.families.implementations import IMPLEMENTATIONS

    builder = IMPLEMENTATIONS[implementation] if isinstance(implementation, str) else implementation
    key = (builder, id(fc.family), fc.variant, fc.dtype)
    if key not in _drafts:
        _drafts[key] = (fc.family, builder(fc.family, fc.variant, fc.dtype, seed=1))
    return _drafts[key][1]


def by_family(r: Run) -> list[str]:
    """One family check on one family target: the family's tiny model on the run's device and dtype,
    against transformers' model in fp32 on CPU (`family_driver`: the oracle)."""
    try:
        runner, c = r.family_case(r.prop.name)
    except TargetUnavailable as e:  # the implementation has no port of the family here: unsupported, its reason
        raise Unsupported(f"{r.name}: {e}") from e
    # what the case's program reaches of its design's edges, measured as it runs (reach.FamilyReach):
    # recorded whatever the verdict, up to where it stopped
    c.reach = family_driver.reach_of(c)
    try:
        with family_driver.routing_observed(runner, c):
            return r.check_case(runner, c)
    except TargetUnavailable as e:
        raise Unsupported(f"{r.name}: {e}") from e
    finally:
        for knobs in c.reach.records(c.batch):
            record("mpt_kv_reach", {"check": r.check.id, "knobs": knobs})


@dataclass(frozen=True)
class ByProperty:
    """A family check called by its property and path (`call_family`), named as the registry's
    check of that property and path would be."""

    property: str
    path: str
    bucket: None = None

    @property
    def id(self) -> str:
        return f"{self.property}/{self.path}"


def call_family(prop: str, implementation, family, variant: str, path: str, dtype=torch.float32,
                device="cpu", attention: str | None = None) -> list[str]:
    """One family check called by property (`mpt_kv.checks.family.CHECKS`): the runner, context and
    function `run` uses for a FamilyTarget, without the report's records and on any path the caller
    names (its check says what it takes); a builder's TargetUnavailable is raised as is.
    attention: transformers' attention implementation (`FamilyTarget.attention`)."""
    device = as_device(device)
    r = Run(ByProperty(prop, path), FamilyTarget(implementation, family, variant, attention=attention), device,
            as_dtype(dtype))
    return r.check_case(*r.family_case(prop))


DRIVERS: dict[str, Callable[[Run], list[str]]] = {
    "case": by_case, "fixed": by_fixed_case, "memory": by_memory_config, "program": by_program,
    "operation": by_operation, "family": by_family, "generate": by_generate,
}
