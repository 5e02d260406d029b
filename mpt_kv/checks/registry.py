"""Every conformance check as a plain function with a stable id, for pytest and for anyone.

    import torch
    from mpt_kv.checks.registry import CHECKS

    notes = CHECKS["P1/static"](build, "cpu", torch.float32)

A check takes a target (a factory `build(cfg, state_dict, device, dtype) -> Runner`, or its spec
string such as "reference" or "package.module:build"), a device and a dtype. It first reads the
target's `Capabilities` from a tiny runner: a check that needs a feature the target declares
unsupported raises `Unsupported` with the target's reason, and hypothesis does not draw a feature
the target lacks (clip_qkv), so the cases that do not need it still run. It returns notes for
the report (near-ties in greedy decoding) and raises:

    PropertyFailure  the property does not hold; the message names target, device, dtype, case,
                     step and layer
    Unsupported      the check needs a feature the target does not implement (a pytest skip)
    anything else    the target or its adapter broke (a TypeError from a wrong signature, a
                     BaselineError from a corrupt ceilings file): an error, never a property failure

Ids: "P0", "P1/<path>", "P2/<path>", "P3/<path>", "P4/<path>", "static-shape/<path>",
"memory/<path>/<config>"; <path> is concat, static or static+bucket<N>. Fixed edge cases (long
sequences to max_seq_len 2048, head dim 128, prompts around the 128 bucket; strategies.EDGE_CASES)
have their own ids, "P0/<edge>", "P1/<path>/<edge>", "P2/static/<edge>", "P3/<path>/<edge>" (strategies.P3_EDGES), and P1, P2 and P4 also run
under graphs, "P1/static/graphs" (graphs.py: HPU graphs, CUDA graphs, or on CPU a stand-in that
returns one buffer per output shape). The shipped tests (mpt_kv/conformance) and a
project's own tests (`parametrize_with_checks`) run these same functions. The drawn checks (P0-P4)
run hypothesis under mpt-kv's profile (a failure is shrunk to a minimal case locally, not under
CI=true: see SHRINKING_PROFILES); `check.run_case(target, device, dtype, case)` runs one `Case`
(a failure's "Failing test case" prints it) without hypothesis.

The memory checks always check the analytic properties; the stored ceilings are compared where a
`StoredCeilings` is given (the pytest plugin gives the project's, see docs/targets.md).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from mpt_kv.checks import ceilings as C
from mpt_kv.checks import properties as P
from mpt_kv.checks import reach, static_shape
from mpt_kv.checks.compare import Finding, PropertyFailure
from mpt_kv.checks.graphs import graphed
from mpt_kv.checks.properties import Case, Context
from mpt_kv.checks.strategies import EDGE_CASES, P3_EDGES, edge_cases
from mpt_kv.errors import UnknownName, Unsupported
from mpt_kv.devices import as_device
from mpt_kv.model.config import DTYPES, ModelConfig, as_dtype, random_state_dict  # noqa: F401  (as_dtype: its home was here)
from mpt_kv.targets import Capabilities, ResolvedTarget, Runner, Target, required_features, resolve_target, target_name

PROPERTIES = ("P0", "P1", "P2", "P3", "P4", "static-shape", "memory", "ops-P1", "ops-P2", "ops-P3", "ops-memory")
BUCKET = 4          # P1-P3 and static-shape: with 5 + 6 tokens, bucketed decode crosses a boundary
MEMORY_BUCKET = 8   # the memory configs' bucket (mpt_kv.checks.ceilings.CONFIGS)
# 3 heads, clip_qkv, a left-padded row, 6 decode steps (bucket 4 crosses a boundary)
STATIC_SHAPE_CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32, clip_qkv=4.0),
                         (5, 3), 6, seed=3)
# under graphs on CPU and CUDA: 3 heads, two layers, a bool mask, 6 decode steps (HPU: the
# bucket-128 edge case, the shapes its graphs are compiled for)
GRAPH_CASE = Case(ModelConfig(d_model=24, n_heads=3, n_layers=2, vocab_size=64, max_seq_len=32), (5, 3), 6, seed=3,
                  mask_dtype=torch.bool)


def path_label(path: str | None, bucket: int | None) -> str:
    return (path or "") + ("" if bucket is None else f"+bucket{bucket}")


# --- what a run under pytest plugs in ---------------------------------------------------------------------

@dataclass(frozen=True)
class StoredCeilings:
    """Where a project keeps its memory ceilings, and which targets must have them.

    directory  holds ceilings-<device kind>.json (`mpt_kv.checks.ceilings`)
    required   target names whose missing entries fail ("*": every target). Any target that already
               has an entry in the file must have all of its entries, listed here or not
    update     --update-ceilings: measure only; the plugin writes the file at the end of the run
    """

    directory: Path
    required: tuple[str, ...] = ()
    update: bool = False

    def file(self, kind: str) -> Path:
        return C.baseline_path(kind, self.directory)

    def requires(self, target: str) -> bool:
        return "*" in self.required or target in self.required


@dataclass(frozen=True)
class RunContext:
    """What the pytest plugin gives a check while a test runs: where to record measurements and
    notes (they travel to the report), the project's stored ceilings, and whether a failure is
    expected (an xfail only has to fail: hypothesis then skips shrinking, which can take long)."""

    record: Callable[[str, object], None]
    ceilings: StoredCeilings | None = None
    expected_to_fail: bool = False


_context: ContextVar[RunContext | None] = ContextVar("mpt_kv_run_context", default=None)


@contextlib.contextmanager
def running(context: RunContext):
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def record(name: str, value) -> None:
    ctx = _context.get()
    if ctx is not None:
        ctx.record(name, value)


# --- targets ------------------------------------------------------------------------------------------------
# A check resolves its target once, at its entry (`Check.__call__`, `Check.run_case`), into a
# `ResolvedTarget`; everything below takes that object (a spec is resolved where it is given).

def capabilities(target: Target, device, dtype: torch.dtype) -> Capabilities:
    """The target's declared capabilities, read from a tiny runner built once per device and dtype."""
    return resolve_target(target).capabilities(device, dtype)


