"""Reach: which values of every knob a run's cases took, per check, beside a real model's values.

Like a coverage report for the input space: a bug that shows only past the drawn ranges (a batch
of 8, 32 heads, prompts past 128, alibi_bias_max 16) passes every check that never gets there, so
the report says how far each check got.

    knobs(case, path, bucket, device, dtype)  # one case's values (registry.Check records them as
                                              # "mpt_kv_reach": {"check": id, "knobs": {...}})
    summary = summarize(records)              # knob -> {"overall": stats, "by_check": {id: stats}}
    print("\\n".join(table_lines(summary, load_reference_model())))

stats: {"min", "max" (numeric knobs), "values" (the distinct values, sorted, at most
`MAX_VALUES`), "distinct", "cases"}. The reference model is a JSON file of a real config's values
(default: mpt-7b's, `mpt_kv/data/mpt-7b.json`); a project names its own with
`load_reference_model(path)` (the plugin: its ini option `mpt_kv_reference_model`).

Print a run's table: `python -m mpt_kv reach [--reference-model FILE] reports/conformance.json`
(the report's "reach" records), or `--draw PROFILE` for the draws of a profile without running any
model (`mpt_kv.checks.registry.drawn_records`). The family checks' cases record theirs too
(`FamilyReach`: the design edges their program reached, measured from its calls and the cache's
lengths), in a table of their own under the MPT one (`family_table_lines`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Iterable

from mpt_kv import package_data
from mpt_kv.checks import index

DEFAULT_REFERENCE_MODEL = package_data.MPT_7B_CONFIG
MAX_VALUES = 8
FAMILY_MAX_VALUES = 24  # the family tables list every family (docs/families.md's block: the zoo's with edges)

# The knobs, in table order, with what a real model's config calls them (None: not a config field;
# the reference model file may still give a value, e.g. a serving batch).
KNOBS = ("batch", "padding", "n_layers", "n_heads", "head_dim", "d_model", "prompt_len", "new_tokens",
         "tokens_per_call", "operation", "total_len", "max_seq_len", "bucket", "path", "mask_dtype", "dtype", "clip_qkv",
         "alibi_bias_max", "layer_norm_epsilon", "vocab_size")
NON_NUMERIC = ("path", "mask_dtype", "dtype", "clip_qkv", "bucket", "operation")
TEXT = {"padding": "left padding (longest - shortest row)", "tokens_per_call": "tokens per cached call"}


def knobs(case, path: str | None = None, bucket: int | None = None, device=None, dtype=None) -> dict:
    """The values one case takes (a `properties.Case`, its cache path, bucket and dtype)."""
    c = case.cfg
    out = dict(batch=case.batch, padding=case.prompt_len - min(case.prompt_lens), n_layers=c.n_layers,
               n_heads=c.n_heads, head_dim=c.head_dim, d_model=c.d_model, prompt_len=case.prompt_len,
               new_tokens=case.new_tokens, total_len=case.total_len, max_seq_len=c.max_seq_len,
               bucket=bucket, path=path or "uncached",
               mask_dtype=str(case.mask_dtype).replace("torch.", ""), clip_qkv=c.clip_qkv,
               alibi_bias_max=c.alibi_bias_max, layer_norm_epsilon=c.layer_norm_epsilon, vocab_size=c.vocab_size)
    if dtype is not None:
        out["dtype"] = str(dtype).replace("torch.", "")
    tokens = getattr(case, "tokens_per_call", None)  # k-token cached calls, where a Case carries them
    if tokens is not None:
        out["tokens_per_call"] = tokens
    return out


def _order(v):
    """Numbers first (by value), then text, then None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, v, "")
    return (2, 0, "") if v is None else (1, 0, str(v))


def _stats(values: list, max_values: int = MAX_VALUES) -> dict:
    distinct = sorted(set(values), key=_order)
    out = {"cases": len(values), "distinct": len(distinct), "values": distinct[:max_values]}
    numbers = [v for v in values if _order(v)[0] == 0]
    if numbers:
        out["min"], out["max"] = min(numbers), max(numbers)
    return out


