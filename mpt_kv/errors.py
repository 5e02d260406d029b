"""Errors the suite raises on purpose."""

import pytest


class InputError(ValueError):
    """Bad input to the reference or a target adapter: the message names the value and the limit."""


class DeviceUnavailable(RuntimeError):
    """A device the run asked for is not usable on this machine."""


class TargetUnavailable(RuntimeError):
    """A target could not be imported or built here; the message is the reason it is skipped."""


class TargetBroken(RuntimeError):
    """A target's factory raised while building a runner: the message names the target, the
    device and the factory's own exception (chained as the cause). An error, never a skip."""


class Unsupported(pytest.skip.Exception):
    """A case needs a feature the target declares it does not implement (`Capabilities`); the
    message is the target's own reason. A pytest skip, so it reads as one in any test; the kill
    matrix and the conformance matrix show it as "unsupported", never as a pass or a failure."""

    def __init__(self, msg: str):
        super().__init__(msg=msg)


class UnknownName(InputError, KeyError):
    """A name a registry does not hold (a family, a check id, an implementation). A KeyError too,
    so `in`, `.get` and `except KeyError` keep working; its message names the known ones."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument (quotes, escaped newlines)
        return str(self.args[0]) if self.args else ""


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