def require(name: str, caps: Capabilities, features: Iterable[str | None]) -> None:
    """Unsupported, with the target's own reason, if it declares one of `features` unsupported."""
    for feature in features:
        reason = caps.reason(feature)
        if reason:
            raise Unsupported(f"{name}: {reason}")


def runner_for(target: Target, cfg: ModelConfig, seed: int, device, dtype, features: Iterable[str | None]) -> Runner:
    runner = resolve_target(target).build(cfg, random_state_dict(cfg, seed=seed), device, dtype)
    runner.require(*features)
    return runner


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


# --- the checks ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One conformance check: `check(target, device, dtype) -> notes` (module doc)."""

    id: str
    property: str
    path: str | None = None
    bucket: int | None = None
    config: C.MemoryConfig | None = None  # memory checks: the (batch, max input, max new) row
    edge: str | None = None               # a fixed case of strategies.EDGE_CASES instead of drawn ones
    graphs: bool = False                  # the target runs under graphs (graphs.graphed)
    doc: str = ""

    def __str__(self) -> str:
        return self.id

    def features(self, device, dtype) -> list[str]:
        return required_features(self.path, self.bucket, dtype, device)

    def __call__(self, target: Target, device="cpu", dtype=torch.float32, *,
                 ceilings: StoredCeilings | None = None) -> list[str]:
        target = resolve_target(target)  # a spec string, a factory or already resolved
        device, dtype = as_device(device), as_dtype(dtype)
        with one_thread(device):
            return self._call(target, device, dtype, ceilings)

    def _call(self, target: ResolvedTarget, device, dtype, ceilings) -> list[str]:
        name = target.name
        caps = target.capabilities(device, dtype)
        if caps.unsupported:
            record("mpt_kv_capabilities", {"target": name, "unsupported": dict(caps.unsupported)})
        require(name, caps, self.features(device, dtype))
        if self.property == "memory":
            notes = self._memory(target, device, dtype, ceilings)
        elif self.property.startswith("ops-"):  # drawn programs of cache operations (programs.py)
            from mpt_kv.checks import programs

            notes = programs.run_check(self, target, device, dtype, caps)
        elif self.property == "static-shape":
            notes = self.run_case(target, device, dtype, without_clip(STATIC_SHAPE_CASE, caps))
        elif self.edge:
            notes = self.run_case(target, device, dtype, without_clip(edge_cases(device.type)[self.edge], caps))
        elif self.graphs:
            case = edge_cases("hpu")["bucket-128"] if device.type == "hpu" else GRAPH_CASE
            notes = self.run_case(target, device, dtype, without_clip(case, caps))
            if self.property == "P4" and device.type == "cpu" and not any("as declared" in n for n in notes):
                raise RuntimeError(f"{self.id}: the CPU stand-in for graphs (graphs.StaticOutputs) reused no "
                                   f"output buffer, so this check checked nothing: {notes}")
        else:
            notes = self._drawn(target, device, dtype, caps)
        for note in dict.fromkeys(notes):
            record("mpt_kv_note", note)
        return notes

    # P0-P4 and static-shape: one case
    def run_case(self, target: Target, device, dtype, case: Case) -> list[str]:
        """Run this check on one `Case` (no hypothesis): to reproduce a failure, or for fixed cases.

        In bf16 the oracle is float32 from the bf16-rounded weights: P0's reference, and for P1
        and P2 the same target in float32 (its fp32 twin; the reference's where the target
        declares no fp32), so each bf16 path carries one rounding error, not two."""
        target = resolve_target(target)  # public: a spec string, a factory or already resolved
        device, dtype = as_device(device), as_dtype(dtype)
        if self.property.startswith("ops-"):  # `case` is a programs.Program (hypothesis prints it)
            from mpt_kv.checks import programs

            return programs.run_program(self, target, device, dtype, case, programs.Fed())
        features = [*self.features(device, dtype), "clip_qkv" if case.cfg.clip_qkv else None]
        require(target.name, target.capabilities(device, dtype), features)
        runner = runner_for(target, case.cfg, case.seed, device, dtype, features)
        record("mpt_kv_reach", {"check": self.id, "knobs": reach.knobs(case, self.path, self.bucket, device, dtype)})
        if self.graphs:
            runner = graphed(runner, device.type)
        c = Context(target.name, device.type, dtype, case, self.path, self.bucket)
        if self.property in ("P1", "P2") and dtype != torch.float32:
            twin = target if runner.capabilities.reason("fp32") is None else resolve_target("reference")
            c.fp32 = twin.build(case.cfg, P.rounded_state_dict(random_state_dict(case.cfg, seed=case.seed), dtype),
                                device, torch.float32)
        if self.property == "P0":
            sd = random_state_dict(case.cfg, seed=case.seed)
            reference = resolve_target("reference").build(case.cfg, P.rounded_state_dict(sd, dtype), device,
                                                          torch.float32)
            P.check_oracle(runner, reference, c)
        elif self.property == "P1":
            P.check_cached_equals_uncached(runner, c)
        elif self.property == "P2":
            P.check_static_equals_concat(runner, c)
        elif self.property == "P3":
            P.check_no_aliasing(runner, c)
        elif self.property == "P4":
            P.check_outputs_not_reused(runner, c)
        elif self.property == "static-shape":
            static_shape.check_static_shape(runner, c)
        else:
            raise ValueError(f"{self.id}: run_case is for P0-P4 and static-shape; memory checks run their configs")
        return list(c.notes)

    def _drawn(self, target: ResolvedTarget, device, dtype, caps: Capabilities) -> list[str]:
        from hypothesis import Phase, given, settings

        from mpt_kv.checks.strategies import cases

        notes: list[str] = []

        def one_case(case):
            notes.extend(self.run_case(target, device, dtype, case))

        test = given(case=cases(device.type, dtype=dtype, capabilities=caps, prop=self.property))(one_case)
        profile, name = hypothesis_profile()
        ctx = _context.get()
        shrink = name in SHRINKING_PROFILES and not (ctx and ctx.expected_to_fail)
        phases = [p for p in profile.phases if p != Phase.shrink or shrink]
        # the first (shrunk) failure only: a group of several would not read as a PropertyFailure
        test = settings(profile, report_multiple_bugs=False, print_blob=False, phases=phases)(test)
        # one example database entry per check, target, device and dtype (the function is shared)
        test.hypothesis.inner_test._hypothesis_internal_add_digest = \
            f"{self.id}|{target.name}|{device}|{dtype}".encode()
        test()
        return notes

    # memory: one config
    def _memory(self, target: ResolvedTarget, device, dtype, ceilings: StoredCeilings | None) -> list[str]:
        name, config = target.name, self.config
        runner = runner_for(target, config.cfg, 0, device, dtype, ())
        case = config.case()
        record("mpt_kv_reach", {"check": self.id, "knobs": reach.knobs(case, self.path, self.bucket, device, dtype)})
        m = C.measure(runner, case, self.path, device, dtype, self.bucket, target=name)
        # recorded before any check: the report and --update-ceilings see failing cases too
        record("mpt_kv_memory", {**asdict(m), "problems": len(m.problems), "torch": str(torch.__version__)})
        if m.problems:
            raise PropertyFailure("\n".join(m.problems))
        if ceilings is None:
            ctx = _context.get()
            ceilings = ctx.ceilings if ctx is not None else None
        return compare_stored(m, ceilings, self.path)


