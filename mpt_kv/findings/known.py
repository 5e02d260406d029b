"""Which known-failures entries may apply to a target's cases, and the one rule applied to a check
called by hand, as the pytest plugin applies it (mpt_kv/plugin/known_failures.py).

    known = mpt_kv.KnownFailures()                     # mpt-kv's files; KnownFailures("ours.json"): a project's
    mpt_kv.CHECKS["family-P3/concat"](target, "cpu", "fp32", known_failures=known)

An entry applies to a case by its target's name (`mpt_kv.findings.entries.match`), with two rules for
family targets (`entries_for`), both fail-closed:

- A family declaration (`mpt_kv.FamilyModel`) is named by its own spec: no entry about a built-in
  implementation applies to it by name. Its `fork_of` makes it inherit that implementation's shipped
  entries for its family, each copied onto each of its cells the entry covers (`inherited`): the
  same pattern, the same `when` (evaluated on the installed versions, which the fork runs on), a strict
  xfail of only the failure the pattern names. A fork that fixed one fails that case as XPASS, saying
  how to declare it (`fixes=`); a fork with another failure there fails on it. Entries of the project's
  own file about the declaration's cases come first, so one may replace an inherited entry.
- A FamilyTarget under a built-in implementation's name whose Family is not the registry's entry (a
  fork passed as `FamilyTarget("optimum-habana", <an edited copy of the entry>, ...)`) takes none of the
  shipped family file's entries by that name: it is not the port they were measured on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mpt_kv.checks import index
from mpt_kv.checks.registry import CHECKS, applies
from mpt_kv.devices import as_device
from mpt_kv.errors import KnownFailure, KnownFailuresError, UnexpectedPass
from mpt_kv.findings.entries import (FAMILY_FILE, MPT_FILE, Entry, known_verdict, load, load_families, matching,
                                     same_target)
from mpt_kv.model.config import as_dtype
from mpt_kv.targets import FamilyDeclaration, FamilyTarget, family_target, resolve_mpt


def is_shipped(entry: Entry) -> bool:
    return Path(entry.file).resolve() in (MPT_FILE.resolve(), FAMILY_FILE.resolve())


def words_for(entry: Entry) -> tuple[str, str]:
    """(how a case's entry is named, what to do when it no longer fails): mpt-kv's own files record
    upstream's failures; an inherited one, those of the implementation a fork derives from; a project's
    own file, the project's (its own bug kept on purpose, or an upstream one it depends on)."""
    if entry.origin:
        prop_path = f"{entry.property}/{entry.path}" if entry.path else entry.property
        return (f"known upstream failure of {entry.origin}, which {entry.implementation} forks",
                f"{entry.implementation} fixed it, declare that in its FamilyModel: fixes={{'{prop_path}': 'how'}} "
                f"(instead of keeping the entry it inherits from {entry.file})")
    if is_shipped(entry):
        return "known upstream failure", f"upstream fixed it, remove or narrow the entry in {entry.file}"
    return f"known failure of this project ({Path(entry.file).name})", f"it is fixed, remove or narrow the entry in {entry.file}"


def inherited(declaration, entries: list[Entry]) -> list[Entry]:
    """The entries a family declaration inherits (module doc): each shipped family entry of its
    `fork_of` implementation about its family and one of its variants, copied onto each of the
    declaration's cells it covers (path by path), less those its `fixes` names. A `fixes` key that no
    such entry covers is a KnownFailuresError (a typo must not pass silently)."""
    if getattr(declaration, "fork_of", None) is None:
        return []
    declaration = declaration.named(None)
    fixes = dict(declaration.fixes)
    for key in fixes:
        prop, _, path = key.partition("/")
        if prop not in index.NAMES or not index.by_name(prop).family or (path and path not in index.FAMILY_PATHS):
            raise KnownFailuresError(f"{declaration.name} fixes={key!r}: a family check id ('family-P3/concat') or a "
                                     f"family property ('family-P3'); paths {', '.join(index.FAMILY_PATHS)}")
    targets = {t.variant: t for t in declaration.targets()}
    out, fixed = [], set()
    for e in entries:
        # an entry about one attention implementation ("transformers[sdpa]/...") is about that build of
        # transformers' model, not about a fork of its code: not inherited
        if not (e.family and e.implementation == declaration.fork_of and e.family == declaration.family
                and e.variant in targets and not e.origin and e.attention is None):
            continue
        for path in targets[e.variant].paths:
            if e.path not in (None, path) or not any(
                    c.property == e.property and c.path == path and applies(c, targets[e.variant]) for c in CHECKS.values()):
                continue
            keys = {f"{e.property}/{path}", e.property} & set(fixes)
            if keys:
                fixed |= keys
                continue
            out.append(dataclasses.replace(e, target=targets[e.variant].name, path=path, origin=e.target))
    unused = sorted(set(fixes) - fixed)
    if unused:
        there = sorted({f"{e.variant} {e.property} {e.path or 'every path'}" for e in entries
                        if e.implementation == declaration.fork_of and e.family == declaration.family and not e.origin})
        raise KnownFailuresError(f"{declaration.name} fixes={unused}: no entry of {declaration.fork_of}/"
                                 f"{declaration.family} in {FAMILY_FILE.name} covers a cell it runs (its entries: "
                                 f"{', '.join(there) or 'none'}): a fix of nothing is a typo")
    return out


def registry_entry(target: FamilyTarget) -> bool:
    """Whether a FamilyTarget's family is the registry's entry of that name (or the name itself): the
    family the shipped entries were measured on."""
    from mpt_kv.families import FAMILIES

    return isinstance(target.family, str) or target.family == FAMILIES[target.family_name]


def entries_for(target, entries: list[Entry]) -> list[Entry]:
    """The entries that may apply to the cases of `target` (module doc): `entries`, plus what a family
    declaration inherits, less the shipped family entries of a built-in implementation's name for a
    FamilyTarget whose family is not the registry's entry."""
    if not isinstance(target, FamilyTarget):
        return entries
    if isinstance(target.implementation, FamilyDeclaration):
        return entries + inherited(target.implementation, entries)
    if not registry_entry(target):
        return [e for e in entries if not (same_target(e.target, target.name) and is_shipped(e))]
    return entries


class KnownFailures:
    """The known-failure rule for a check called by hand: `check(target, device, dtype,
    known_failures=KnownFailures())`, or `KnownFailures().check(check, target, device, dtype)`.

    file  the MPT targets' file (default mpt-kv's; a project's own replaces it, as the plugin's option
          `mpt_kv_known_failures` does, and may hold entries about its family targets); the family
          checks' file is always mpt-kv's, and a family declaration inherits as `entries_for` says.

    A case an applying entry covers: its PropertyFailure the pattern names is raised as `KnownFailure`
    (a pytest xfail); a pass raises `UnexpectedPass` (XPASS); any other failure is raised as it is. A
    case no entry covers runs as without it."""

    def __init__(self, file: str | Path | None = None):
        self.file = Path(file) if file is not None else MPT_FILE
        self.entries = load(self.file) + load_families()

    def __repr__(self) -> str:
        return f"KnownFailures({str(self.file)!r}: {len(self.entries)} entries)"

    def entries_of(self, check, target, device="cpu", dtype=torch.float32) -> list[Entry]:
        """The entries that apply to `check` on `target` (resolved) on `device` in `dtype` (`matching`): the
        plugin's rule, the case's dtype and device kind included (an entry may name either)."""
        return matching(target.name, check.property, check.path, entries_for(target, self.entries), check.bucket,
                        check.id, str(as_dtype(dtype)).replace("torch.", ""), as_device(device).type)

    def entry(self, check, target, device="cpu", dtype=torch.float32) -> Entry | None:
        """The first of `entries_of`, or None."""
        found = self.entries_of(check, target, device, dtype)
        return found[0] if found else None

    def check(self, check, target, device="cpu", dtype=torch.float32, *, ceilings=None) -> list[str]:
        target = family_target(target) if index.by_name(check.property).family else resolve_mpt(target)
        entries = self.entries_of(check, target, device, dtype)
        if not entries:
            return check(target, device, dtype, ceilings=ceilings)
        try:
            notes = check(target, device, dtype, ceilings=ceilings)
        except BaseException as e:
            verdict, named = known_verdict(entries, e)
            if verdict == "known":
                raise KnownFailure(known_text(named), named[0], e) from e
            if verdict == "stale":
                raise UnexpectedPass(f"[XPASS(strict)] {check.id} on {target.name} failed, but not as these entries "
                                     "say (its other failures are known): " + xpass_text(named)) from e
            raise
        raise UnexpectedPass(f"[XPASS(strict)] {check.id} on {target.name} passed ({len(notes)} notes): "
                             + xpass_text(entries))


def known_text(used: list[Entry]) -> str:
    """What an xfail says: each entry that explains one of the case's failures, its kind, name and reason."""
    return " | ".join(f"{words_for(e)[0]}, {e.name}: {e.reason}" for e in used)


def xpass_text(entries: list[Entry]) -> str:
    """What a pass of a case its entries cover says: none of their failures happened, and what to do."""
    return " | ".join(f"{kind} {e.name} did not happen: {e.reason} -- if {fixed}"
                      for e in entries for kind, fixed in [words_for(e)])
