"""The summaries of one or several runs (one per environment: measure.py) as tables, and the floors they hold.

    summaries = load(paths)            # SummaryError (a usage error of the command) names a bad file
    group_lines(summaries)             # one row per release and group (selection.SOURCES): functions entered,
                                       # lines and branches executed, the HPU-only lines, the floor
    file_lines(summaries)              # one row per file
    never_entered_lines(summaries)     # every selected function never entered, with its reason
    floor_problems(summaries)          # a group under its floor, a group without one, a floor with no group

A row's figures are sums over its functions (a function with no statement is left out: nothing of it can run).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mpt_kv.errors import SummaryError
from mpt_kv.upstream import selection as S
from mpt_kv.upstream.measure import FORMAT
from mpt_kv.upstream.source import REASONS


def load(paths) -> list[dict]:
    """The summaries, checked: each file a summary, and no file measured twice (one summary per environment)."""
    out, seen = [], {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise SummaryError(f"{path}: {e}") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise SummaryError(f"{path}: not a summary of `python -m mpt_kv run --coverage` (no \"format\": {FORMAT!r})")
        for f in data["files"]:
            key = (f["release"], f["path"])
            if key in seen:
                raise SummaryError(f"{path} and {seen[key]} both measure {f['release']} {f['path']}: give one summary "
                                   f"per environment")
            seen[key] = path
        out.append(data)
    return out


@dataclass
class Row:
    """Sums over the functions of some files."""

    files: int = 0
    functions: int = 0
    entered: int = 0
    lines: int = 0
    executed: int = 0
    branches: int = 0
    taken: int = 0
    hpu_only: int = 0

    def add(self, f: dict) -> "Row":
        self.files += 1
        for fn in counted(f):
            self.functions += 1
            self.entered += fn["reason"] is None
            self.executed += fn["lines"][0]
            self.lines += fn["lines"][1]
            self.taken += fn["branches"][0]
            self.branches += fn["branches"][1]
            self.hpu_only += fn["hpu_only"]
        return self

    @property
    def line_percent(self) -> float:
        return percent(self.executed, self.lines)

    @property
    def branch_percent(self) -> float:
        return percent(self.taken, self.branches)

    @property
    def cpu_percent(self) -> float:
        """Lines executed of those that can run without an HPU."""
        return percent(self.executed, self.lines - self.hpu_only)


def percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 100.0


def counted(f: dict) -> list[dict]:
    return [fn for fn in f["functions"] if fn["lines"][1] > 0]


def cell(part: int, whole: int) -> str:
    return f"{part}/{whole} ({percent(part, whole):.1f}%)"


def minor(release: str) -> str:
    """"transformers 5.24" of "transformers 5.24.0"."""
    name, _, version = release.rpartition(" ")
    return f"{name} {'.'.join(version.split('.')[:2])}"


def group_key(f: dict) -> str:
    """The floors' key of a file's group: "transformers 5.24 cache_utils"."""
    return f"{minor(f['release'])} {f['group']}"


def files_of(summaries) -> list[dict]:
    """Every file of the summaries: a summary's (an environment's) together, in the order given, each in SOURCES'
    order, then by path."""
    order = {s.group: i for i, s in enumerate(S.SOURCES)}
    return [f for s in summaries for f in sorted(s["files"], key=lambda f: (order.get(f["group"], len(order)), f["path"]))]


def groups(summaries) -> dict[str, tuple[dict, Row]]:
    """group key -> (its first file, the row of its files)."""
    out: dict[str, tuple[dict, Row]] = {}
    for f in files_of(summaries):
        first, row = out.setdefault(group_key(f), (f, Row()))
        row.add(f)
    return out


def group_lines(summaries) -> list[str]:
    lines = ["| release | group (files) | functions entered | lines executed | branches taken | HPU-only lines | "
             "lines without them | never entered: needs an HPU / an option never set / not driven | floor: lines, branches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, (first, row) in groups(summaries).items():
        floor = S.FLOORS.get(key)
        kinds = reason_counts(f for f in files_of(summaries) if group_key(f) == key)
        name = first["group"] + (f" ({row.files} files)" if row.files > 1 else f": {first['path']}")
        lines.append(f"| {first['release']} | {name} | {row.entered}/{row.functions} | {cell(row.executed, row.lines)} | "
                     f"{cell(row.taken, row.branches)} | {row.hpu_only} | {row.cpu_percent:.1f}% | "
                     f"{' / '.join(str(kinds[k]) for k in REASONS)} | "
                     f"{'%d%%, %d%%' % floor if floor else 'none'} |")
    return lines


def reason_counts(files) -> dict[str, int]:
    out = dict.fromkeys(REASONS, 0)
    for f in files:
        for fn in counted(f):
            if fn["reason"]:
                out[fn["reason"].split(":", 1)[0]] += 1
    return out


def file_lines(summaries) -> list[str]:
    lines = ["| release | file | functions entered | lines executed | branches taken | HPU-only lines |",
             "|---|---|---|---|---|---|"]
    for f in files_of(summaries):
        row = Row().add(f)
        lines.append(f"| {f['release']} | {f['path']} | {row.entered}/{row.functions} | {cell(row.executed, row.lines)} | "
                     f"{cell(row.taken, row.branches)} | {row.hpu_only} |")
    return lines


def never_entered_lines(summaries) -> list[str]:
    lines = []
    for f in files_of(summaries):
        missed = [fn for fn in counted(f) if fn["reason"]]
        if missed:
            lines.append(f"{f['release']} {f['path']}: {len(missed)} of {len(counted(f))} functions never entered")
            lines += [f"  {fn['name']} (line {fn['line']}, {fn['lines'][1]} lines): {fn['reason']}" for fn in missed]
    return lines


def floor_problems(summaries) -> list[str]:
    """What fails the floors: a group below its floor, a group with no floor (a new release's rows need theirs),
    a floor whose group the summaries do not have (a summary missing, or a file no longer selected)."""
    out, found = [], groups(summaries)
    for key, (_, row) in found.items():
        floor = S.FLOORS.get(key)
        if floor is None:
            out.append(f"{key}: no floor in mpt_kv/upstream/selection.py FLOORS (lines {row.line_percent:.1f}%, "
                       f"branches {row.branch_percent:.1f}% measured)")
        elif row.line_percent < floor[0] or row.branch_percent < floor[1]:
            out.append(f"{key}: lines {row.line_percent:.1f}%, branches {row.branch_percent:.1f}%: below its floor of "
                       f"{floor[0]}% and {floor[1]}%")
    out += [f"{key}: a floor, but no summary measures that group" for key in S.FLOORS if key not in found]
    return out


def profiles(summaries) -> set:
    return {s.get("hypothesis_profile") for s in summaries}
