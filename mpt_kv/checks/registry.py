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

Which checks exist is read from the index of properties (`mpt_kv.checks.index`): one id per
property and path ("P1/static", "P3/static+bucket4", "memory/concat/B4-in32-new8", "ops-P2/static",
"ops-memory/concat/reorder"; P0 is uncached: "P0"), plus for the value properties their fixed edge
cases ("P1/static/max-seq-len-2048": long sequences to max_seq_len 2048, head dim 128, prompts
around the 128 bucket; strategies.EDGE_CASES) and their run under graphs ("P1/static/graphs": HPU
graphs, CUDA graphs, or on CPU a stand-in that returns one buffer per output shape). How a check
runs is the run layer's (`mpt_kv.checks.running`); the shipped tests (mpt_kv/conformance) and a
project's own tests (`parametrize_with_checks`) run these same functions. The drawn checks run
hypothesis under mpt-kv's profile (a failure is shrunk to a minimal case locally, not under
CI=true); `check.run_case(target, device, dtype, case)` runs one `Case` (a failure's "Falsifying
example" prints it) without hypothesis.

The memory checks always check the analytic properties; the stored ceilings are compared where a
`StoredCeilings` is given (the pytest plugin gives the project's, see docs/targets.md).
"""

from __future__ import annotations

import collections.abc
import difflib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from mpt_kv.checks import ceilings as C
from mpt_kv import recipes
from mpt_kv.checks import index, strategies
from mpt_kv.checks import running as run_layer
from mpt_kv.checks.index import BUCKET, MEMORY_BUCKET  # noqa: F401  (public here before the index)
from mpt_kv.checks.stored_ceilings import StoredCeilings, compare_stored  # noqa: F401  (public here before)
from mpt_kv.checks.running import (SHRINKING_PROFILES, RunContext, hypothesis_profile,  # noqa: F401  (their
                                   one_thread, record, running)                              # home was here)
from mpt_kv.checks.strategies import GRAPH_CASE, STATIC_SHAPE_CASE  # noqa: F401  (public here before)
from mpt_kv.errors import Finding, UnknownName, Unsupported
from mpt_kv.model.config import DTYPES, as_dtype  # noqa: F401  (as_dtype: its home was here)
from mpt_kv.targets import FamilyDeclaration, FamilyTarget, Target, required_features, resolve_target, target_name

PROPERTIES = index.NAMES


def path_label(path: str | None, bucket: int | None) -> str:
    return (path or "") + ("" if bucket is None else f"+bucket{bucket}")


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
    operation: str | None = None          # ops-memory, ops-retained: the operation (index.Property.operations)
    doc: str = ""

    def __str__(self) -> str:
        return self.id

    def features(self, device, dtype) -> list[str]:
        return required_features(self.path, self.bucket, dtype, device)

    def __call__(self, target: Target, device="cpu", dtype=torch.float32, *,
                 ceilings: StoredCeilings | None = None, known_failures=None) -> list[str]:
        """Its notes; `known_failures` (a `mpt_kv.KnownFailures`) applies the known-failure rule as the
        plugin does: the failure an entry names is a `KnownFailure` (an xfail), a pass of a case an entry
        covers an `UnexpectedPass`."""
        if known_failures is not None:
            return known_failures.check(self, target, device, dtype, ceilings=ceilings)
        return run_layer.run(self, target, device, dtype, ceilings)

    def run_case(self, target: Target, device, dtype, case) -> list[str]:
        """Run this check on one `Case` (a `programs.Program` for ops-P1/P2/P3), without hypothesis:
        to reproduce a failure, or for fixed cases. In bf16 P0 compares with the float32 reference
        from the bf16-rounded weights, P1 and P2 with the same target in float32 (its fp32 twin;
        the reference's where the target declares no fp32), so each bf16 path carries one
        rounding error, not two."""
        return run_layer.run_one(self, target, device, dtype, case)


def _split(label: str, bucket: int) -> tuple[str | None, int | None]:
    """A path label of the index -> (path, bucket)."""
    if not label:
        return None, None
    if label == "static+bucket":
        return "static", bucket
    return label, None


def checks_of(prop: index.Property) -> list[Check]:
    """The checks of one property of the index: one per path (and memory config, operation, edge
    case, graphs run) as its `runs` says. A family property's paths are its own labels (concat,
    static, static+reuse: the static path with optimum-habana's reuse_cache)."""
    if prop.family:
        return [Check(f"{prop.name}/{label}", prop.name, label, doc=prop.line) for label in prop.paths]
    bucket = MEMORY_BUCKET if prop.runs in ("memory", "operation") else BUCKET
    out = []
    for label in prop.paths:
        path, b = _split(label, bucket)
        here = f"{prop.name}/{path_label(path, b)}" if path else prop.name
        if prop.runs == "memory":
            out += [Check(f"{here}/{config.id}", prop.name, path, b, config, doc=prop.line) for config in C.CONFIGS]
        elif prop.runs in ("operation", "generate"):  # one check per operation, or per generate mode
            out += [Check(f"{here}/{op}", prop.name, path, b, operation=op, doc=f"{op}: {prop.line}")
                    for op in prop.operations]
        else:
            out.append(Check(here, prop.name, path, b, doc=prop.line))
    for edge in getattr(strategies, prop.edge_set) if prop.edges else ():
        for label in prop.edges:
            path, b = _split(label, bucket)
            here = f"{prop.name}/{path_label(path, b)}" if path else prop.name
            out.append(Check(f"{here}/{edge}", prop.name, path, b, edge=edge, doc=f"{prop.name} on a fixed edge case"))
    if prop.graphs:
        out.append(Check(f"{prop.name}/static/graphs", prop.name, "static", graphs=True,
                         doc=f"{prop.name} with the target under HPU or CUDA graphs (on CPU a stand-in: one output "
                             "buffer per shape)"))
    return out


class CheckRegistry(collections.abc.Mapping):
    """Every check by id, read-only. An unknown id is a KeyError naming the closest ids (a
    property such as "P1" is not an id: its checks are listed)."""

    def __init__(self, checks: Iterable[Check]):
        self._checks = {c.id: c for c in checks}

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


def _ordered() -> list[Check]:
    """The index's order, with the drawn value checks' ids first ("P0", "P1/concat", ...), then their
    edge cases (by edge case) and graphs runs, then the rest (the family checks last)."""
    every = [c for p in index.PROPERTIES for c in checks_of(p)]
    drawn = [c for c in every if index.by_name(c.property).runs == "case" and not c.edge and not c.graphs]
    edges = sorted((c for c in every if c.edge), key=lambda c: list(strategies.EDGE_CASES).index(c.edge))
    graphs = [c for c in every if c.graphs]
    return drawn + edges + graphs + [c for c in every if c not in drawn + edges + graphs]


CHECKS: Mapping[str, Check] = CheckRegistry(_ordered())


def is_family(check: Check) -> bool:
    return index.by_name(check.property).family


def is_generate(check: Check) -> bool:
    return index.by_name(check.property).runs == "generate"


def applies(check: Check, target) -> bool:
    """Whether the check has a cell for the target: an MPT check for an MPT target (a spec, a factory,
    a ResolvedTarget), a family check for a `FamilyTarget` on one of its paths (family-P0 not for
    transformers itself, its oracle); a generate check for both kinds (`generate_applies`)."""
    if is_generate(check):
        return generate_applies(check, target)
    if not isinstance(target, FamilyTarget):
        return not is_family(check)
    return is_family(check) and check.path in target.paths and not (target.oracle and check.property == "family-P0")


ASSISTED_MODES = ("prompt-lookup", "draft")
PLAIN_GENERATE_PATHS = ("concat", "static")  # every target's; the others are optimum-habana's (module doc)
GAUDI_GENERATE_MODES = ("greedy", "beam")      # on optimum-habana's own paths
# family generate cells not yet told apart: each fails in a way none of its port's direct-drive findings
# names, and is not yet told apart from what the drive sets up differently from run_generation.py (no cell
# until then: docs/generate.md "Not yet"); every other cell of optimum-habana's ports runs, its failures
# known failures of their own (the port's direct-drive finding seen through generate)
GENERATE_NOT_YET = {
    ("optimum-habana/deepseek_v3/mla", "generate/concat/greedy"):
        "greedy generate's second call feeds 3 tokens (the port's prepare_inputs_for_generation), and the cache it "
        "receives holds 256 bytes beyond the latent's analytic bytes",
    ("optimum-habana/baichuan/alibi", "generate/static/beam"):
        "after the first beam reorder the static cache holds 1.5 times its analytic bytes (46080 of 30720)",
    ("optimum-habana/baichuan/alibi", "generate/static/constrained"):
        "after the first beam reorder the static cache holds 1.5 times its analytic bytes (46080 of 30720), as its "
        "static beam search's",
    ("optimum-habana/chatglm/mq-groups2", "generate/concat/constrained"):
        "the port's _reorder_cache selects beams on its cache's second axis (models/chatglm/modeling_chatglm.py:1524-1526) "
        "and raises at the first reorder (index 3 of 2 rows): not yet told apart from how the drive sets up the beams",
    ("optimum-habana/chatglm/mq-groups2", "generate/static/constrained"):
        "as its concat cell: the port's _reorder_cache raises at the first reorder (index 3 of 2 rows)",
}


def generate_applies(check: Check, target) -> bool:
    """A generate check's cells (docs/generate.md): every mode on every MPT target; on a family target the
    paths it has, its family's first variant only (one tiny config per family), greedy and beam, and
    assisted decoding by prompt lookup only where the family has local windows (their crop must restore the
    window's evicted positions: the family's own part of assisted decoding; the rest of it, candidates,
    verification and crop, is GenerationMixin's and cache_utils' code the MPT targets' cells run, with a draft
    model too). optimum-habana's own paths (its reuse_cache, each text-generation recipe's flags:
    `index.GENERATE_PATHS`) are its ports' only: greedy and beam, reuse_cache on the first variant, a recipe
    on the variant it names (the only one whose paths have it)."""
    plain = check.path in PLAIN_GENERATE_PATHS
    implementation = target.implementation_name if isinstance(target, FamilyTarget) else target_name(target)
    if check.operation == "multi-turn" and implementation == "optimum-habana":
        return False  # not yet: GaudiGenerationMixin's multi-turn cells (docs/generate.md "Not yet")
    if not isinstance(target, FamilyTarget):
        return plain
    if check.path not in target.paths or (target.name, check.id) in GENERATE_NOT_YET:
        return False
    if not plain:
        return check.operation in GAUDI_GENERATE_MODES and (recipes.recipe_of(check.path) is not None or _first(target))
    if check.operation == "chunked" and target.implementation_name == "optimum-habana":
        return False  # GaudiGenerationMixin has no chunked prefill (its MPT target's cell says so: Unsupported)
    from mpt_kv.families import FAMILIES  # lazy: the registry of checks loads no family module

    family = target.family if not isinstance(target.family, str) else FAMILIES.get(target.family)
    if family is None:
        return True
    if check.operation == "draft" or (check.operation in ASSISTED_MODES and family.windows is None):
        return False
    return _first(target)


def _first(target: FamilyTarget) -> bool:
    """The target is its family's first variant (one tiny config per family), or a family not in the registry."""
    from mpt_kv.families import FAMILIES

    family = target.family if not isinstance(target.family, str) else FAMILIES.get(target.family)
    return family is None or target.variant == next(iter(family.variants))


def select(*properties: str) -> list[Check]:
    """The checks of the given properties ("P0", ..., "static-shape", "memory"), or ids; none: all."""
    unknown = [p for p in properties if p not in PROPERTIES and p not in CHECKS]
    if unknown:
        raise ValueError(f"unknown properties or check ids {unknown}: properties {list(PROPERTIES)}, "
                         f"ids {list(CHECKS)}")
    return [c for c in CHECKS.values() if not properties or c.property in properties or c.id in properties]


def drawn_records(profile: str = "ci", device: str = "cpu", dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """The reach records of every check under `profile`, without running a model (`mpt_kv.checks.drawn`)."""
    from mpt_kv.checks.drawn import drawn_records as draw  # the hypothesis strategies, without a model

    return draw(CHECKS.values(), profile, device, dtypes)



# the checks whose programs carry every design edge the zoo claims: family-P1 (prefill 6, 2 decodes, a
# 3-token call, a decode) and family-ops (prefill 8; beam: decodes and reorders; assisted: extend 3, crop 2,
# decode, extend 3), on transformers' concat path (the same calls in every transformers release, 4.x and 5.x)
PROGRAM_CHECKS = ("family-P1/concat", "family-ops/concat")


def has_edges(family) -> bool:
    """A family whose design has edges to reach (local windows, a latent, experts: its design's word, or
    per-layer K/V heads) that transformers ships: a remote-code family's model is its port's
    (optimum-habana's env measures it, its conformance report has its records)."""
    per_layer_heads = family.design == "per-layer-gqa"
    return not family.remote_code and (family.windows is not None or family.latent_width is not None
                                       or "moe" in family.design or per_layer_heads)


def family_program_records(families=None, checks=PROGRAM_CHECKS, implementation: str = "transformers",
                           dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """The reach records of a run of `checks` on `implementation` for every variant of `families` (default:
    the registry's families with design edges, `has_edges`), in each of `dtypes`, transformers with each
    attention implementation the conformance run generates (sdpa where the model class has it, eager), on
    CPU, through the run layer as under pytest (the records only; a check that fails or is unsupported still
    records what it reached): deterministic (fixed prompts and weights), a few seconds on CPU.
    docs/families.md's edge table is this run's (`python -m mpt_kv reach --update-docs`)."""
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.families import FAMILIES  # lazy: the registry of checks loads no family module
    from mpt_kv.families.implementations import generated_attention

    chosen = [FAMILIES[f] for f in families] if families is not None else [f for f in FAMILIES.values() if has_edges(f)]
    records: list[dict] = []

    def keep(name, value):
        if name == "mpt_kv_reach":
            records.append(value)

    with run_layer.running(RunContext(record=keep)):
        for family in chosen:
            for variant in family.variants:
                for check in checks:
                    for attention in (generated_attention() if implementation == "transformers" else [None]):
                        target = FamilyTarget(implementation, family.name, variant, attention=attention)
                        for dtype in dtypes:
                            try:
                                run_layer.run(CHECKS[check], target, "cpu", dtype)
                            except (PropertyFailure, Unsupported):
                                pass  # the verdict is the conformance run's; what the program reached is recorded
    return records

# --- the Python API for a project's own tests --------------------------------------------------------------

def family_declarations_expanded(targets: Iterable) -> list:
    """`targets` with each family declaration (`mpt_kv.FamilyModel`, or a `package.module:attr` spec
    naming one) replaced by its FamilyTargets, one per variant; a spec that does not load stays as it
    is (its cases fail saying why, as before)."""
    out = []
    for t in targets:
        if isinstance(t, str) and ":" in t and "/" not in t:
            try:
                resolved = resolve_target(t)
            except Exception:  # noqa: BLE001  its cases report it, as for any target that does not load
                resolved = None
            t = resolved if isinstance(resolved, FamilyDeclaration) else t
        out += t.named(None).targets() if isinstance(t, FamilyDeclaration) else [t]
    return out


def parametrize_with_checks(targets: Iterable[Target] | None = None, *, checks: Iterable[Check | str] | None = None,
                            expected_failed_checks: Mapping[str, str] | Callable[[Target], Mapping[str, str]] | None = None):
    """A pytest mark that runs every check (or `checks`) on `targets`, in the test it decorates:

        @mpt_kv.parametrize_with_checks([build], expected_failed_checks={"P3/concat": "why"})
        def test_mpt_kv(check, target, device, dtype):
            check(target, device, dtype)

    targets    factories or spec strings; None: the plugin's targets (--target, ini mpt_kv_targets);
               FamilyTargets, and family declarations (`mpt_kv.FamilyModel`, or a spec naming one),
               each giving its FamilyTargets, one per variant, paired with the family checks
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
    # the plugin's targets (targets=None) are MPT targets: the family checks need FamilyTargets
    chosen = [c for c in CHECKS.values() if targets is not None or not is_family(c)] if checks is None else []
    for c in checks or ():
        chosen += [c] if isinstance(c, Check) else select(c)
    if not chosen:
        raise ValueError("parametrize_with_checks: no checks selected (a gate that checks nothing must not pass)")
    target_list = None if targets is None else family_declarations_expanded(targets)
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
        return pytest.mark.parametrize("check", [param(c) for c in chosen if not is_family(c)])
    params = [param(c, t) for t in target_list for c in chosen if applies(c, t)]
    if not params:
        raise ValueError("parametrize_with_checks: none of the checks applies to these targets (the MPT checks take "
                         "MPT targets, the family checks FamilyTargets): a gate that checks nothing must not pass")
    return pytest.mark.parametrize("check, target", params)
