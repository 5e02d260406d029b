"""mpt-kv's hypothesis profiles, and the one place that knows which one this process draws under.

    dev        the default: 8 examples, random, a failure shrunk to a minimal case
    ci         CI=true (or 1, yes): 6 examples, derandomized (the same examples every run, so a red
               run reproduces), a failure reported as found
    thorough   100 examples; the drawn cases reach further (`mpt_kv.checks.strategies.cases`)

MPT_KV_HYPOTHESIS_PROFILE names one (a project's conftest may register more). The pytest plugin
loads it at configure (`load_profile`); the run layer's hypothesis driver, the drawn cases and the
run's report read `current()`. No torch here: the plugin imports it before a worker's card is pinned.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.differing_executors])
settings.register_profile("dev", max_examples=8, derandomize=False, **_common)  # explicit: hypothesis derandomizes under CI by default
# CI: derandomized (the same examples every run, so a red run reproduces), fewer examples
settings.register_profile("ci", max_examples=6, derandomize=True, **_common)
settings.register_profile("thorough", max_examples=100, derandomize=False, **_common)
NAMES = ("dev", "ci", "thorough")
ENV = "MPT_KV_HYPOTHESIS_PROFILE"

# Shrinking reruns a failing check on ever smaller cases: about 20 s of CPU for one failure of
# these tiny models, and on HPU every new shape is a graph compilation. Under the ci profile
# (CI=true) a failure is reported as found: derandomized, so it reproduces, and its message names
# the whole case (`run_one` reruns it). Locally (dev, thorough) hypothesis shrinks it to a
# minimal case. An expected failure (xfail) is never shrunk: it only has to fail.
SHRINKING_PROFILES = ("dev", "thorough")

_loaded: str | None = None  # the profile this process loaded (the one home of its name)


def load_profile() -> str:
    """MPT_KV_HYPOTHESIS_PROFILE wins; CI=true (or 1, yes) selects `ci`; else `dev`."""
    in_ci = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
    return use_profile(os.environ.get(ENV) or ("ci" if in_ci else "dev"))


def use_profile(name: str) -> str:
    """Load hypothesis profile `name` and draw as it says: the one place both are set, so a test
    that loads another profile restores both."""
    global _loaded
    _loaded = name
    settings.load_profile(name)
    return name


def current() -> str:
    """The profile this process draws under: the one loaded, else the environment's, loaded now
    (a check called outside pytest loads it at its first drawn case)."""
    return _loaded if _loaded is not None else load_profile()


def thorough() -> bool:
    """Whether the `thorough` profile is loaded (the drawn cases reach further under it)."""
    return _loaded == "thorough"