def summarize(records: Iterable[dict], max_values: int = MAX_VALUES) -> dict:
    """{knob: {"overall": stats, "by_check": {check id: stats}}} over "mpt_kv_reach" records
    ({"check": id, "knobs": {...}}); knobs no record has are left out."""
    by_knob: dict[str, dict[str, list]] = {}
    for r in records:
        if not isinstance(r, dict) or not isinstance(r.get("knobs"), dict) or "check" not in r:
            raise ValueError(f"reach record {r!r}: expected {{'check': id, 'knobs': {{...}}}}")
        for knob, value in r["knobs"].items():
            by_knob.setdefault(knob, {}).setdefault(r["check"], []).append(value)
    order = {k: i for i, k in enumerate(KNOBS)}
    out = {}
    for knob in sorted(by_knob, key=lambda k: (order.get(k, len(order)), k)):
        checks = by_knob[knob]
        out[knob] = {"overall": _stats([v for vs in checks.values() for v in vs], max_values),
                     "by_check": {check: _stats(vs, max_values) for check, vs in sorted(checks.items())}}
    return out


def load_reference_model(path: str | Path | None = None) -> dict:
    """A real model's values ({"name", "source", "values": {knob: value or [values]}}); default mpt-7b's."""
    path = Path(path or DEFAULT_REFERENCE_MODEL)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"reference model file {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("values"), dict):
        raise ValueError(f"reference model file {path}: expected an object with 'name' and 'values' "
                         "({knob: value or [values]})")
    unknown = sorted(set(data["values"]) - set(KNOBS))
    if unknown:
        raise ValueError(f"reference model file {path}: unknown knobs {unknown}; known: {list(KNOBS)}")
    for knob, value in data["values"].items():
        check_knob_value(path, knob, value)
    return data


def check_knob_value(path, knob: str, value) -> None:
    """A numeric knob's value is a finite number >= 0 or a list of them ("batch": "lots" would be
    compared as text, so the table's range would be nonsense); a NON_NUMERIC knob takes any."""
    if knob in NON_NUMERIC:
        return
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"reference model file {path}: {knob}={value!r}: expected a number >= 0 or a list of them")


def _range(stats: dict | None) -> str:
    if not stats:
        return "-"
    numeric = "min" in stats and all(_order(v)[0] == 0 for v in stats["values"])
    if numeric and stats["distinct"] > 3:
        text = f"{stats['min']:g}-{stats['max']:g}"
    else:
        text = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in stats["values"])
        if stats["distinct"] > len(stats["values"]):
            text += ", ..."
    return f"{text} ({stats['distinct']})"