def without_clip(case: Case, caps: Capabilities) -> Case:
    """A fixed case without clip_qkv where the target declares it unsupported: the property
    does not need it, so it still runs."""
    if caps.reason("clip_qkv") and case.cfg.clip_qkv is not None:
        case = dataclasses.replace(case, cfg=dataclasses.replace(case.cfg, clip_qkv=None))
    return case


def compare_stored(m: C.Measurement, store: StoredCeilings | None, path: str) -> list[str]:
    """Compare a measurement with its stored ceiling (notes: where it could be tighter).

    Fail-closed where a ceiling is expected: a corrupt file always, and a missing entry (or
    file) for a target that `store` requires or that already has entries in the file
    (BaselineError: an error, not a property failure). A target never recorded and not
    required rests on the analytic checks above; the report says how to record it."""
    if store is None or store.update:
        return []
    file = store.file(m.device)
    entries = C.load_baseline(file, m.device) if file.exists() or store.requires(m.target) else {}
    key = C.key_of(m)
    recorded = any(k.split("|", 1)[0].split(" (", 1)[0] == m.target for k in entries)
    if key not in entries and not (recorded or store.requires(m.target)):
        record("mpt_kv_unrecorded", {"target": m.target, "device": m.device, "file": str(file)})
        return []
    failures, notes = C.compare(m, entries, file)
    if key not in entries:
        raise C.BaselineError(failures[0])
    if failures:
        raise PropertyFailure("\n".join(failures) + f" [{m.target}, {m.device}, {m.dtype}, {path}]")
    return notes


