"""The standalone repros of the findings (`python -m mpt_kv findings --repro DIR`).

A finding (a group of known failures, `mpt_kv.findings.grouping.grouped`) is a regex and a file:line;
a maintainer upstream needs a script that shows it with no mpt-kv installed. Each covered finding
becomes a folder under DIR with

    repro.py    imports only torch, transformers (and optimum-habana's or llm-foundry's own files):
                it prints what it shows and exits 1 where the bug is there, 0 where it is not, 2 where
                it could not run its experiment (a module missing, another error): never 0 then;
    README.md   the user-level call that reaches it, the upstream line, its cost at a real config,
                the versions it holds in, a suggested fix.

A family finding's script is filled in from a template with the finding's data (the family's tiny
config with the variant's overrides, as a literal): transformers' findings
(`mpt_kv.findings.transformers_repros`: `<implementation>-<family>-<variant>-<short what>`) and
optimum-habana's (`mpt_kv.findings.port_repros`). An MPT target finding names its repro in its
entry ("repro"): a script written once and kept (mpt_kv/findings/sources/kept/<slug>.py.tmpl:
standalone as the generated ones; its docstring's first line is its title, and its CALL and FIX say
what reaches it and the suggested fix, for its README), or the folder of a family finding that is
the same bug (the family checks see it in MPT too). Scripts and READMEs are written one way:
`mpt_kv.findings.scripts`. A finding nothing covers is listed as "no standalone repro yet".
"""

from __future__ import annotations

from pathlib import Path

from mpt_kv.findings.raw import MPT_FILE, is_family, raw_entries, target_of
from mpt_kv.findings.grouping import grouped, versions, what
from mpt_kv.findings.port_repros import port_operation, port_repro, program_of, program_repro
from mpt_kv.findings import scripts
from mpt_kv.findings.scripts import Repro, script_constants, slug
from mpt_kv.findings.transformers_repros import (is_transformers_view, transformers_call, transformers_repro,
                                                 view_repro)


def slug_of(entries: list[dict]) -> str | None:
    """The folder name of the finding's repro; None where no template covers it (the templates build
    the family's tiny model in float32 on CPU: a finding only bfloat16 or another device shows has
    none yet), or where its entries name a repro of their own ("repro": a kept script or another
    finding's folder, `target_plan`)."""
    entry = entries[0]
    if "repro" in entry or entry.get("dtype", "float32") != "float32" or entry.get("device", "cpu") != "cpu":
        return None
    if is_transformers_view(entry):
        return slug(entry, "kv-views")
    if transformers_call(entries):
        return slug(entry, transformers_call(entries)[0])
    covered = port_operation(entries)
    if covered:
        return slug(entry, covered[1])
    program = program_of(entries)
    return slug(entry, program.short) if program else None


