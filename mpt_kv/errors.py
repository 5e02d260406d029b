"""Every exception mpt-kv raises on purpose, in one place (the modules that raised them first
re-export them: `mpt_kv.checks.compare.PropertyFailure` is this `PropertyFailure`).

What a check's caller sees:

    PropertyFailure     a property does not hold (the verdict); its message names target, device,
                        dtype, case, step, operation, layer and the error's size or bytes
      TargetRaised      the target's own call raised (the crash rule made it a verdict)
        Crash           ... with the operation, the exception and the steps judged before it
      Failures          independent failures of one check (`independently`: family-ops' two programs), each judged
    Unsupported         the target declares it does not implement what the case needs (a skip)
    KnownFailure        with `known_failures=`: the PropertyFailure a known-failures entry names (an xfail)
    UnexpectedPass      with `known_failures=`: a case an entry covers passed (the entry is stale: XPASS)
    InputError          bad input to mpt-kv, named with its limit, before any work
      UnknownName       a name a registry does not hold (also a KeyError)
    TargetUnavailable   a target that cannot be imported here (the reason is the message)
    TargetBroken        a target's factory raised while building (its error chained)
    DeviceUnavailable   a device the run asked for is not usable here

and the files and tools behind them: BaselineError (stored ceilings), KnownFailuresError (a
known-failures file), PortError (an optimum-habana port), MeterError (a memory meter),
BuildError (the benchmark's target), SweepError (a release the sweep could not run),
ProfileError (the stored gate profile: missing, malformed or edited), SummaryError (a coverage
summary), ObserverError (the generate drive's own hook), StandInError (llm-foundry's code reaching
the training stack's stand-in), AliasedComparison (a check comparing a buffer with itself: a bug in the check). One
lives elsewhere: StandinOutOfScope (an HPU kernel stand-in called outside a port's forward), in
mpt_kv/families/hpu_kernels.py, which the standalone repros ship verbatim and so imports nothing of mpt-kv.

No torch here: the pytest plugin imports this module before a worker's device card is pinned.
"""

import pytest


def describe(ctx: dict) -> str:
    """A failure's context as `target=..., device=..., step=...` (the `[...]` every message ends with)."""
    return ", ".join(f"{k}={v}" for k, v in ctx.items() if v is not None)


# --- bad input and what is not here -----------------------------------------------------------------------

class InputError(ValueError):
    """Bad input to the reference or a target adapter: the message names the value and the limit."""


class DeviceUnavailable(RuntimeError):
    """A device the run asked for is not usable on this machine."""


class TargetUnavailable(RuntimeError):
    """A target could not be imported or built here; the message is the reason it is skipped."""


class AdapterError(TypeError):
    """A target's adapter broke the runner protocol it was built with (a CallableRunner's new_cache
    returning None): the adapter's error, raised as it is (never read as a finding of the model, never
    a crash verdict): "error" in the matrix."""


class TargetBroken(RuntimeError):
    """A target's factory raised while building a runner: the message names the target, the
    device and the factory's own exception (chained as the cause). An error, never a skip."""


class Unsupported(pytest.skip.Exception):
    """A case needs a feature the target declares it does not implement (`Capabilities`); the
    message is the target's own reason. A pytest skip, so it reads as one in any test; the kill
    matrix and the conformance matrix show it as "unsupported", never as a pass or a failure."""

    def __init__(self, msg: str):
        super().__init__(msg=msg)


class KnownFailure(pytest.xfail.Exception):
    """A check called with `known_failures=` (mpt_kv.findings.known.KnownFailures) failed with the
    PropertyFailure an applying entry names: a pytest xfail (an expected failure, as the plugin's strict
    xfail reads it), with the `entry` and the `failure` (the PropertyFailure, also chained)."""

    def __init__(self, msg: str, entry=None, failure: BaseException | None = None):
        super().__init__(msg)
        self.entry, self.failure = entry, failure


class UnexpectedPass(AssertionError):
    """A check called with `known_failures=` passed where an applying entry says it fails: the
    plugin's XPASS(strict). Not a PropertyFailure (no property failed): the entry is stale, or the
    implementation fixed what it records."""