def _real(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def group_of(check: str) -> str:
    """A check's column in the table: its property ("P1/static/bucket-128" -> "P1"); the path and
    bucket are knobs of their own."""
    return check.split("/")[0]


def grouped(summary: dict, max_values: int = MAX_VALUES) -> dict:
    """{knob: {group: stats}}: the summary's checks merged into their groups (`group_of`)."""
    out = {}
    for knob, data in summary.items():
        groups: dict[str, list] = {}
        for check, stats in data["by_check"].items():
            groups.setdefault(group_of(check), []).append(stats)
        out[knob] = {g: _merge(ss, max_values) for g, ss in groups.items()}
    return out


def _merge(stats: list[dict], max_values: int = MAX_VALUES) -> dict:
    """Stats of several checks as one (distinct: exact while every check listed all its values)."""
    values = sorted({v for s in stats for v in s["values"]}, key=_order)
    complete = all(s["distinct"] == len(s["values"]) for s in stats)
    out = {"cases": sum(s["cases"] for s in stats),
           "distinct": len(values) if complete else max(len(values), *(s["distinct"] for s in stats)),
           "values": values[:max_values]}
    mins = [s["min"] for s in stats if "min" in s]
    if mins:
        out["min"], out["max"] = min(mins), max(s["max"] for s in stats if "max" in s)
    return out


def table_lines(summary: dict, reference_model: dict | None = None) -> list[str]:
    """The reach table: a row per knob, the overall range, the real model's value, then per check
    group (P0, P1/concat, ..., memory) the range reached: 'min-max (distinct values)' or the values."""
    if not summary:
        return ["reach: no case recorded its knobs (nothing ran?)"]
    reference_model = reference_model or {"name": "reference model", "values": {}}
    groups = sorted({g for knob in grouped(summary).values() for g in knob}, key=_group_order)
    by_group = grouped(summary)
    head = ["knob", "this run", reference_model["name"], *groups]
    rows = [[knob, _range(data["overall"]), _real(reference_model["values"].get(knob)),
             *(_range(by_group[knob].get(g)) for g in groups)] for knob, data in summary.items()]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    cases = sum(s["cases"] for s in by_group.get("batch", {}).values())
    lines.append(f"range (distinct values) per knob over {cases} cases; {reference_model['name']}: "
                 f"{reference_model.get('source', 'its config')}")
    return lines


def _group_order(g: str):
    order = index.NAMES  # the index's order of properties
    head = g.split("/")[0]
    return (order.index(head) if head in order else len(order), g)


# --- the family checks' reach: what each family case's program reached of its design's edges ----------------
#
# A family check drives a fixed program (prefill, decodes, a k-token call, crops, reorders:
# mpt_kv.checks.family_driver), so its knobs are not drawn; what varies is how far that program gets
# into each design: whether a window is shorter than the prompt, crossed by a decode or by a k-token
# call, whether a crop goes back past where a window had slid, what the cache holds. `FamilyReach`
# follows one case's calls as they are made (the positions from each call's own arguments, the
# cache's lengths from its kv() tensors after each call, the routers' outputs) and gives the case's
# records ("mpt_kv_reach", as the MPT cases': the run layer records them, `Run.family_case`).

# table order; the "edge: ..." knobs' value is the family that reached the edge (a table cell lists them)
FAMILY_KNOBS = ("family", "implementation", "variant", "path", "dtype", "device", "batch", "n_layers", "n_heads", "kv_heads",
                "head_dim", "prompt_len", "total_len", "operation", "tokens_per_call", "window",
                "window_tokens_held", "latent_rank", "cached_width", "kv_heads_cached", "experts",
                "experts_per_token", "routed_tokens_per_row")
WINDOW_PROMPT = "edge: a window shorter than the prompt"
WINDOW_DECODE = "edge: a window crossed during decode"
WINDOW_EXTEND = "edge: a window crossed by a k-token cached call"
WINDOW_CROP = "edge: a crop back across a window's edge"
WINDOW_NEVER = "edge: a window never crossed"
WINDOW_DROPPED = "edge: a window layer's cache dropped positions"
LATENT = "edge: a latent smaller than the head dim"
MIXED_HEADS = "edge: layers with different K/V heads in one cache"
EXPERTS = "edge: fewer experts per token than experts"
ROUTING = "edge: a cached call routes only its new tokens"
EDGES = (WINDOW_PROMPT, WINDOW_DECODE, WINDOW_EXTEND, WINDOW_CROP, WINDOW_NEVER, WINDOW_DROPPED, LATENT, MIXED_HEADS,
         EXPERTS, ROUTING)
# what the cache itself holds (its kv() tensors): differs across transformers releases (4.x keeps a local
# layer's whole history and DeepSeek's expanded K/V), so docs/families.md's block leaves these to a run's table
CACHE_MEASURED = ("window_tokens_held", "cached_width", "kv_heads_cached", WINDOW_DROPPED)
CACHED_CALLS = ("decode", "extend")


class FamilyReach:
    """One family case's reach, observed as its program runs (module comment above).

    knobs: the case's fixed knobs (family, implementation, variant, path, dtype, layers, heads, ...);
    windows: each caching layer's window (None: global); latent_rank: the latent's rank where the
    layers cache a latent, else None; head_dim: the q/k head dim it is compared with.

    The driver calls `calling(operation, count)` before and `called(operation, count, kv)` after
    each call of the implementation's session, count the call's own size (prefill: the prompt's
    positions; decode, extend: the new tokens per row; crop: the length cropped to; reorder: None)
    and kv the (layer, shape) of each tensor kv() returned after it (None: kv() could not be read,
    its reason in `unreadable`); a router's forward hook calls `routed(tokens, experts, top_k)`."""

    def __init__(self, knobs: dict, windows=(), latent_rank: int | None = None, head_dim: int | None = None):
        self.knobs = dict(knobs)
        self.windows = list(windows)
        self.latent_rank, self.head_dim = latent_rank, head_dim
        self.positions = 0
        self.calls: list[tuple[str, int, int, int | None]] = []  # (operation, positions before, after, count)
        self.window_held: list[int] = []  # a window layer's position axis after each call
        self.dropped = False              # a window layer's cache held fewer positions than were written
        self.widths: list[int] = []       # elements per token per layer the cache held
        self.heads: dict[int, int] = {}   # layer -> the K/V heads its cached tensors hold (their axis 1)
        self.routing: list[tuple[str | None, int | None, int, int, int | None]] = []
        self.unreadable: str | None = None
        self._current: tuple[str, int | None] | None = None

    def calling(self, operation: str, count: int | None = None) -> None:
        self._current = (operation, count)

    def called(self, operation: str, count: int | None, kv) -> None:
        before = self.positions
        if operation == "prefill" or operation == "crop":
            self.positions = count
        elif operation in CACHED_CALLS:
            self.positions += count
        self.calls.append((operation, before, self.positions, count))
        self._current = None
        if kv is None:
            return
        by_layer: dict[int, int] = {}
        for layer, shape in kv:
            if len(shape) != 4:  # (batch, heads, positions, dim) only: another layout's axes are not guessed
                continue
            self.heads[layer] = shape[1]
            tokens = shape[-2]
            if layer < len(self.windows) and self.windows[layer] is not None:
                self.window_held.append(tokens)
                self.dropped |= tokens < self.positions and self.knobs.get("path") == "concat"
            elif tokens:
                by_layer[layer] = by_layer.get(layer, 0) + shape[1] * shape[3]
        self.widths += by_layer.values()

    def routed(self, tokens: int, experts: int, top_k: int | None) -> None:
        operation, count = self._current or (None, None)
        self.routing.append((operation, count, tokens, experts, top_k))

    def window_edges(self) -> set[str]:
        edges = set()
        for w in {w for w in self.windows if w is not None}:
            crossed = False
            for operation, before, after, _ in self.calls:
                # a window slides once a query sees fewer than all the positions before it: more than w written
                if operation == "prefill" and after > w:
                    edges.add(WINDOW_PROMPT)
                elif operation in CACHED_CALLS and before <= w < after:
                    edges.add(WINDOW_DECODE if operation == "decode" else WINDOW_EXTEND)
                elif operation == "crop" and before > w and after < before:
                    edges.add(WINDOW_CROP)  # the window had slid: the crop needs back positions it had left
                crossed |= after > w
            if self.calls and not crossed:
                edges.add(WINDOW_NEVER)
        if self.dropped:
            edges.add(WINDOW_DROPPED)
        return edges

    def records(self, batch: int) -> list[dict]:
        """The case's knobs, then one record per cached operation (its kind and tokens per call), as a
        program check's (`program_knobs`)."""
        out = dict(self.knobs, batch=batch)
        if self.calls:
            out["prompt_len"] = next((after for op, _, after, _ in self.calls if op == "prefill"), None)
            out["total_len"] = max(after for _, _, after, _ in self.calls)
        windows = [w for w in self.windows if w is not None]
        if windows:
            out["window"] = min(windows)
        if self.window_held:
            out["window_tokens_held"] = max(self.window_held)
        if self.latent_rank is not None:
            out["latent_rank"] = self.latent_rank
        if self.widths and (self.latent_rank is not None):
            out["cached_width"] = max(self.widths)
        if self.heads and self.latent_rank is None:
            out["kv_heads_cached"] = per_layer_text([self.heads[layer] for layer in sorted(self.heads)])
        if self.routing:
            out["experts"] = max(e for *_, e, _ in self.routing)
            ks = [k for *_, k in self.routing if k is not None]
            if ks:
                out["experts_per_token"] = max(ks)
            cached = [(tokens, count) for op, count, tokens, _, _ in self.routing if op in CACHED_CALLS and count]
            if cached:
                out["routed_tokens_per_row"] = max(tokens // (batch * count) for tokens, count in cached)
        if self.unreadable:
            out["kv_unreadable"] = self.unreadable
        family = self.knobs.get("family")
        edges = self.window_edges()
        if self.latent_rank is not None and self.head_dim and self.latent_rank < self.head_dim and self.calls:
            edges.add(LATENT)
        if self.latent_rank is None and len(set(self.heads.values())) > 1:
            edges.add(MIXED_HEADS)
        if any(k is not None and k < e for *_, e, k in self.routing):
            edges.add(EXPERTS)
        cached = [(tokens, count) for op, count, tokens, _, _ in self.routing if op in CACHED_CALLS]
        if cached and all(count and tokens == batch * count for tokens, count in cached):
            edges.add(ROUTING)
        out.update({edge: family for edge in sorted(edges, key=EDGES.index)})
        ops = [{"operation": op, "tokens_per_call": count if op == "extend" else 1}
               for op, _, _, count in self.calls if op not in ("prefill", "decode")]
        return [out, *ops]


def family_doc_lines(records: list[dict]) -> list[str]:
    """docs/families.md's block: the family table of `registry.family_program_records`, less the rows of
    what the cache itself held (CACHE_MEASURED: a run's own table has them), so the block is the same
    under every transformers release the envs pin."""
    summary = summarize(records, FAMILY_MAX_VALUES)
    return family_table_lines(summary, rows=[k for k in summary if k not in CACHE_MEASURED])


def per_layer_text(values: list) -> int | str:
    """One value for every layer as itself, else each layer's ("4, 2, 1"): a knob's value is one cell."""
    return values[0] if len(set(values)) == 1 else ", ".join(map(str, values))


def is_family_record(record: dict) -> bool:
    return str(record.get("check", "")).startswith("family-")


def family_table_lines(summary: dict, rows=None) -> list[str]:
    """The family checks' reach table: a row per knob and edge (`rows`: only those), the overall range,
    then per family check the range reached (an edge's cell: the families that reached it)."""
    if not summary:
        return ["reach: no family case recorded its knobs (nothing ran?)"]
    by_group = grouped(summary, FAMILY_MAX_VALUES)
    groups = sorted({g for knob in by_group.values() for g in knob}, key=_group_order)
    head = ["knob or edge", "this run", *groups]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {k: i for i, k in enumerate(FAMILY_KNOBS + EDGES)}
    for knob, data in sorted(summary.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])):
        if rows is None or knob in rows:
            lines.append("| " + " | ".join([knob, _range(data["overall"]),
                                            *(_range(by_group[knob].get(g)) for g in groups)]) + " |")
    cases = sum(s["cases"] for s in by_group.get("family", {}).values())
    lines.append(f"range (distinct values) per knob over {cases} family cases; an edge's cell: the families whose "
                 "program reached it")
    return lines


def main(argv=None) -> int:
    """A report's reach table (`python -m mpt_kv reach REPORT.json` does this and the draws)."""
    ap = argparse.ArgumentParser(prog="python -m mpt_kv.checks.reach", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="a JSON report with a 'reach' list of records")
    ap.add_argument("--reference-model", help=f"a real model's values (default {DEFAULT_REFERENCE_MODEL.name})")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.report).read_text())
    records = data.get("reach") if isinstance(data, dict) else None
    if not records:
        print(f"{args.report}: no 'reach' records (a run without reach recording, or nothing ran)", file=sys.stderr)
        return 1
    print("\n".join(report_lines(records, load_reference_model(args.reference_model))))
    return 0


def report_lines(records: list[dict], reference_model: dict | None = None) -> list[str]:
    """A run's reach: the MPT checks' table (beside the reference model), then the family checks' table."""
    mpt = [r for r in records if not is_family_record(r)]
    family = [r for r in records if is_family_record(r)]
    lines = table_lines(summarize(mpt), reference_model) if mpt else []
    if family:
        lines += ([""] if lines else []) + ["family checks:"] + family_table_lines(summarize(family, FAMILY_MAX_VALUES))
    return lines


if __name__ == "__main__":
    sys.exit(main())
