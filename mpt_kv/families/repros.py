"""Standalone reproductions of the family findings (`python -m mpt_kv findings --repro DIR`).

A finding (a group of known failures, `mpt_kv.cli.findings.grouped`) is a regex and a file:line
here; a maintainer upstream needs a script that shows it with no mpt-kv installed. Each covered
finding becomes a folder `<implementation>-<family>-<variant>-<short what>` with

    repro.py    imports only torch, transformers (and optimum-habana's own files): it prints what
                it shows and exits 1 where the bug is there, 0 where it is not, 2 where it could
                not run its experiment (a module missing, another error): never 0 then;
    README.md   the user-level call that reaches it, the upstream line, its cost at a real config,
                the versions it holds in, a suggested fix.

The scripts are filled in from templates kept in the package (`repro_templates/*.py.tmpl`,
`string.Template`), with the finding's data: the family's tiny config with the variant's
overrides, as a literal. A finding no template covers is listed as "no standalone repro yet".
"""

from __future__ import annotations

import pprint
import re
import textwrap
from dataclasses import dataclass
from importlib import resources
from string import Template

from mpt_kv.families import FAMILIES

TEMPLATES = "repro_templates"

# Why a view finding costs memory, and how transformers 4.56 stopped it (DynamicLayer.update's
# first store goes through lazy_initialization + torch.cat, which copies)
VIEW_FIX = ("copy the first K/V into the cache in DynamicLayer.update's first store (`.contiguous()`/`.clone()` "
            "of the chunks, or allocate and `copy_`), as transformers 4.56 does (lazy_initialization, then "
            "torch.cat)")


@dataclass(frozen=True)
class Repro:
    """One finding's standalone reproduction: its folder name, script and README."""

    slug: str
    title: str
    script: str
    readme: str
    entries: tuple  # the finding's known-failure entries (one per check that sees it)


def implementation(entry: dict) -> str:
    return entry.get("implementation", "transformers")


def is_transformers_view(entry: dict) -> bool:
    """A transformers finding whose cached K/V view a larger buffer (a "views" entry)."""
    return bool(entry.get("views")) and implementation(entry) == "transformers"


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def slug(entry: dict, short: str) -> str:
    return slugify(f"{implementation(entry)}-{entry['family']}-{entry['variant']}-{short}")


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
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = FAMILIES[family_name].model_type
    return CONFIG_MAPPING_NAMES[model_type], MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def template(name: str) -> Template:
    return Template(resources.files(__package__).joinpath(TEMPLATES, name).read_text(encoding="utf-8"))


def view_repro(entries: list[dict]) -> Repro:
    """A transformers view finding: the prefill's cached K/V view the fused projection's output."""
    from mpt_kv.cli.findings import versions, what

    entry = entries[0]
    family, variant = entry["family"], entry["variant"]
    config_class, _ = class_names(family)
    pins = what(entry)
    title = f"transformers {family}/{variant}: after the prefill, {pins.replace('`', '')}"
    summary = textwrap.fill(entry["reason"], 96)
    script = template("view.py.tmpl").substitute(
        title=title, summary=summary, upstream=entry["upstream"], when=versions(entry), config_class=config_class,
        family=family, variant=variant, config=config_literal(tiny_config(family, variant)),
        pins=pins.replace("`", ""))
    call = ("model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=N) - any generate with "
            "use_cache=True (the default) and the default DynamicCache")
    readme = readme_text(entries, title, call, VIEW_FIX)
    return Repro(slug_of(entries), title, script, readme, tuple(entries))


def readme_text(entries: list[dict], title: str, call: str, fix: str) -> str:
    """A repro folder's README: how to run it, what reaches it, where upstream, what it costs."""
    from mpt_kv.cli.findings import checks_seen, versions

    entry = entries[0]
    lines = [f"# {title}", "", "```", "python repro.py", "```", "",
             "Exit status 1: the bug is there; 0: it is not; 2: the experiment could not run (a module missing, "
             "another error).", "",
             f"- **Reached by**: `{call.split(' - ')[0]}`" + (f" ({call.split(' - ', 1)[1]})" if " - " in call else ""),
             f"- **Upstream**: {entry['upstream']}",
             f"- **Holds in**: {versions(entry)}",
             f"- **Cost**: {cost_text(entry)}",
             f"- **Why**: {entry['reason']}",
             f"- **Suggested fix**: {fix}.",
             f"- **Seen by mpt-kv's checks**: {checks_seen(entries)} ({implementation(entry)}/{entry['family']}/"
             f"{entry['variant']})"]
    return "\n".join(lines) + "\n"


def cost_text(entry: dict) -> str:
    """What the finding pins at a real config, as the findings table computes it."""
    import torch

    from mpt_kv.cli.findings import DTYPE_NAME, POINTS, human
    from mpt_kv.families.costs import finding_cost

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


def slug_of(entries: list[dict]) -> str | None:
    """The folder name of the finding's repro; None where no template covers it."""
    entry = entries[0]
    if is_transformers_view(entry):
        return slug(entry, "kv-views")
    return None


def plan(groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """(the repros, the findings without one), in the file's order."""
    repros, missing = [], []
    for entries in groups:
        if slug_of(entries) is None:
            missing.append(entries)
        elif is_transformers_view(entries[0]):
            repros.append(view_repro(entries))
    return repros, missing


def describe(entries: list[dict]) -> str:
    """One line naming a finding, for the list of findings without a repro."""
    from mpt_kv.cli.findings import versions, what

    entry = entries[0]
    return (f"{implementation(entry)} {entry['family']}/{entry['variant']} ({versions(entry)}): "
            f"{what(entry)} [{entry['upstream']}]")


def index_text(repros: list[Repro], missing: list[list[dict]]) -> str:
    """DIR/README.md: every repro folder, and every finding without a repro (the gap, visible)."""
    from mpt_kv.cli.findings import versions

    lines = ["# Standalone reproductions of mpt-kv's family findings", "",
             "Each folder's `repro.py` needs only torch and transformers (and, for an optimum-habana finding, "
             "optimum-habana installed): `python repro.py` exits 1 where the bug is there, 0 where it is not, "
             "2 where it could not run its experiment. Its README.md says what reaches it, where upstream, what "
             "it costs and a suggested fix.", "",
             "| folder | finding | holds in |", "|---|---|---|"]
    lines += [f"| [{r.slug}]({r.slug}/README.md) | {r.title} | {versions(r.entries[0])} |" for r in repros]
    lines += ["", f"## Findings without a standalone repro ({len(missing)})", ""]
    lines += [f"- no standalone repro yet: {describe(entries)}".replace("|", "\\|") for entries in missing]
    return "\n".join(lines) + "\n"


def write(directory, groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """Write one folder per covered finding under `directory` (repro.py, README.md) and the index
    directory/README.md; (the repros, the findings without one)."""
    from pathlib import Path

    repros, missing = plan(groups)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for r in repros:
        folder = root / r.slug
        folder.mkdir(exist_ok=True)
        (folder / "repro.py").write_text(r.script, encoding="utf-8")
        (folder / "README.md").write_text(r.readme, encoding="utf-8")
    (root / "README.md").write_text(index_text(repros, missing), encoding="utf-8")
    return repros, missing