# Shrinking reruns a failing check on ever smaller cases: about 20 s of CPU for one failure of
# these tiny models, and on HPU every new shape is a graph compilation. Under the ci profile
# (CI=true) a failure is reported as found: derandomized, so it reproduces, and its message names
# the whole case (`run_case` reruns it). Locally (dev, thorough) hypothesis shrinks it to a
# minimal case. An expected failure (xfail) is never shrunk: it only has to fail.
SHRINKING_PROFILES = ("dev", "thorough")
_profile_name: str | None = None


def hypothesis_profile():
    """(settings, name) of mpt-kv's hypothesis profile (dev; ci under CI=true;
    MPT_KV_HYPOTHESIS_PROFILE), loaded once per process (under pytest the plugin loads it too)."""
    global _profile_name
    from hypothesis import settings

    from mpt_kv.checks.strategies import load_profile

    if _profile_name is None:
        _profile_name = load_profile()
    return settings.default, _profile_name


def _build_registry() -> dict[str, Check]:
    out: list[Check] = []
    paths = (("concat", None), ("static", None), ("static", BUCKET))
    out.append(Check("P0", "P0", doc="uncached logits equal the reference's"))
    for path, bucket in paths:
        out.append(Check(f"P1/{path_label(path, bucket)}", "P1", path, bucket,
                         doc="every prefill and decode step equals a full forward over the same tokens"))
    for path, bucket in paths[1:]:
        out.append(Check(f"P2/{path_label(path, bucket)}", "P2", path, bucket,
                         doc="static and concat agree: logits and cached K/V; never-written slots do not leak"))
    for path, bucket in paths:
        out.append(Check(f"P3/{path_label(path, bucket)}", "P3", path, bucket,
                         doc="no cached K/V shares storage with mixed_qkv or pins bytes beyond itself"))
    for path, bucket in paths:
        out.append(Check(f"P4/{path_label(path, bucket)}", "P4", path, bucket,
                         doc="a tensor a call returned is not modified by later calls (unless declared graph outputs)"))
    for edge in EDGE_CASES:
        out.append(Check(f"P0/{edge}", "P0", edge=edge, doc="P0 on a fixed edge case"))
        for path, bucket in paths:
            out.append(Check(f"P1/{path_label(path, bucket)}/{edge}", "P1", path, bucket, edge=edge,
                             doc="P1 on a fixed edge case"))
        # the static path only: buckets are exercised by the drawn cases
        out.append(Check(f"P2/static/{edge}", "P2", "static", edge=edge, doc="P2 on a fixed edge case"))
        for path, bucket in paths if edge in P3_EDGES else ():  # prompts past 64 and 128 in every run
            out.append(Check(f"P3/{path_label(path, bucket)}/{edge}", "P3", path, bucket, edge=edge,
                             doc="P3 on a fixed edge case"))
    for prop in ("P1", "P2", "P4"):
        out.append(Check(f"{prop}/static/graphs", prop, "static", graphs=True,
                         doc=f"{prop} with the target under HPU or CUDA graphs (on CPU a stand-in: one output "
                             "buffer per shape)"))
    for path, bucket in paths[1:]:
        out.append(Check(f"static-shape/{path_label(path, bucket)}", "static-shape", path, bucket,
                         doc="static decode keeps attention's shapes and scalars, the cache storages never move, "
                             "and no step makes a host sync"))
    for path, bucket in (("concat", None), ("static", None), ("static", MEMORY_BUCKET)):
        for config in C.CONFIGS:
            out.append(Check(f"memory/{path_label(path, bucket)}/{config.id}", "memory", path, bucket, config,
                             doc="retained = KV cache, bounded decode transients, nothing leaks; stored ceilings"))
    # cache operations over drawn programs (programs.py, docs/operations.md)
    for path, bucket in paths:
        out.append(Check(f"ops-P1/{path_label(path, bucket)}", "ops-P1", path, bucket,
                         doc="after every decode, extend, crop and reorder of a drawn program, the logits equal a "
                             "full forward over each row's surviving history"))
    for path, bucket in paths[1:]:
        out.append(Check(f"ops-P2/{path_label(path, bucket)}", "ops-P2", path, bucket,
                         doc="static and concat agree after the same program: logits and K/V at written positions"))
    for path, bucket in paths:
        out.append(Check(f"ops-P3/{path_label(path, bucket)}", "ops-P3", path, bucket,
                         doc="no cached K/V pins storage beyond the cache after a crop or reorder"))
    for path, bucket in (("concat", None), ("static", None), ("static", MEMORY_BUCKET)):
        for operation in ("reorder", "extend"):
            out.append(Check(f"ops-memory/{path_label(path, bucket)}/{operation}", "ops-memory", path, bucket,
                             doc=f"the transient of a {operation} is bounded per layer, not a whole-cache copy"))
    return {c.id: c for c in out}


