"""Stored memory ceilings: the file a project keeps its measured ceilings in, and the report's memory
table. No torch here: the pytest plugin reads and writes the file (--update-ceilings) and the
report command prints the table without importing it.

Per device kind a JSON file (`<project>/mpt_kv_ceilings/ceilings-<kind>.json`) maps a key (target
and its implementing package's version, path, dtype, batch, max input, max new, model shape) to the
measured `METRICS` of one memory config (`mpt_kv.checks.ceilings.CONFIGS`). A run fails where a
measurement exceeds its ceiling (cpu: by one byte; allocator devices: by more than `CEILING_SLACK`)
or where the entry is missing; a lower measurement passes and says the ceiling can be tightened.
`pytest --update-ceilings` rewrites the entries that ran and prints the diff; writing a higher
value (loosening) also needs `--allow-looser-ceilings`. A missing or corrupt file is an error, never
a pass. The versions are in the key because a different transformers is a different implementation
(4.55 keeps views, 5.x does not); torch's version is only recorded.

A measurement here is the memory check's `mpt_kv.checks.ceilings.Measurement`, or its dict (a
report's record).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mpt_kv.errors import BaselineError, PropertyFailure
from mpt_kv.versions import installed

SCHEMA = 1
ENV_DIR = "MPT_KV_CEILINGS_DIR"
# A project's own folder, relative to the current directory; the pytest plugin resolves it against
# the project's rootdir (or its ini option mpt_kv_ceilings_dir). This repo's: <repo>/mpt_kv_ceilings.
DEFAULT_DIR = Path("mpt_kv_ceilings")
# How far above its ceiling a measurement may read: cpu is exact; an allocator's peak can move
# by a block when the order of frees changes (1% and a few 512-byte blocks).
CEILING_SLACK = {"cpu": (0.0, 0), "cuda": (0.01, 4 * 512), "hpu": (0.01, 4 * 4096)}
# What a stored ceiling bounds per config (the memory check's `Measurement` fields of these names).
METRICS = ("prefill_retained", "decode_transient", "allocated", "max_allocated")
METRIC_TEXT = {
    "prefill_retained": "bytes allocated after prefill",
    "decode_transient": "largest decode-step peak above the bytes allocated before the step",
    "allocated": "bytes allocated after generation (Memory allocated)",
    "max_allocated": "peak over the generation (Max memory allocated)",
}


@dataclass(frozen=True)
class StoredCeilings:
    """Where a project keeps its memory ceilings, and which targets must have them.

    directory  holds ceilings-<device kind>.json
    required   target names whose missing entries fail ("*": every target). Any target that already
               has an entry in the file must have all of its entries, listed here or not
    update     --update-ceilings: measure only; the plugin writes the file at the end of the run
    """

    directory: Path
    required: tuple[str, ...] = ()
    update: bool = False

    def file(self, kind: str) -> Path:
        return baseline_path(kind, self.directory)

    def requires(self, target: str) -> bool:
        return "*" in self.required or target in self.required


def compare_stored(m, store: StoredCeilings | None, path: str, record=lambda name, value: None) -> list[str]:
    """Compare a measurement with its stored ceiling (notes: where it could be tighter).

    Fail-closed where a ceiling is expected: a corrupt file always, and a missing entry (or
    file) for a target that `store` requires or that already has entries in the file
    (BaselineError: an error, not a property failure). A target never recorded and not
    required rests on the analytic checks; the report says how to record it."""
    if store is None or store.update:
        return []
    file = store.file(m.device)
    entries = load_baseline(file, m.device) if file.exists() or store.requires(m.target) else {}
    key = key_of(m)
    recorded = any(k.split("|", 1)[0].split(" (", 1)[0] == m.target for k in entries)
    if key not in entries and not (recorded or store.requires(m.target)):
        record("mpt_kv_unrecorded", {"target": m.target, "device": m.device, "file": str(file)})
        return []
    failures, notes = compare(m, entries, file)
    if key not in entries:
        raise BaselineError(failures[0])
    if failures:
        raise PropertyFailure("\n".join(failures) + f" [{m.target}, {m.device}, {m.dtype}, {path}]")
    return notes


def baseline_path(kind: str, directory: str | Path | None = None) -> Path:
    """`<dir>/ceilings-<kind>.json`; dir: the argument, else $MPT_KV_CEILINGS_DIR, else ./mpt_kv_ceilings."""
    directory = directory or os.environ.get(ENV_DIR) or DEFAULT_DIR
    return Path(directory) / f"ceilings-{kind}.json"


def key_of(m) -> str:
    """'target (versions)|path|dtype|B-in-new|shape': one ceiling entry."""
    m = m if isinstance(m, dict) else asdict(m)
    c = m["cfg"]
    target = m["target"] + (f" ({m['target_version']})" if m["target_version"] else "")
    path = m["path"] + ("" if m["bucket"] is None else f"+bucket{m['bucket']}")
    shape = f"d{c['d_model']}-h{c['n_heads']}-l{c['n_layers']}-v{c['vocab_size']}-s{c['max_seq_len']}"
    return f"{target}|{path}|{m['dtype']}|B{m['batch']}-in{m['max_input']}-new{m['max_new']}|{shape}"


def load_baseline(path: Path, kind: str) -> dict[str, dict]:
    """The entries of a baseline file; BaselineError saying what is wrong and how to fix it."""
    if not path.exists():
        raise BaselineError(f"memory ceilings baseline {path} does not exist: record it with "
                            f"`pytest --pyargs mpt_kv.conformance -k memory --update-ceilings` and commit it")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BaselineError(f"memory ceilings baseline {path} is corrupt ({type(e).__name__}: {e}); restore it "
                            "from version control, or delete it and re-record with --update-ceilings") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("device") != kind \
            or not isinstance(data.get("entries"), dict):
        raise BaselineError(f"memory ceilings baseline {path} is malformed: expected an object with schema={SCHEMA}, "
                            f"device={kind!r} and 'entries'; restore it or re-record with --update-ceilings")
    for key, entry in data["entries"].items():
        bad = [k for k in METRICS if not isinstance(entry, dict) or type(entry.get(k)) is not int or entry[k] < 0]
        if bad:
            raise BaselineError(f"memory ceilings baseline {path}: entry {key!r} lacks non-negative integer "
                                f"{bad}; restore it or re-record with --update-ceilings")
    return data["entries"]


def exceeded(kind: str, measured: int, ceiling: int) -> bool:
    rel, blocks = CEILING_SLACK.get(kind, (0.01, 4 * 4096))
    return measured > ceiling + rel * ceiling + blocks


def compare(m, entries: dict[str, dict], path: Path) -> tuple[list[str], list[str]]:
    """(failures, notes): measurements above their ceiling or without one; ceilings that could be tighter."""
    m = m if isinstance(m, dict) else asdict(m)
    key = key_of(m)
    if key not in entries:
        same = sorted(k for k in entries if k.split("|", 1)[1] == key.split("|", 1)[1])
        hint = f" (stored for this config: {', '.join(k.split('|')[0] for k in same)})" if same else ""
        return [f"memory ceilings: no entry {key!r} in {path}{hint}: record it with --update-ceilings "
                "and review the diff"], []
    failures, notes = [], []
    for metric in METRICS:
        got, ceiling = m[metric], entries[key][metric]
        if exceeded(m["device"], got, ceiling):
            failures.append(f"memory ceiling exceeded: {metric} ({METRIC_TEXT[metric]}) measured {got} bytes, "
                            f"{got - ceiling} bytes above its ceiling {ceiling} ({key} in {path}); if intended, "
                            "accept it with --update-ceilings --allow-looser-ceilings")
        elif got < ceiling:
            notes.append(f"{key}: {metric} {got} is {ceiling - got} bytes below its ceiling {ceiling} "
                         "(tighten with --update-ceilings)")
    return failures, notes


@dataclass
class Change:
    key: str
    metric: str
    old: int | None
    new: int

    @property
    def kind(self) -> str:
        return "new" if self.old is None else "looser" if self.new > self.old else "tighter"

    def __str__(self) -> str:
        if self.old is None:
            return f"{self.metric} {self.new}"
        return f"{self.metric} {self.old} -> {self.new} ({self.new - self.old:+d}, {self.kind})"


def diff_lines(changes: list[Change]) -> list[str]:
    """One line per entry: '+' new, '-' tighter, '!' looser (any metric)."""
    by_key: dict[str, list[Change]] = {}
    for c in changes:
        by_key.setdefault(c.key, []).append(c)
    lines = []
    for key, cs in by_key.items():
        mark = "+" if cs[0].kind == "new" else "!" if any(c.kind == "looser" for c in cs) else "-"
        lines.append(f"  {mark} {key}  " + ", ".join(map(str, cs)))
    return lines


def update_baseline(path: Path, kind: str, measured: list[dict], allow_looser: bool) -> tuple[list[Change], list[Change]]:
    """Merge measurements into the baseline file: (written changes, refused loosenings).

    Entries that did not run are kept. A key measured more than once keeps its largest value.
    Without `allow_looser`, an entry whose new value exceeds its stored one keeps its old values
    (all metrics of it), and its changes are returned as refused. A corrupt file is not
    overwritten (BaselineError); a missing one is created."""
    entries = load_baseline(path, kind) if path.exists() else {}
    new: dict[str, dict] = {}
    for m in measured:
        k, vals = key_of(m), {metric: m[metric] for metric in METRICS}
        new[k] = {metric: max(v, new.get(k, {}).get(metric, 0)) for metric, v in vals.items()}
        new[k]["torch"] = str(m.get("torch") or installed("torch"))  # the memory check records torch's version
    written, refused = [], []
    merged = dict(entries)
    for k, vals in sorted(new.items()):
        old = entries.get(k)
        changes = [Change(k, metric, None if old is None else old[metric], vals[metric]) for metric in METRICS
                   if old is None or old[metric] != vals[metric]]
        if any(c.kind == "looser" for c in changes) and not allow_looser:
            refused += changes
            continue
        written += changes
        merged[k] = vals
    if written or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"schema": SCHEMA, "device": kind,
                "about": "memory ceilings (bytes above the level before a generation) per config; "
                         "see mpt_kv/checks/ceilings.py and docs/memory-model.md. Rewrite with pytest --update-ceilings.",
                "entries": dict(sorted(merged.items()))}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)  # atomic: a crash never leaves half a file
    return written, refused


# --- the report ------------------------------------------------------------------------------------

def kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def table(records: list[dict]) -> list[str]:
    """The seed PR's memory columns, per target, path and config (KiB, weights included as in the seed)."""
    head = (f"{'target':<22} {'device':<6} {'dtype':<8} {'path':<14} {'batch':>5} {'max input':>9} {'max new':>7} | "
            f"{'Memory allocated':>16} {'Max memory allocated':>20} | {'KV cache':>8} {'analytic min':>12} | "
            f"{'prefill excess':>14} | outcome")
    lines = [head]
    for r in sorted(records, key=lambda r: (r["target"], r["device"], r["dtype"], r["path"], r["bucket"] or 0,
                                            r["batch"], r["max_input"], r["max_new"])):
        target = r["target"] + (f" {r['target_version'].split(', ')[0].split(' ')[-1]}" if r["target_version"] else "")
        path = r["path"] + ("" if r["bucket"] is None else f"+b{r['bucket']}")
        w = r["weights"]
        lines.append(f"{target:<22} {r['device']:<6} {r['dtype']:<8} {path:<14} {r['batch']:>5} {r['max_input']:>9} "
                     f"{r['max_new']:>7} | {kib(w + r['allocated']):>16} {kib(w + r['max_allocated']):>20} | "
                     f"{kib(r['kv_bytes']):>8} {kib(w + r['kv_analytic']):>12} | "
                     f"{excess_text(r.get('prefill_excess')):>14} | {r.get('outcome', '?')}")
    lines.append("  KiB. Memory allocated: weights + what the generation still holds after its last step; Max memory "
                 "allocated: weights + its peak; KV cache: the live storages of the cache at the end; analytic min: "
                 "weights + 2 x layers x B x H x (input + new) x hd x itemsize, the least Memory allocated can be; "
                 "prefill excess: what the prefill retained beyond its analytic cache and bookkeeping (a cache that "
                 "pins mixed_qkv shows it here even when the first decode step copies it away and Memory allocated "
                 "reads the same as the fixed model's).")
    return lines


def excess_text(n: int | None) -> str:
    """+KiB beyond the analytic cache after prefill ('0.0' for none; '-' for a report without it)."""
    return "-" if n is None else ("+" if n > 0 else "") + kib(n)
