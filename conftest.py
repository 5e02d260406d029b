"""This checkout's tests need mpt-kv installed: its pytest plugin (devices, targets, the gate,
the report) is registered through the `pytest11` entry point, as in any project that installs it.
Without it every conformance test would fail on a missing fixture; say why instead."""

import pytest


def pytest_configure(config):
    if not config.pluginmanager.has_plugin("mpt_kv.plugin"):
        raise pytest.UsageError("the mpt-kv pytest plugin is not loaded: install this checkout first "
                                "(pip install -e '.[dev]', see README) and do not disable it with -p no:mpt_kv.plugin")
