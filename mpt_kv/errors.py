"""Errors the suite raises on purpose."""


class InputError(ValueError):
    """Bad input to the reference or a target adapter: the message names the value and the limit."""


class DeviceUnavailable(RuntimeError):
    """A device the run asked for is not usable on this machine."""


class TargetUnavailable(RuntimeError):
    """A target could not be imported or built here; the message is the reason it is skipped."""
