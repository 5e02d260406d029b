"""An expected failure's traceback is one line (mpt_kv.plugin.known_failures.brief_traceback): pytest
would format every frame from source, which nobody reads for an xfail; any other failure keeps its
whole traceback."""

pytest_plugins = ["pytester"]

DEEP = """
import pytest

def deep(n, exc):
    if n == 0:
        raise exc("the message")
    deep(n - 1, exc)

@pytest.mark.xfail(raises=ValueError, strict=True, reason="known")
def test_expected():
    deep(5, ValueError)

@pytest.mark.xfail(raises=ValueError, strict=True, reason="known")
def test_another_failure():
    deep(5, KeyError)

def test_plain_failure():
    deep(5, ValueError)
"""


def test_only_an_expected_failure_has_a_one_line_traceback(pytester):
    pytester.makepyfile(DEEP)
    reports = {r.nodeid.split("::")[-1]: r for r in pytester.inline_run("-p", "no:cacheprovider").getreports(
        "pytest_runtest_logreport") if r.when == "call"}
    expected = reports["test_expected"]
    assert hasattr(expected, "wasxfail") and str(expected.longrepr) == "ValueError: the message"
    for name in ("test_another_failure", "test_plain_failure"):  # not the expected failure: the whole traceback
        text = str(reports[name].longrepr)
        assert reports[name].failed and text.count("in deep") >= 5, (name, text)
