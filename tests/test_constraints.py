"""The pinned environments (constraints/*.txt, constraints/diff.py, tox.ini; docs/gate.md rows 16, 21,
23): every tox env installs from a committed lock, the locked versions are the ones the ceilings
are keyed by, and the hpu lock never installs the Gaudi image's own packages."""

from __future__ import annotations

import pytest

from plugin_testing import ROOT


# --- 6. pinned environments ----------------------------------------------------------------------------------------

@pytest.fixture
def constraints_diff():
    """constraints/diff.py, the lock tool (a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("constraints_diff", ROOT / "constraints" / "diff.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_locked_versions_are_the_ones_the_ceilings_are_keyed_by(constraints_diff):
    from mpt_kv.checks import stored_ceilings as S

    keys = {k.split("|")[0] for k in S.load_baseline(S.baseline_path("cpu"), "cpu")}
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    cpu = constraints_diff.read_lock(ROOT / "constraints" / "cpu.txt")
    oh = constraints_diff.read_lock(ROOT / "constraints" / "ohabana.txt")
    assert f"transformers (transformers {minor(cpu['transformers'])})" in keys
    # the ohabana lock's transformers (4.55) records none: its MPT memory cases are all the concat path's known
    # failure (the views of Wqkv's output), and it has no static path; no key names another version
    assert {k for k in keys if k.startswith("transformers (")} <= {
        f"transformers (transformers {minor(cpu['transformers'])})", f"transformers (transformers {minor(oh['transformers'])})"}
    assert f"optimum-habana (optimum-habana {minor(oh['optimum-habana'])}, transformers {minor(oh['transformers'])})" \
        in keys
    assert cpu["torch"] == oh["torch"] == "2.13.0"


def test_the_latest_env_pins_only_torch(constraints_diff):
    assert constraints_diff.read_lock(ROOT / "constraints" / "latest.txt") == {"torch": "2.13.0"}


@pytest.mark.parametrize("env", ["hpu", "cuda"])
def test_an_accelerator_lock_never_installs_the_images_own_packages(constraints_diff, env):
    lock = constraints_diff.read_lock(ROOT / "constraints" / f"{env}.txt")
    assert not {"torch", "transformers", "habana-frameworks", "optimum-habana"} & set(lock)
    assert {"pytest", "hypothesis", "pytest-xdist"} <= set(lock)


def test_tox_envs_install_from_the_locks_and_latest_is_not_default():
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert [e.strip() for e in tox["tox"]["env_list"].split(",")] == ["cpu", "ohabana", "foundry"]
    for env, name in (("testenv", "cpu"), ("testenv:ohabana", "ohabana"), ("testenv:hpu", "hpu"),
                      ("testenv:foundry", "foundry"), ("testenv:cuda", "cuda")):
        assert f"PIP_CONSTRAINT = {{tox_root}}{{/}}constraints{{/}}{name}.txt" in tox[env]["set_env"]
    assert "--strict-known-failures" in tox["testenv"]["commands"]
    assert "--target optimum-habana" in tox["testenv:ohabana"]["commands"]
    assert "--target llm-foundry" in tox["testenv:foundry"]["commands"]  # fail closed: it must load there
    for env, kind in (("testenv:hpu", "hpu"), ("testenv:cuda", "cuda")):  # an accelerator image's own torch, untouched
        assert "torch" not in tox[env]["deps"] and tox[env]["skip_install"] == "true"
        assert tox[env]["system_site_packages"] == "true"
        assert "pip install --no-deps -e {tox_root}" in tox[env]["commands_pre"]
        assert f"pytest -m {kind} " in tox[env]["commands"]
    assert "constraints{/}latest.txt" in tox["testenv:latest"]["set_env"]  # only torch: the rest at its newest
    assert "diff.py" in tox["testenv:latest"]["commands_pre"]


def test_lock_diff_lists_what_changed(tmp_path, constraints_diff, capsys):
    path = tmp_path / "lock.txt"
    path.write_text("# header\npytest==0.0.1\nno-such-package==1.0\n")
    assert constraints_diff.main([str(path)]) == 0
    assert constraints_diff.main([str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert f"  pytest: 0.0.1 (locked) -> {constraints_diff.installed()['pytest']} (installed)" in out


def test_every_file_the_ohabana_env_ignores_exists():
    """tox.ini's [testenv:ohabana] --ignore list names the files that run in the cpu env only; pytest
    ignores a path that does not exist without a word, so a renamed file would silently run twice."""
    import configparser
    import re

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    ignored = re.findall(r"--ignore=(\S+)", tox["testenv:ohabana"]["commands"])
    assert len(ignored) >= 20, ignored
    assert not [p for p in ignored if not (ROOT / p).is_file()], [p for p in ignored if not (ROOT / p).is_file()]
