"""How a finding's standalone repro is written: its script, by one fill-in mechanism (a source,
`string.Template`, filled with values, the parts the scripts share among them), its README, and how
the written scripts are run. Which finding gets which repro: `mpt_kv.findings.repros`.

    fill(template("view.py.tmpl"), title=..., config=...)   a family finding's script, from its template
    kept("transformers-mpt-crop-keeps-cropped-positions")   an MPT target finding's script, written once

The sources are package data, mpt_kv/findings/sources/:

    templates/<name>.py.tmpl  a family finding's script, filled with the finding's data (title, tiny
                              config, port module, ...) by `mpt_kv.findings.repros` and its helpers
    kept/<slug>.py.tmpl       an MPT target finding's script, written once and kept: its `${part}`s
                              are filled in, nothing else (no other `$` in it)
    parts/<name>.part         code several scripts share, `${name}` where a source wants it: its
                              leading comment says what it needs of the script (imports, constants)
                              and is left out; the placeholder's own line ends it (its file's last
                              newline is not part of it)

A written script imports only torch, transformers and the package it reproduces in (optimum-habana,
llm-foundry), never mpt_kv: `DRIVER` runs a set of them in one interpreter and says which mpt_kv
modules they imported (there must be none).
"""

from __future__ import annotations

import ast
import functools
import pprint
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

import torch

from mpt_kv import package_data
from mpt_kv.families import FAMILIES
from mpt_kv.findings import user_path
from mpt_kv.findings.costs import finding_cost
from mpt_kv.findings.raw import target_of
from mpt_kv.findings.grouping import DTYPE_NAME, POINTS, checks_seen, human, versions

TEMPLATES = package_data.REPRO_TEMPLATES
KEPT = package_data.KEPT_REPROS
PARTS = package_data.REPRO_PARTS
SUFFIX = ".py.tmpl"

# Runs each script as `python repro.py` would (run_name "__main__") in one interpreter, its output
# captured: `python -c DRIVER SOURCE SCRIPT...`, SOURCE a folder taken off sys.path first ("" for
# none: the sweep's envs have the checkout on their path by a .pth file). Prints {path: {"code",
# "output"}} and every mpt_kv module the scripts imported (there must be none). A script that raises
# instead of exiting is status 2, "cannot run", its exception in its output. The sweep and
# tests/test_repros.py run the scripts through it.
DRIVER = """
import contextlib, io, json, os, runpy, sys
if sys.argv[1]:
    source = os.path.realpath(sys.argv[1])
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != source]
results = {}
for path in sys.argv[2:]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # a script must exit, never raise: counted as "cannot run"
            code = 2
            print(f"the script raised {e!r}")
    results[path] = {"code": code, "output": out.getvalue()}
imported = sorted(m for m in sys.modules if m == "mpt_kv" or m.startswith("mpt_kv."))
print(json.dumps({"results": results, "mpt_kv_modules": imported}))
"""


def part_text(path: Path) -> str:
    """A part as a source takes it: its leading comment and the blank lines after it left out, and its
    file's last newline (the placeholder's own line ends it)."""
    text = re.sub(r"\A(#[^\n]*\n)+\n*", "", path.read_text(encoding="utf-8"))
    return text[:-1] if text.endswith("\n") else text


@functools.lru_cache(maxsize=None)
def parts() -> dict[str, str]:
    """Every part, by name (the file's stem)."""
    return {path.name.removesuffix(".part"): part_text(path) for path in sorted(PARTS.glob("*.part"))}


def part(name: str) -> str:
    return parts()[name]


def template(name: str) -> Path:
    return TEMPLATES / name


def fill(source: Path, **values) -> str:
    """The source with every `${name}` filled in: a value given, else the part of that name (a name
    that is neither is a KeyError naming it)."""
    return Template(source.read_text(encoding="utf-8")).substitute(parts(), **values)