class CheckRegistry(collections.abc.Mapping):
    """Every check by id, read-only. An unknown id is a KeyError naming the closest ids (a
    property such as "P1" is not an id: its checks are listed)."""

    def __init__(self, checks: dict[str, Check]):
        self._checks = dict(checks)

    def __getitem__(self, check_id: str) -> Check:
        try:
            return self._checks[check_id]
        except (KeyError, TypeError):
            pass
        if check_id in PROPERTIES:
            ids = [c.id for c in self._checks.values() if c.property == check_id]
            hint = f"{check_id!r} is a property, not a check id: its checks are {', '.join(ids[:12])}" + \
                   (f" and {len(ids) - 12} more" if len(ids) > 12 else "") + f" (registry.select({check_id!r}))"
        else:
            close = difflib.get_close_matches(str(check_id), list(self._checks), n=6, cutoff=0.5)
            hint = f"closest ids: {', '.join(close)}" if close else f"properties: {', '.join(PROPERTIES)}"
        raise UnknownName(f"unknown check id {check_id!r}: {hint}; list(mpt_kv.CHECKS) has all {len(self._checks)}")

    def __iter__(self):
        return iter(self._checks)

    def __len__(self) -> int:
        return len(self._checks)

    def __repr__(self) -> str:
        return f"CheckRegistry({len(self)} checks: {', '.join(list(self._checks)[:4])}, ...)"


CHECKS: Mapping[str, Check] = CheckRegistry(_build_registry())


def select(*properties: str) -> list[Check]:
    """The checks of the given properties ("P0", ..., "static-shape", "memory"), or ids; none: all."""
    unknown = [p for p in properties if p not in PROPERTIES and p not in CHECKS]
    if unknown:
        raise ValueError(f"unknown properties or check ids {unknown}: properties {list(PROPERTIES)}, "
                         f"ids {list(CHECKS)}")
    return [c for c in CHECKS.values() if not properties or c.property in properties or c.id in properties]


