"""The reach records of checks under a hypothesis profile without running a model (`mpt_kv.checks.registry.
drawn_records`, the reach table of docs/reach.md): each drawn check's strategy as its driver draws it, each
fixed case once."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from mpt_kv.checks import index, programs, reach
from mpt_kv.checks.running import program_knobs
from mpt_kv.checks.strategies import GRAPH_CASE, STATIC_SHAPE_CASE, cases, edge_cases


def drawn_records(checks, profile: str = "ci", device: str = "cpu", dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """The reach records of `checks` under `profile`, without running a model: each drawn check's
    strategy as its driver draws it (its property, dtype, the profile's examples; the program checks'
    fixed programs and a third of the examples, every operation the built-in targets implement),
    each fixed case (edge cases, static-shape, graphs, memory configs, ops-memory's case) once."""
    out = []
    for check in checks:
        runs = index.by_name(check.property).runs
        for dtype in dtypes:
            if runs == "program":
                drawn = list(programs.fixed_programs(device, set(programs.OPERATIONS)))

                @settings(settings.get_profile(profile), database=None,
                          max_examples=max(2, settings.get_profile(profile).max_examples // 3))
                @given(program=programs.programs(device, set(programs.OPERATIONS), dtype))
                def draw_programs(program):
                    drawn.append(program)

                draw_programs.hypothesis.inner_test._hypothesis_internal_add_digest = f"{check.id}|{dtype}".encode()
                draw_programs()
                out += [{"check": check.id, "knobs": k} for p in drawn
                        for k in program_knobs(p, check.path, check.bucket, device, dtype)]
                continue
            if runs == "memory":
                found = [check.config.case()]
            elif runs == "fixed":
                found = [STATIC_SHAPE_CASE]
            elif runs == "operation":
                found = list(programs.MEMORY_CASES)
            elif runs != "case":  # the family checks' fixed cases are not MPT cases (docs/families.md)
                continue
            elif check.edge:
                found = [edge_cases(device)[check.edge]]
            elif check.graphs:
                found = [edge_cases("hpu")["bucket-128"] if device == "hpu" else GRAPH_CASE]
            else:
                found = []

                @settings(settings.get_profile(profile), database=None)
                @given(case=cases(device, prop=check.property, dtype=dtype))
                def draw(case):
                    found.append(case)

                draw.hypothesis.inner_test._hypothesis_internal_add_digest = f"{check.id}|{dtype}".encode()
                draw()
            out += [{"check": check.id, "knobs": reach.knobs(c, check.path, check.bucket, device, dtype)}
                    for c in found]
    return out
