"""The CPU stand-in for habana_frameworks (mpt_kv/families/habana_standin.py) loads a model
module that imports `habana_frameworks.torch.core` unconditionally, and leaves no HPU behind:
`find_spec` finds nothing, torch has no usable hpu, mpt_kv.devices sees none, and `pytest -m hpu`
is still the gate's usage error with such a module imported first (docs/gate.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mpt_kv import devices
from mpt_kv.families import habana_standin

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
FALCON = "optimum.habana.transformers.models.falcon.modeling_falcon"
HAVE_OH = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.habana") is not None

# a model module shaped like optimum-habana's falcon: kernels guarded, htcore not
LIKE_FALCON = """
try:
    from habana_frameworks.torch.hpex.kernels import FusedSDPA
except ImportError:
    FusedSDPA = None
try:
    from habana_frameworks.torch.hpu import sdp_kernel
except ImportError:
    sdp_kernel = None
import habana_frameworks.torch.core as htcore
import habana_frameworks.torch.hpu as hthpu

def step():
    htcore.mark_step()
    return hthpu.is_available()
"""


def no_hpu_left():
    """What every consumer of HPU presence sees after the stand-in is gone."""
    assert importlib.util.find_spec("habana_frameworks") is None
    assert not [n for n in sys.modules if n == "habana_frameworks" or n.startswith("habana_frameworks.")]
    hpu = getattr(torch, "hpu", None)
    assert hpu is None or not hpu.is_available()
    reason = devices._probe.__wrapped__("hpu")  # uncached: probed now, after the import
    assert reason is not None and "habana_frameworks" in reason
    assert devices._cannot_be_here("hpu") == "habana_frameworks is not installed; it ships in Gaudi images only"


@pytest.fixture
def like_falcon(tmp_path, monkeypatch):
    (tmp_path / "like_falcon.py").write_text(LIKE_FALCON)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "like_falcon"
    sys.modules.pop("like_falcon", None)


def test_without_the_standin_such_a_module_does_not_import(like_falcon):
    with pytest.raises(ModuleNotFoundError, match="habana_frameworks"):
        importlib.import_module(like_falcon)


def test_the_standin_loads_it_with_kernels_absent_and_leaves_no_hpu(like_falcon):
    module = habana_standin.import_with_standin(like_falcon)
    assert module.FusedSDPA is None and module.sdp_kernel is None  # its CPU fallbacks
    assert module.step() is False  # mark_step a no-op, hpu not available
    assert habana_standin.is_standin(module.htcore)
    no_hpu_left()


def test_the_standin_is_removed_when_the_import_fails(tmp_path, monkeypatch):
    (tmp_path / "broken_port.py").write_text("import habana_frameworks.torch.core\nraise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="boom"):
        habana_standin.import_with_standin("broken_port")
    no_hpu_left()


def test_the_standin_refuses_where_habana_frameworks_is_real(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "habana_frameworks" else None)
    with pytest.raises(RuntimeError, match="a real habana_frameworks is installed"):
        with habana_standin.standin():
            pass
    monkeypatch.undo()
    real = type(sys)("habana_frameworks")
    monkeypatch.setitem(sys.modules, "habana_frameworks", real)
    with pytest.raises(RuntimeError, match="the real habana_frameworks is already imported"):
        with habana_standin.standin():
            pass
    assert sys.modules["habana_frameworks"] is real  # never removed: it is not the stand-in's


@pytest.mark.optimum_habana
def test_optimum_habanas_falcon_loads_under_the_standin_and_leaves_no_hpu():
    from mpt_kv.targets import gaudi

    gaudi.register_bare_parents(gaudi.optimum_habana_root(), FALCON)
    module = sys.modules.get(FALCON) or habana_standin.import_with_standin(FALCON)
    assert hasattr(module, "GaudiFalconForCausalLM")
    no_hpu_left()


@pytest.mark.skipif(devices.unavailable_reason("hpu") is None, reason="this machine has an HPU: the gate would pass")
def test_pytest_m_hpu_stays_the_gates_usage_error_with_a_standin_loaded_module(pytester, monkeypatch, tmp_path):
    """The module is imported under the stand-in in the run's conftest, before the gate decides."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "like_falcon.py").write_text(LIKE_FALCON)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path / "mods")]))
    for var in ("CI", "MPT_KV_REQUIRE_DEVICE", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", devices.ENV_CARDS):
        monkeypatch.delenv(var, raising=False)
    load = f"gaudi.register_bare_parents(gaudi.optimum_habana_root(), {FALCON!r}); " \
           f"habana_standin.import_with_standin({FALCON!r})" if HAVE_OH else "pass"
    pytester.makeconftest(textwrap.dedent(f"""
        import sys
        from mpt_kv.families import habana_standin
        from mpt_kv.targets import gaudi
        habana_standin.import_with_standin("like_falcon")
        {load}
        print("stand-in loaded:", sorted(n for n in sys.modules if n in ("like_falcon", {FALCON!r})))
    """))
    pytester.makepyfile(test_gated="""
        import torch

        def test_add(device):
            assert (torch.ones(2, device=device) * 2).sum().item() == 4
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-m", "hpu", timeout=300)
    text = "\n".join(result.outlines + result.errlines)
    assert "stand-in loaded: " + ("['like_falcon', " + repr(FALCON) + "]" if HAVE_OH else "['like_falcon']") in text
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    assert "ERROR: -m 'hpu' selects hpu cases, but hpu is not available here: habana_frameworks" in text
    assert "test_add" not in text.replace("def test_add", "")
