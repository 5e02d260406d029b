"""The index of checks: every property named once, with what the rest of mpt-kv needs to know of it.

    from mpt_kv.checks.index import PROPERTIES, by_name

Read by the registry (which check ids a property has: `mpt_kv.checks.registry`), the run layer
(which function checks it and how its cases come: `mpt_kv.checks.running`), the pytest plugin (the
matrix's columns and legend, which properties count as a cache check for the gate), the kill matrix
and the catalogue (their columns), the reach table (its column order) and the known-failures files
(which properties an entry may name). No torch here: the plugin reads it before a worker's card is
pinned, so a property's function is named by its dotted path, not imported.

A new check is three files: its function (`fn(runner, c) -> notes`, where `c` is a
`mpt_kv.checks.cases.Context`; a family check's a `mpt_kv.checks.family_driver.FamilyContext`), its
row below, and a catalogue variant it kills (`mpt_kv/catalogue/variants.py`, naming the row's
`column`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpt_kv import recipes as recipe_paths

BUCKET = 4          # the value and shape checks' cache_idx bucket: with 5 + 6 tokens, bucketed decode crosses a boundary
MEMORY_BUCKET = 8   # the memory checks' bucket (mpt_kv.checks.ceilings.CONFIGS)
# Path labels: "concat", "static", "static+bucket" (the static path with cache_idx buckets; the run
# layer picks the bucket: `BUCKET` for values and shapes, `MEMORY_BUCKET` for memory), "" (uncached).
ALL_PATHS = ("concat", "static", "static+bucket")
STATIC_PATHS = ("static", "static+bucket")
# static+reuse: the static path with reuse_cache; "<base>@<recipe>": one of optimum-habana's text-generation
# recipes on that path (mpt_kv/recipes.py: the flags of its command line, on the ports that document it)
FAMILY_PATHS = ("concat", "static", "static+reuse") + recipe_paths.PATHS
# the generate checks' modes (mpt_kv.checks.generate_driver): a check id each per path, generate/<path>/<mode>
GENERATE_MODES = ("greedy", "beam", "prompt-lookup", "draft", "chunked", "contrastive", "constrained", "multi-turn")
# the generate checks' paths: generate's dynamic cache and its static one on every target; on optimum-habana's
# ports also its reuse_cache and each text-generation recipe's flags (mpt_kv/recipes.py), as generate takes them
GENERATE_PATHS = ("concat", "static", "static+reuse") + recipe_paths.PATHS


@dataclass(frozen=True)
class Property:
    """One property.

    name      its id's first part, its column in the matrix ("P1", "ops-P3", "family-memory")
    title     the matrix's legend for it
    line      what fails it, in one line (the README's table)
    doc       the doc that says more
    function  `module:function` that checks one case
    runs      how its cases come (the run layer's drivers): "case" (drawn cases, fixed edge cases and
              a run under graphs), "fixed" (one fixed case), "memory" (the memory configs), "program"
              (fixed and drawn programs of cache operations), "operation" (one operation on a filled
              cache), "family" (a family variant of another decoder family, on an implementation),
              "generate" (the implementation's own generate, each mode of `operations`, on an MPT target or
              a family target alike)
    paths     the paths it runs on (a check id per path; "" = uncached)
    edges     the paths its fixed edge cases run on (`edge_set` of them: strategies.EDGE_CASES or P3_EDGES)
    graphs    it also runs with the target under graphs (HPU, CUDA; on CPU a stand-in), static path
    oracle    what it compares with besides the target itself (the run layer builds it): "reference"
              (the reference in float32 from the rounded weights), "twin" (in a lower precision: the
              same target in float32 from the rounded weights), None
    cache     it checks a cache (its values, storages, shapes, memory or operations on a cache path):
              a green run must have one per target (`mpt_kv.plugin.gate`); P0 and P4 check the uncached
              forward and the returned outputs
    column    its kill-matrix and catalogue column (None: not in the kill matrix)
    operations  the operations of a check whose cases come one operation at a time ("operation"), or the
              modes of a generate check ("generate"): a check id each (ops-memory/concat/reorder,
              generate/concat/beam, ...)
    """

    name: str
    title: str
    line: str
    doc: str
    function: str
    runs: str
    paths: tuple[str, ...] = ALL_PATHS
    edges: tuple[str, ...] = ()
    edge_set: str = "EDGE_CASES"
    graphs: bool = False
    oracle: str | None = None
    cache: bool = True
    column: str | None = None
    operations: tuple[str, ...] = ()

    @property
    def family(self) -> bool:
        return self.runs == "family"


PROPERTIES: tuple[Property, ...] = (
    Property("P0", "oracle", "uncached logits differ from the reference (same weights)", "docs/value-checks.md",
             "mpt_kv.checks.properties:check_oracle", "case", paths=("",), edges=("",), oracle="reference", cache=False,
             column="P0"),
    Property("P1", "cached=uncached", "a prefill or decode step's logits differ from the target's own uncached "
             "forward, in three generations back to back", "docs/value-checks.md",
             "mpt_kv.checks.properties:check_cached_equals_uncached", "case", edges=ALL_PATHS, graphs=True,
             oracle="twin", column="P1"),
    Property("P2", "static=concat", "the static path's logits or written K/V differ from the concat path; "
             "never-written slots are poisoned", "docs/value-checks.md",
             "mpt_kv.checks.properties:check_static_equals_concat", "case", STATIC_PATHS, edges=("static",),
             graphs=True, oracle="twin", column="P2"),
    Property("P3", "no aliasing", "a cached key or value pins storage beyond the cache (a view of mixed_qkv or of a "
             "per-step temporary), naming layer, tensor and bytes", "docs/catalogues.md#p3-what-a-cached-tensor-may-keep-alive",
             "mpt_kv.checks.properties:check_no_aliasing", "case", edges=ALL_PATHS, edge_set="P3_EDGES",
             column="P3"),
    Property("P4", "outputs not reused", "a returned tensor changes when the target runs again, undeclared",
             "docs/value-checks.md#p4-outputs-not-reused", "mpt_kv.checks.properties:check_outputs_not_reused", "case", graphs=True,
             cache=False, column="P4"),
    Property("memory", "memory ceilings", "retained bytes above the analytic KV cache, a decode step above its "
             "transient bound, a leak, a stored ceiling passed", "docs/memory-model.md#the-memory-checks",
             "mpt_kv.checks.ceilings:check_memory", "memory", column="memory"),
    Property("static-shape", "static shapes", "a static decode step changes a shape handed to attention, moves a "
             "cache storage or makes a host sync (what graphs need)", "docs/checks.md",
             "mpt_kv.checks.static_shape:check_static_shape", "fixed", STATIC_PATHS, column="static-shape"),
    Property("graph-capture", "static decode captured as one graph", "torch.compile(fullgraph=True) breaks the "
             "static decode step's graph, recompiles it between steps, reads a device value in it or differs from "
             "eager (on CUDA also its CUDA graph replay)", "docs/checks.md#graph-capture",
             "mpt_kv.checks.capture:check_graph_capture", "fixed", ("static",), column="graph-capture"),
    Property("ops-P1", "P1 over programs of decode/extend/crop/reorder", "after a k-token extend, a crop or a beam "
             "reorder, the logits differ from an uncached forward over each row's surviving history",
             "docs/operations.md", "mpt_kv.checks.operations:check_program_cached", "program", oracle="twin", column="ops"),
    Property("ops-P2", "P2 over programs", "static and concat disagree after the same program of operations",
             "docs/operations.md", "mpt_kv.checks.operations:check_program_static_concat", "program", STATIC_PATHS,
             oracle="twin", column="ops"),
    Property("ops-P3", "P3 over programs", "after a crop or a reorder a cached tensor pins storage beyond the cache",
             "docs/operations.md", "mpt_kv.checks.operations:check_program_aliasing", "program", column="ops"),
    Property("ops-static-storage", "static buffers stay through operations", "on the static path a crop, reorder "
             "or extend moves a cache buffer (a captured graph replays into the old address)", "docs/operations.md",
             "mpt_kv.checks.operations:check_program_static_storage", "program", STATIC_PATHS, column="ops"),
    Property("ops-memory", "reorder and extend transients", "a reorder or an extend's transient is a whole-cache "
             "copy, not bounded per layer", "docs/operations.md", "mpt_kv.checks.operations:check_operation_memory",
             "operation", column="ops", operations=("reorder", "extend")),
    Property("ops-retained", "what a reorder and a crop retain", "after a reorder or a crop, bytes still allocated "
             "beyond the analytic cache of the surviving positions (an old cache kept referenced, a cropped tail "
             "kept)", "docs/operations.md", "mpt_kv.checks.operations:check_operation_retained", "operation",
             column="ops", operations=("reorder", "crop")),
    Property("generate", "the implementation's own generate", "a call the implementation's own generate makes "
             "(greedy, beam, assisted: prompt lookup, a draft) gets or leaves a cache that pins storage or holds other "
             "bytes than the analytic K/V, or gives logits other than an uncached forward over the sequence generate "
             "holds; generate returns other tokens than the oracle's greedy ones, or leaves a cache allocated",
             "docs/generate.md", "mpt_kv.checks.generate:check_generate", "generate", GENERATE_PATHS,
             operations=GENERATE_MODES),
    Property("family-P0", "a family's uncached logits = transformers'", "another family's uncached logits differ from "
             "transformers' model of the same weights", "docs/families.md", "mpt_kv.checks.family:check_uncached",
             "family", ("concat",), cache=False),
    Property("family-P1", "P1 on another decoder family (decode and extend)", "another family's cached prefill, decode "
             "or 3-token extend differs from transformers' uncached forward of the same weights", "docs/families.md",
             "mpt_kv.checks.family:check_cached", "family", FAMILY_PATHS),
    Property("family-P2", "P2 on another decoder family", "another family's static path differs from its concat path "
             "(logits, and K/V at the written positions)", "docs/families.md",
             "mpt_kv.checks.family:check_static_concat", "family", ("static", "static+reuse") + recipe_paths.PATHS),
    Property("family-P3", "P3 on another decoder family", "the seed bug class in another family: a cached tensor "
             "pins the fused projection's output", "docs/families.md", "mpt_kv.checks.family:check_no_pinned_storage",
             "family", FAMILY_PATHS),
    Property("family-P4", "P4 on another decoder family", "another family's returned logits are overwritten by a later "
             "call, or a cached tensor shares memory with them", "docs/families.md",
             "mpt_kv.checks.family:check_outputs_not_reused", "family", FAMILY_PATHS, cache=False),
    Property("family-ops", "fixed beam and assisted programs", "P1 after a beam reorder or an assisted extend and "
             "crop, in another family", "docs/families.md", "mpt_kv.checks.family:check_operations", "family",
             FAMILY_PATHS),
    Property("family-memory", "a family's cache bytes = its analytic K/V, nothing kept after", "another family's cache "
             "holds more than its analytic K/V, or outlives its session", "docs/families.md",
             "mpt_kv.checks.family:check_memory", "family", FAMILY_PATHS),
)

NAMES = tuple(p.name for p in PROPERTIES)
_BY_NAME = {p.name: p for p in PROPERTIES}
# the kill matrix's and the catalogue's columns, in index order
COLUMNS = tuple(dict.fromkeys(p.column for p in PROPERTIES if p.column))
# the matrix shows these columns in every run; the others where the run has them
ALWAYS = ("P0", "P1", "P2", "P3", "P4", "memory", "static-shape")
CACHE = tuple(p.name for p in PROPERTIES if p.cache)
NOT_CACHE = tuple(p.name for p in PROPERTIES if not p.cache)
TITLES = {p.name: p.title for p in PROPERTIES}


def by_name(name: str) -> Property:
    """The property `name`; an unknown one is a KeyError naming the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown property {name!r}: the index has {', '.join(NAMES)}") from None


def of_column(column: str) -> tuple[Property, ...]:
    return tuple(p for p in PROPERTIES if p.column == column)


def of_runs(*runs: str) -> tuple[str, ...]:
    """The names of the properties whose cases come the ways `runs` names (a conformance module's selection)."""
    return tuple(p.name for p in PROPERTIES if p.runs in runs)