# --- the Python API for a project's own tests --------------------------------------------------------------

def parametrize_with_checks(targets: Iterable[Target] | None = None, *, checks: Iterable[Check | str] | None = None,
                            expected_failed_checks: Mapping[str, str] | Callable[[Target], Mapping[str, str]] | None = None):
    """A pytest mark that runs every check (or `checks`) on `targets`, in the test it decorates:

        @mpt_kv.parametrize_with_checks([build], expected_failed_checks={"P3/concat": "why"})
        def test_mpt_kv(check, target, device, dtype):
            check(target, device, dtype)

    targets    factories or spec strings; None: the plugin's targets (--target, ini mpt_kv_targets)
    checks     Check objects or ids/properties (default: all of CHECKS)
    expected_failed_checks
               {check id: reason}, or a callable target -> such a dict: a strict xfail that only a
               PropertyFailure of the check's own finding satisfies (any other exception, and a crash
               of the target that the check wraps, fail the case; a pass fails as XPASS)

    `device` and `dtype` come from the mpt-kv plugin: every device kind with its marker (so
    `pytest -m hpu` selects the HPU cases), fp32 and bf16 (`--device`, `--dtype`, ini options).
    Each case's id shows the check id and the target.
    """
    import pytest

    # a bare string would iterate as its characters ("reference" -> targets 'r', 'e', ...): refused for
    # both arguments alike, so a selection always reads as a list
    for name, value, example in (("targets", targets, '["reference"]'), ("checks", checks, '["P1"]')):
        if isinstance(value, (str, Check)):
            raise TypeError(f"parametrize_with_checks: {name}={value!r} is one {type(value).__name__}, not a list: "
                            f"pass {name}={example} (a bare string would iterate as its characters)")
    if callable(targets):
        raise TypeError(f"parametrize_with_checks: targets={targets!r} is one factory, not a list: pass "
                        f"targets=[{getattr(targets, '__name__', 'build')}]")
    chosen = list(CHECKS.values()) if checks is None else []
    for c in checks or ():
        chosen += [c] if isinstance(c, Check) else select(c)
    if not chosen:
        raise ValueError("parametrize_with_checks: no checks selected (a gate that checks nothing must not pass)")
    target_list = None if targets is None else list(targets)
    if target_list is not None and not target_list:
        raise ValueError("parametrize_with_checks: an empty target list (a gate that checks nothing must not pass)")
    if callable(expected_failed_checks) and target_list is None:
        raise ValueError("parametrize_with_checks: a callable expected_failed_checks needs the targets list")

    def expected(target) -> Mapping[str, str]:
        found = expected_failed_checks(target) if callable(expected_failed_checks) else (expected_failed_checks or {})
        if not isinstance(found, Mapping):  # a list of ids has no reasons: .items() would be a raw AttributeError
            raise TypeError(f"expected_failed_checks={found!r} ({type(found).__name__}): give a mapping check id -> "
                            "reason, e.g. {'P3/concat': 'why it fails'}")
        for check_id, reason in found.items():
            if check_id not in CHECKS:
                raise ValueError(f"expected_failed_checks: unknown check id {check_id!r}; known: {list(CHECKS)}")
            if not isinstance(reason, str) or not reason.strip():
                raise ValueError(f"expected_failed_checks[{check_id!r}]: give the reason as a non-empty string")
        return found

    if not callable(expected_failed_checks):
        expected(None)  # its errors now, at the decorator, even where no case reads it

    def param(check: Check, *target):
        marks = [pytest.mark.property(check.property)]
        reason = expected(target[0] if target else None).get(check.id)
        if reason:
            # a finding only: expected_failed_checks names no message, so a crash of the target (TargetRaised,
            # "the target's decode raised RuntimeError: ...") is not taken for the expected failure
            marks.append(pytest.mark.xfail(raises=Finding, strict=True, reason=f"expected failure: {reason}"))
        return pytest.param(check, *target, marks=marks, id="-".join([check.id, *map(target_name, target)]))

    if target_list is None:
        return pytest.mark.parametrize("check", [param(c) for c in chosen])
    return pytest.mark.parametrize("check, target", [param(c, t) for t in target_list for c in chosen])