class UnknownName(InputError, KeyError):
    """A name a registry does not hold (a family, a check id, an implementation). A KeyError too,
    so `in`, `.get` and `except KeyError` keep working; its message names the known ones."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument (quotes, escaped newlines)
        return str(self.args[0]) if self.args else ""


# --- verdicts ----------------------------------------------------------------------------------------------

class PropertyFailure(AssertionError):
    """A property does not hold; the message carries the whole context."""


class TargetRaised(PropertyFailure):
    """The target's (or implementation's) own call raised: the check's crash wrapper, which names
    the exception but no finding of the check. A known-failures entry may still name it by its
    message; `expected_failed_checks`, which names no message, never takes it for the expected
    failure (Finding)."""


class Failures(PropertyFailure):
    """Independent failures of one check, each judged on its own: family-ops runs its beam program and its
    assisted program each on a fresh session, so a crash of the first must not hide what the second does.
    A known-failure entry explains it only when it explains every one (`Entry.explains`, the rule for an
    exception group); its message is theirs, numbered, one per line."""

    def __init__(self, failures):
        self.exceptions = tuple(failures)
        super().__init__("\n".join(f"({i}) {e}" for i, e in enumerate(self.exceptions, 1)))


def independently(parts) -> None:
    """Runs each of a check's independent parts (callables: family-ops' two programs, the ops checks' fixed
    programs), every one whatever the others did, and raises what failed: the one failure, or `Failures` of
    all (a failure of one must hide none of the others). Anything but a PropertyFailure propagates at once."""
    failures = []
    for part in parts:
        try:
            part()
        except PropertyFailure as e:
            failures.append(e)
    if failures:
        raise failures[0] if len(failures) == 1 else Failures(failures)


class _FindingType(type):
    def __instancecheck__(cls, exc) -> bool:
        if isinstance(exc, Failures):  # a finding only when every one of them is
            return all(isinstance(e, cls) for e in exc.exceptions)
        return isinstance(exc, PropertyFailure) and not isinstance(exc, TargetRaised)


class Finding(metaclass=_FindingType):
    """For `pytest.mark.xfail(raises=Finding)`: a PropertyFailure that is a check's finding, not a
    crash of the target (TargetRaised). pytest tests `isinstance(exc, raises)`, which this answers."""


class Crash(TargetRaised):
    """A target's (or an implementation's) own call that raised, as a verdict: generation would
    crash there. The rule that makes it one is `mpt_kv.checks.running.crash_of` (every check that
    drives several calls compares each step before this propagates); `held` names, in the message,
    the steps that were judged before it and held."""

    def __init__(self, what: str, who: str, operation: str, error: BaseException, ctx: dict, at: str = "",
                 held=()):
        self.what, self.who, self.operation, self.error, self.ctx, self.at = what, who, operation, error, ctx, at
        self.held_steps = tuple(held)
        judged = f" (judged before it and held: {', '.join(map(str, self.held_steps))})" if self.held_steps else ""
        super().__init__(f"{what}: {who}'s {operation} raised {type(error).__name__}: {error}{at}{judged} "
                         f"[{describe(ctx)}]")

    def held(self, steps) -> "Crash":
        """The same crash, naming the steps judged before it that held."""
        again = Crash(self.what, self.who, self.operation, self.error, self.ctx, self.at, steps)
        again.__cause__ = self.error
        return again

    def note(self) -> str:
        """What a failure of an earlier step says of this crash: the operation and the exception's
        type, not its message (a known-failure pattern of the crash must not match the earlier
        step's failure)."""
        return (f"; the run did not get past {self.ctx.get('step', 'a later step')}, whose {self.operation} "
                f"crashed with {type(self.error).__name__} (not judged here: a finding of its own)")


class AliasedComparison(AssertionError):
    """Two tensors handed to `assert_close` share memory: the comparison would prove nothing
    (a buffer compared with itself). A bug in the calling check, or a target result that was
    not copied before the target ran again (see results.py); never a verdict on the target."""


# --- files and tools ---------------------------------------------------------------------------------------

class BaselineError(Exception):
    """The baseline (stored ceilings) file is missing, unreadable or malformed: never a pass."""


class KnownFailuresError(ValueError):
    """The known-failures file cannot be used; the message names the file, the entry and why."""


class PortError(RuntimeError):
    """An installed optimum-habana port that does not import or build: the real exception is chained."""


class MeterError(Exception):
    """A meter that cannot be built here or that does not read what was allocated."""


class BuildError(RuntimeError):
    """The benchmark's target factory raised (anything but TargetUnavailable) or returned no Runner."""


class SweepError(Exception):
    """A release that could not be swept: the reason is its row of the sweep's table."""


class ProfileError(Exception):
    """The stored gate profile cannot be used (missing, malformed, edited): the message says why and what to run."""


class SummaryError(ValueError):
    """A file that is not a summary of `run --coverage`, or summaries that cannot be put side by side."""


class ObserverError(RuntimeError):
    """mpt-kv's own observer raised inside a hook of the generate drive (reading a cache it did not
    expect): an error of the drive, never a crash of the implementation."""


class StandInError(TargetBroken):
    """llm-foundry's model code used the training stack's stand-in: it must never run any of it."""


# --- registries --------------------------------------------------------------------------------------------

class Registry(dict):
    """A dict whose missing key is an `UnknownName` naming the closest known keys (all of them
    when none is close), instead of a bare KeyError('nosuch')."""

    def __init__(self, what: str, items=()):
        super().__init__(items)
        self.what = what

    def __missing__(self, key):
        raise UnknownName(unknown_name(self.what, key, self))


def unknown_name(what: str, key, known) -> str:
    """The message for an unknown `key` among `known`: the closest names, else every one."""
    import difflib

    known = [str(k) for k in known]
    close = difflib.get_close_matches(str(key), known, n=6, cutoff=0.5)
    hint = f"closest: {', '.join(close)}" if close else f"known: {', '.join(known)}"
    return f"unknown {what} {key!r}: {hint}"
