"""Sample messages the README and docs show are what the suite prints: each is produced here by the
run it says it comes from and compared, its numbers (which depend on the drawn case) left out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plugin_testing import HANG_S

REPO = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?")


def fenced_blocks(text: str) -> list[str]:
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def sample(doc: str, starts: str) -> str:
    """The one fenced block of `doc` whose text starts with `starts`, as one line."""
    found = [b for b in fenced_blocks((REPO / doc).read_text(encoding="utf-8")) if b.startswith(starts)]
    assert len(found) == 1, f"{doc}: {len(found)} blocks start with {starts!r}"
    return " ".join(found[0].split())


def shape_of_message(text: str) -> str:
    """The message with its case (its own values) and every number replaced: what stays is what it says."""
    text = re.sub(r"case=.*?(?=, step=)", "case=CASE", " ".join(text.split()))
    return NUMBER.sub("N", text)


def test_the_p1_failure_docs_checks_shows_is_what_p1_prints():
    from mpt_kv.catalogue.variants import VARIANTS
    from mpt_kv.checks.compare import PropertyFailure
    from mpt_kv.checks.registry import CHECKS

    shown = sample("docs/checks.md", "PropertyFailure: P1 decode logits")
    with pytest.raises(PropertyFailure) as info:
        CHECKS["P1/static"](VARIANTS["static_cache_not_written"].build, "cpu", torch.float32)
    printed = f"PropertyFailure: {info.value}"
    assert shape_of_message(printed) == shape_of_message(shown), f"docs/checks.md shows\n{shown}\nP1 prints\n{printed}"


def test_the_gate_error_the_readme_shows_is_what_pytest_m_hpu_prints(tmp_path):
    shown = sample("README.md", "ERROR: -m 'hpu'")
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "mpt_kv.conformance", "-m", "hpu", "-q",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=tmp_path, timeout=HANG_S,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 4 and shown in " ".join(run.stderr.split()), run.stderr


def test_the_seed_table_docs_memory_model_shows_is_what_the_command_prints():
    """docs/memory-model.md's output of `python -m mpt_kv memory --model mpt-7b --seed-table`, line by line."""
    run = subprocess.run([sys.executable, "-m", "mpt_kv", "memory", "--model", "mpt-7b", "--seed-table"],
                         capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr
    printed = {line.rstrip() for line in run.stdout.splitlines()}
    (shown,) = [b for b in fenced_blocks((REPO / "docs" / "memory-model.md").read_text(encoding="utf-8"))
                if any(line.startswith("version    B    in") for line in b.splitlines())]
    missing = [line for line in shown.splitlines() if line.strip() and line.rstrip() not in printed]
    assert not missing, "docs/memory-model.md shows lines the command does not print:\n" + "\n".join(missing)
