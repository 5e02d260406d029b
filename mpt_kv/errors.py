"""Errors the suite raises on purpose."""

import pytest


class InputError(ValueError):
    """Bad input to the reference or a target adapter: the message names the value and the limit."""


class DeviceUnavailable(RuntimeError):
    """A device the run asked for is not usable on this machine."""


class TargetUnavailable(RuntimeError):
    """A target could not be imported or built here; the message is the reason it is skipped."""


class Unsupported(pytest.skip.Exception):
    """A case needs a feature the target declares it does not implement (`Capabilities`); the
    message is the target's own reason. A pytest skip, so it reads as one in any test; the kill
    matrix and the conformance matrix show it as "unsupported", never as a pass or a failure."""

    def __init__(self, msg: str):
        super().__init__(msg=msg)