def kept_names() -> set[str]:
    """The slugs of the kept MPT target scripts."""
    return {path.name.removesuffix(SUFFIX) for path in KEPT.glob(f"*{SUFFIX}")}


def kept(slug: str) -> str | None:
    """The kept script of `slug`, its parts filled in; None where there is none."""
    path = KEPT / f"{slug}{SUFFIX}"
    return fill(path) if path.is_file() else None


def script_constants(script: str) -> dict:
    """A kept script's docstring ("doc") and its string constants (CALL, FIX, WHAT, UPSTREAM), read
    without running it."""
    tree = ast.parse(script)
    found = {"doc": ast.get_docstring(tree) or ""}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and \
                isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found[node.targets[0].id] = node.value.value
    return found


# --- one repro: its folder's script and README -------------------------------------------------------

@dataclass(frozen=True)
class Repro:
    """One finding's standalone reproduction: its folder name, script and README."""

    slug: str
    title: str
    script: str
    readme: str
    entries: tuple  # the finding's known-failure entries (one per check that sees it)


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def slug(entry: dict, short: str) -> str:
    """The folder name of a family finding's repro: its implementation, family, variant and a short name."""
    return slugify("-".join([*target_of(entry), short]))


def tiny_config(family_name: str, variant: str) -> dict:
    """The tiny config's keyword arguments, as `Family.config` builds it: TINY-style settings with
    the variant's overrides (a shallow merge)."""
    family = FAMILIES[family_name]
    return {**family.tiny, **family.variants[variant]}


def config_literal(config: dict) -> str:
    """`config` as a Python dict literal, one key a line."""
    text = pprint.pformat(config, indent=4, width=100, sort_dicts=False)
    return "{\n    " + text[1:-1].strip() + ",\n}" if len(config) > 1 else text


def class_names(family_name: str) -> tuple[str, str]:
    """(config class, causal LM class) transformers names for the family's model_type."""
    # lazy: transformers' auto mappings (seconds to import) only where a family repro is written
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = FAMILIES[family_name].model_type
    return CONFIG_MAPPING_NAMES[model_type], MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def readme_text(entries: list[dict], title: str, call: str, fix: str) -> str:
    """A repro folder's README: how to run it, what reaches it, where upstream, what it costs."""

    entry = entries[0]
    lines = [f"# {title}", "", "```", "python repro.py", "```", "",
             "Exit status 1: the bug is there; 0: it is not; 2: the experiment could not run (a module missing, "
             "another error).", "",
             f"- **Reached by**: {user_path.cell(entries)}",
             f"- **What the script runs**: `{call.split(' - ')[0]}`" + (f" ({call.split(' - ', 1)[1]})" if " - " in call
                                                                       else ""),
             f"- **Upstream**: {entry['upstream']}",
             f"- **Holds in**: {versions(entry)}",
             f"- **Cost**: {cost_text(entry)}",
             f"- **Why**: {entry['reason']}",
             f"- **Suggested fix**: {fix}.",
             f"- **Seen by mpt-kv's checks**: {checks_seen(entries)} ({'/'.join(target_of(entry))})"]
    return "\n".join(lines) + "\n"


def cost_text(entry: dict) -> str:
    """What the finding pins at a real config, as the findings table computes it."""
    cost = finding_cost(entry, POINTS, getattr(torch, DTYPE_NAME))
    if cost.pinned is None:
        return cost.why_none
    parts = []
    for batch, tokens in POINTS:
        n = cost.pinned[(batch, tokens)]
        if n is None:
            continue
        length = tokens if tokens is not None else cost.config.context()
        parts.append(f"{human(n)} pinned after a prefill of batch {batch} x {length} tokens")
    return (f"at {cost.config.checkpoint} ({DTYPE_NAME}): " + "; ".join(parts)
            + f" (the K/V cache itself at batch {POINTS[0][0]} x {POINTS[0][1]}: {human(cost.kv[POINTS[0]])})")
