"""One pytest session's mpt-kv state, in one object (as pytest-benchmark's BenchmarkSession and
xdist's DSession): what the plugin's modules learn as the run goes and read at its end. Each process
has its own (under xdist the controller's is the run's: the workers' reports and outputs reach it).

    state = run_state(config)        # made at pytest_configure, kept in config.stash

Nothing here imports torch: the plugin loads before an xdist worker's card is pinned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest


@dataclass
class RunState:
    # options: the reach table's real model (read once; the hypothesis profile: mpt_kv.checks.profiles)
    reference_model: dict | None = None
    # gate: device kind -> why the run requires it; the accelerator kinds probed (reason, cards)
    required: dict[str, str] = field(default_factory=dict)
    survey: dict | None = None
    # cards: the controller's pool of device cards for xdist workers
    cards: object | None = None
    # parametrize: each target spec resolved once per process (a ResolvedTarget, or a family declaration);
    # the named targets that are family declarations (name -> its family: the gate wants a case of each)
    resolved: dict = field(default_factory=dict)
    family_named: dict = field(default_factory=dict)
    # known failures (mpt_kv.findings.entries): the MPT file's entries, the families' once a family
    # case is collected (their registry imports torch); which entries (by key) covered a collected case;
    # whether any conformance case (any family case) was collected; cases each entry xfailed
    known: list = field(default_factory=list)
    family_known: list | None = None
    known_covered: set = field(default_factory=set)
    known_cases: bool = False
    family_cases: bool = False
    xfailed: Counter = field(default_factory=Counter)
    # outcomes: one record per case (its call, or a setup that did not pass), memory measurements, and
    # what checks recorded (declared capabilities, ceilings not stored, reach)
    results: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    extras: dict = field(default_factory=lambda: {"capabilities": {}, "unrecorded": {}, "reach": []})
    # ceilings: the project's StoredCeilings (made once), what --update-ceilings changed
    stored_ceilings: object | None = None
    ceilings_diff: list[str] | None = None
    # the end: why the JSON report or the markdown summary could not be written
    report_problem: str | None = None
    markdown_problem: str | None = None


KEY = pytest.StashKey[RunState]()


def start(config) -> RunState:
    """A fresh state for this session (pytest_configure)."""
    config.stash[KEY] = RunState()
    return config.stash[KEY]


def run_state(config) -> RunState:
    """This session's state; a config the plugin did not configure (a bare test config) gets a fresh one."""
    if KEY not in config.stash:
        return start(config)
    return config.stash[KEY]