def plan(groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """(the repros, the findings without one), in the file's order."""
    repros, missing = [], []
    for entries in groups:
        slug = slug_of(entries)
        if slug is None and "repro" in entries[0]:
            continue  # its entries name their repro: `target_plan`'s
        if slug is None:
            missing.append(entries)
        elif is_transformers_view(entries[0]):
            repros.append(view_repro(entries, slug))
        elif transformers_call(entries):
            repros.append(transformers_repro(entries, slug))
        elif port_operation(entries):
            repros.append(port_repro(entries, slug))
        else:
            repros.append(program_repro(entries, slug))
    return repros, missing


def finding_id(entries: list[dict]) -> str:
    """The id a changelog and a downstream project name a family finding by: its repro's folder, or,
    for a finding no template covers yet, the folder its repro would take from its property and path
    (the index lists it under "no standalone repro yet")."""
    entry = entries[0]
    only = "".join(f"-{entry[k]}" for k in ("dtype", "device") if entry.get(k))  # a bf16 finding's is its own
    return (slug_of(entries) or entry.get("repro")
            or slug(entry, f"{entry['property']}-{entry.get('path') or 'any'}{only}"))


def describe(entries: list[dict]) -> str:
    """One line naming a finding, for the list of findings without a repro."""

    entry = entries[0]
    if not is_family(entry):  # an MPT target's entry
        return f"MPT target {entry['target']} {entry['property']} ({versions(entry)}): {entry['reason'][:160]}"
    implementation, family, variant = target_of(entry)
    return f"{implementation} {family}/{variant} ({versions(entry)}): {what(entry)} [{entry['upstream']}]"


def index_text(repros: list[Repro], missing: list[list[dict]], shared: dict | None = None) -> str:
    """DIR/README.md: every repro folder, and every finding without a repro (the gap, visible)."""

    lines = ["# Standalone reproductions of mpt-kv's family findings", "",
             "Each folder's `repro.py` needs only torch and transformers (and, for an optimum-habana finding, "
             "optimum-habana installed): `python repro.py` exits 1 where the bug is there, 0 where it is not, "
             "2 where it could not run its experiment. Its README.md says what reaches it, where upstream, what "
             "it costs and a suggested fix.", "",
             "| folder | finding | holds in |", "|---|---|---|"]
    # every range its entries give (a kept MPT target repro serves checks that see it in different ones)
    lines += [f"| [{r.slug}]({r.slug}/README.md) | {r.title} | "
              f"{'; '.join(dict.fromkeys(versions(e) for e in r.entries))} |" for r in repros]
    if shared:
        lines += ["", "MPT target findings whose repro is a family finding's (the same bug):", ""]
        lines += [f"- {', '.join(dict.fromkeys(e['target'] + ' ' + e['property'] for e in entries))}: "
                  f"[{slug}]({slug}/README.md)" for slug, entries in shared.items()]
    lines += ["", f"## Findings without a standalone repro ({len(missing)})", ""]
    lines += [f"- no standalone repro yet: `{finding_id(entries)}`: {describe(entries)}".replace("|", "\\|")
              for entries in missing]
    return "\n".join(lines) + "\n"


# --- the MPT targets' findings: a kept script each, or a family finding's repro -------------------------

def target_entries() -> list[dict]:
    """The entries that name their repro ("repro"): the MPT targets' known failures, and the family entries
    that name one (a generate entry that sees a finding a kept script or another folder shows), as raw
    entries (every key kept)."""
    return raw_entries(MPT_FILE) + [e for e in raw_entries() if "repro" in e]


def target_readme(entries: list[dict], title: str, call: str, fix: str) -> str:
    """A kept MPT target repro's README, from its entries (one per check that sees the finding)."""
    lines = [f"# {title}", "", "```", "python repro.py", "```", "",
             "Exit status 1: the bug is there; 0: it is not; 2: the experiment could not run (a module missing, "
             "another error).", "",
             f"- **Reached by**: {call}",
             "- **Holds in**: " + "; ".join(dict.fromkeys(versions(e) for e in entries)),
             f"- **Suggested fix**: {fix}",
             "- **Seen by mpt-kv's checks**: " + ", ".join(dict.fromkeys(
                 f"{e['property']}" + (f" ({e['path']})" if e.get("path") else "") for e in entries))
             + f" ({'MPT target ' if not is_family(entries[0]) else ''}{entries[0]['target']})", ""]
    lines += [f"- **Why** ({e['property']}, {versions(e)}): {e['reason']}" for e in
              {e["reason"]: e for e in entries}.values()]
    return "\n".join(lines) + "\n"


def repro_names() -> frozenset[str]:
    """The name of every repro `write` makes: the kept MPT target scripts and the family findings'
    folders (what a known-failures entry's "repro" may name)."""
    global _NAMES
    if _NAMES is None:
        _NAMES = frozenset(scripts.kept_names() | {s for s in map(buildable_slug, grouped(raw_entries())) if s})
    return _NAMES


def buildable_slug(entries: list[dict]) -> str | None:
    """`slug_of`, or None where the installed transformers cannot build the finding's family config (its
    model type is newer: deepseek_v2 under llm-foundry's pinned 4.51), so its template's folder is not named
    here: the entries that name a repro in this environment (the MPT file's) name kept scripts or folders
    of families it has."""
    try:
        return slug_of(entries)
    except ValueError as e:
        if "Unrecognized model identifier" not in str(e):
            raise
        return None


_NAMES: frozenset[str] | None = None


def target_plan(entries: list[dict]) -> tuple[list[Repro], list[dict], dict[str, list[dict]]]:
    """(the kept MPT target repros, the entries without a repro, {family repro slug: the entries
    that name it}), in the file's order."""
    by_slug: dict[str, list[dict]] = {}
    missing = []
    for entry in entries:
        if "repro" in entry:
            by_slug.setdefault(entry["repro"], []).append(entry)
        else:
            missing.append(entry)
    kept, shared = [], {}
    for name, named in by_slug.items():
        script = scripts.kept(name)
        if script is None:
            shared[name] = named
            continue
        constants = script_constants(script)
        title = constants["doc"].splitlines()[0].removeprefix("Standalone reproduction: ").rstrip(".")
        kept.append(Repro(name, title, script, target_readme(named, title, constants["CALL"], constants["FIX"]),
                          tuple(named)))
    return kept, missing, shared


def write(directory, groups: list[list[dict]]) -> tuple[list[Repro], list[list[dict]]]:
    """Write one folder per covered finding under `directory` (repro.py, README.md), the family
    findings' and the MPT targets' kept ones, and the index directory/README.md; (the repros, the
    findings without one)."""
    repros, missing = plan(groups)
    kept, target_missing, shared = target_plan(target_entries())
    repros += kept
    missing += [[entry] for entry in target_missing]
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for r in repros:
        folder = root / r.slug
        folder.mkdir(exist_ok=True)
        (folder / "repro.py").write_text(r.script, encoding="utf-8")
        (folder / "README.md").write_text(r.readme, encoding="utf-8")
    (root / "README.md").write_text(index_text(repros, missing, shared), encoding="utf-8")
    return repros, missing
