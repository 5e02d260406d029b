"""The graph-capture property: the static decode step captured as one graph, as torch.compile,
CUDA graphs and HPU graphs need it.

    check_graph_capture(runner, c)   c.path == "static", no bucket

The decode step is what production code compiles or captures: the target's model forward
(`runner.model.forward`) on one decode step of the static path; the prefill and the generation
loop around it (the session: token_idx, the mask) stay eager, as in optimum-habana's and
transformers' generation and gpt-fast's loop. The case's static path is generated eagerly first, then
again on the same model with the decode steps compiled (and on cuda a third time, replayed), fed the
eager run's tokens, one generation at a time as a served model runs them; every decode step against
the eager one:

- cpu (and every device): `torch.compile(model.forward, fullgraph=True, dynamic=False,
  backend="aot_eager")`: dynamo and AOT autograd's functionalization trace the step as inductor
  would, without its code generation (about 0.5 s a target here, inductor's C++ build 10-30 s).
  It fails on a graph break (fullgraph: dynamo raises where a graph would be cut), on a recompile
  between decode steps (steps 1.. run under `torch.compiler.set_stance("fail_on_recompile")`,
  which raises naming the guard that changed: a Python int or a shape that changes per step), on
  more graphs after any step than after step 0 (the counting backend: dynamo's recompile
  counter), and on compiled logits that differ from eager ones (`logits:compiled`, calibrated:
  docs/calibration.md);
- cuda, after that: the step captured with `torch.cuda.CUDAGraph` (warm-up on a side stream, then
  capture, as the CUDA docs ask) and replayed at every later step, its inputs copied into the
  captured tensors first; each replay's logits equal eager ones (`logits:same`);
- hpu: unsupported, with what it needs (HPU graphs are checked by P1, P2 and P4's `/graphs` runs:
  `wrap_in_hpu_graph`; torch.compile on HPU takes `backend="hpu_backend"`, docs/checks.md).

A target's own call that raises eagerly is the crash rule's (`compare.crash_of`), never a capture
failure. Where a target has no static path (`Capabilities`: "static" unsupported) the run layer
makes the check unsupported with the target's reason. What a target must do to pass: keep the
decode position a tensor, keep every shape and Python scalar the model sees fixed from step to step
(the mask over the whole cache, as transformers' generate hands a compileable cache's forward a
mask of the cache's length), read no device value on the host and branch on no tensor.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import re

import torch

from mpt_kv.checks.compare import NOT_CRASHES, PropertyFailure, assert_close, crash_of, describe
from mpt_kv.checks.properties import Context, greedy
from mpt_kv.checks.results import copied
from mpt_kv.checks.static_shape import short_path, validation_off
from mpt_kv.errors import Unsupported

BACKEND = "aot_eager"  # dynamo + AOT functionalization, no code generation
COMPILE = f"torch.compile(fullgraph=True, dynamic=False, backend={BACKEND!r})"
HPU_REASON = ("graph-capture on hpu: HPU graphs (wrap_in_hpu_graph, optimum-habana's --use_hpu_graphs) are checked "
              "by P1, P2 and P4's /graphs runs; torch.compile on HPU takes backend='hpu_backend' from "
              "habana_frameworks (docs/checks.md, 'Graph capture'), not run by this check")


def capture_unavailable(kind: str) -> str | None:
    """Why the check cannot run on device `kind` here, or None."""
    if not hasattr(torch, "compile") or not hasattr(torch.compiler, "set_stance"):
        return f"torch {torch.__version__} has no torch.compile / torch.compiler.set_stance (torch >= 2.6)"
    if kind == "hpu":
        return HPU_REASON
    return None


@contextlib.contextmanager
def forward_as(model: torch.nn.Module, forward):
    """`model(...)` calls `forward` while inside (an instance attribute: nn.Module.__call__ finds it
    first), the model's own forward after."""
    had = "forward" in vars(model)
    old = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = old
        else:
            del model.forward


@contextlib.contextmanager
def mask_over_whole_cache(runner):
    """A transformers-style runner (`TransformersRunner.pad_static_mask`) hands its static path's
    forward the 2D mask padded to the cache length: what transformers' generate does for a
    compileable cache (it builds the mask over the whole cache before the forward; 5.24
    generation/utils.py:722-746), so the decode step's input shapes stay fixed."""
    live = getattr(runner, "live", runner)
    if not hasattr(live, "pad_static_mask"):
        yield
        return
    old, live.pad_static_mask = live.pad_static_mask, True
    try:
        yield
    finally:
        live.pad_static_mask = old


# dynamo's "from user code:" frames: the innermost is where the capture failed
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def failure_site(error: BaseException) -> str:
    """' at path:line in function (`source`)', the innermost user frame dynamo names, or ''."""
    text = str(error)
    frames = _FRAME.findall(text.split("from user code:", 1)[1]) if "from user code:" in text else []
    # a torch function or dispatch mode on the stack (a profiler, a device shim) is never where the target failed
    frames = [f for f in frames if f[2] not in ("__torch_function__", "__torch_dispatch__")]
    return site(*frames[-1]) if frames else ""


def site(path: str, line: str, function: str) -> str:
    """' at mpt_kv/catalogue/variants.py:198 in update (`n = int(...)`)': a frame as the messages name it."""
    source = linecache.getline(path, int(line)).strip()
    return f" at {short_path(path)}:{line} in {function}" + (f" (`{source}`)" if source else "")


def first_lines(error: BaseException, limit: int = 400) -> str:
    """The exception's own message up to dynamo's boilerplate, on one line."""
    text = str(error).split("from user code:", 1)[0]
    text = re.split(r"\n\s*(Explanation|Hint|Developer debug context|Set TORCHDYNAMO_VERBOSE|For more help)", text)[0]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + " ..."


def host_reads(gm) -> list[str]:
    """The nodes of a dynamo graph that read a device value on the host inside the graph (`.item()`,
    `.tolist()`, a data-dependent size): dynamo keeps them in one graph as unbacked values, but a CUDA
    or HPU graph cannot capture them and inductor syncs on each. Each as 'Tensor.item at path:line in
    function (`source`)'."""
    out = []
    for node in gm.graph.nodes:
        name = (node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target)))
        if node.op not in ("call_method", "call_function") or name not in HOST_READS:
            continue
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        out.append(HOST_READS[name] + (site(*frames[-1]) if frames else ""))
    return out


HOST_READS = {"item": "Tensor.item", "tolist": "Tensor.tolist", "_local_scalar_dense": "aten._local_scalar_dense",
              "_local_scalar_dense.default": "aten._local_scalar_dense", "nonzero": "a data-dependent size (nonzero)"}


class CompiledDecode:
    """`model.forward` compiled once (fullgraph, static shapes): `graphs` counts the graphs dynamo
    handed the backend (its recompile counter), `calls` the decode steps that went through it,
    `reads` the host reads found in them (`host_reads`)."""

    def __init__(self, model: torch.nn.Module, backend: str = BACKEND):
        self.graphs, self.calls, self.reads = 0, 0, []

        def counting_backend(gm, example_inputs):
            self.graphs += 1
            self.reads += host_reads(gm)
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

        compiled = torch.compile(model.forward, backend=counting_backend, fullgraph=True, dynamic=False)

        def forward(*args, **kwargs):
            self.calls += 1
            return compiled(*args, **kwargs)

        self.model, self.forward = model, forward

    def decode(self, session, token, stance: str | None):
        with forward_as(self.model, self.forward), (torch.compiler.set_stance(stance) if stance
                                                    else contextlib.nullcontext()):
            return session.decode(token)


def eager_generation(runner, c: Context) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The static path run eagerly on `c.case`: (the tokens fed at each decode step, the logits of
    each step), copies. The target raising is the crash rule's, never a capture failure."""
    ids, mask = c.case.inputs(c.device)
    session = copied(runner).session("static", c.case.total_len)
    step, operation = "prefill", "prefill"
    try:
        logits = session.prefill(ids, mask)[:, -1]
        tokens, out = [], []
        for step in range(c.case.new_tokens):
            operation = "decode"
            tokens.append(greedy(logits))
            logits = session.decode(tokens[-1])
            out.append(logits)
    except NOT_CRASHES:
        raise
    except Exception as e:  # noqa: BLE001  the target's own call crashed, with nothing compiled or captured
        raise crash_of("graph-capture", "the target", operation, e, c.ctx(step=step), at=" (eager, before any capture)") \
            from e
    return tokens, out


def check_graph_capture(runner, c: Context, backend: str = BACKEND) -> list[str]:
    """The module doc's property on `c.case` (static path, no bucket). Returns notes (what ran)."""
    if c.path != "static" or c.bucket:
        raise ValueError("graph-capture is a property of the static path without buckets (a bucket change is a new "
                         "cache_idx: by design a new graph)")
    reason = capture_unavailable(c.device)
    if reason:
        raise Unsupported(f"{c.target}: {reason}")
    with torch.inference_mode(), validation_off(runner.model), mask_over_whole_cache(runner):
        # the eager generation first, then the captured one on the same model with the same tokens: one
        # generation at a time, as a served model runs them (a cache pool on the model is reused, not shared)
        tokens, want = eager_generation(runner, c)
        notes = [compiled_generation(runner, c, tokens, want, backend)]
        if c.device == "cuda":
            notes.append(graphed_generation(runner, c, tokens, want))
    return notes


def compiled_generation(runner, c: Context, tokens, want, backend: str) -> str:
    how = COMPILE.replace(repr(BACKEND), repr(backend))
    ids, mask = c.case.inputs(c.device)
    torch._dynamo.reset()  # a clean code cache: frames compiled for another target or case do not count
    try:
        compiled = CompiledDecode(runner.model, backend)
        session = copied(runner).session("static", c.case.total_len)
        session.prefill(ids, mask)
        after_first = None
        for step, token in enumerate(tokens):
            try:
                got = compiled.decode(session, token, "fail_on_recompile" if step else None)
            except NOT_CRASHES:
                raise
            except Exception as e:  # noqa: BLE001  dynamo's verdict: a graph break, a recompile, an error in tracing
                raise PropertyFailure(capture_failure(e, step, how, c)) from e
            if compiled.calls != step + 1:  # fail closed: a step that never reached the model compiled nothing
                raise RuntimeError(f"{c.target}: decode step {step} did not call runner.model, so nothing of it was "
                                   f"compiled: graph-capture compiles runner.model's forward "
                                   f"({type(runner.model).__name__})")
            if compiled.reads:
                raise PropertyFailure(
                    f"graph-capture: {how} captured static decode step {step} with a device value read on the host "
                    f"inside the graph: {'; '.join(dict.fromkeys(compiled.reads))} (a data-dependent value or shape: "
                    f"a CUDA or HPU graph cannot hold it, inductor syncs on it) [{describe(c.ctx(step=step))}]")
            after_first = compiled.graphs if step == 0 else after_first
            if compiled.graphs != after_first:
                raise PropertyFailure(f"graph-capture: {how} compiled {compiled.graphs} graphs after decode step "
                                      f"{step}, {after_first} after step 0 (a recompile between decode steps) "
                                      f"[{describe(c.ctx(step=step))}]")
            assert_close(got, want[step], c.tol("logits:compiled"), f"compiled ({backend}) vs eager decode logits",
                         c.ctx(step=step))
    finally:
        torch._dynamo.reset()  # nothing compiled for this runner outlives the check (its guards hold the model)
    return (f"graph-capture: {c.target} on {c.device}: {len(tokens)} static decode steps in {compiled.graphs} "
            f"graph{'s' if compiled.graphs != 1 else ''} ({backend}), equal to eager")


def capture_failure(e: BaseException, step: int, how: str, c: Context) -> str:
    text = str(e)
    if "fail_on_recompile" in text:
        return (f"graph-capture: {how} recompiled at decode step {step}: a guard of step 0's graph failed: "
                f"{'; '.join(failed_guards(text)) or first_lines(e)} (a Python int or a shape that changes per step "
                f"is baked into the graph) [{describe(c.ctx(step=step))}]")
    return (f"graph-capture: {how} cannot capture static decode step {step} as one graph: "
            f"{type(e).__name__}: {first_lines(e)}{failure_site(e)} [{describe(c.ctx(step=step))}]")


def failed_guards(text: str) -> list[str]:
    """'token_idx == 6 (guarded at mpt_kv/model/reference.py:159 in _positions)' for each guard failure
    dynamo lists under fail_on_recompile."""
    out = []
    for line in re.findall(r"^\s*-\s*\d+/\d+:\s*(.+)$", text, re.M):
        expr, _, rest = line.partition("#")
        where = rest.rsplit("#", 1)[-1].strip() if rest else ""
        out.append(" ".join(expr.split()) + (f" (guarded at {where})" if where else ""))
    return out[:3]


# --- cuda: the decode step replayed from a CUDA graph ------------------------------------------------------

def fingerprint(value):
    """What a captured graph bakes in of a non-tensor argument: a Python scalar's value, a tensor
    inside a container by its address, shape and dtype, any other object by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.dtype)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(fingerprint(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, fingerprint(v)) for k, v in value.items())
    return ("object", id(value))


class GraphedDecode:
    """`model.forward` captured with `torch.cuda.CUDAGraph` at its first call (a warm-up run on a side
    stream first, as the CUDA docs ask; the capture records without running), replayed at every later
    call. A top-level tensor argument is the graph's input: a new tensor is copied into the captured one
    before the replay (one at the captured address, such as the session's mask updated in place, is
    read there). Everything else (the cache object or lists, Python scalars) is baked into the graph:
    one that changed since the capture is a `PropertyFailure` (the replay would use the captured one)."""

    def __init__(self, model: torch.nn.Module, c: Context):
        self.model, self.c, self.eager = model, c, model.forward
        self.graph = self.out = None
        self.inputs: dict = {}
        self.baked = None
        self.calls = 0

    def split(self, args, kwargs):
        try:  # named as the forward names them: 'token_idx', not 3
            signature = inspect.signature(self.eager)
            bound = signature.bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            signature, bound = None, None
        if bound is None:
            named = {**{i: a for i, a in enumerate(args)}, **kwargs}
        else:
            named = {}
            for name, value in bound.items():
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:  # **kwargs: each keyword an argument of its own
                    named.update(value)
                elif kind is inspect.Parameter.VAR_POSITIONAL:
                    named.update({f"*{name}[{i}]": v for i, v in enumerate(value)})
                else:
                    named[name] = value
        return ({k: v for k, v in named.items() if isinstance(v, torch.Tensor)},
                {k: fingerprint(v) for k, v in named.items() if not isinstance(v, torch.Tensor)})

    def forward(self, *args, **kwargs):
        self.calls += 1
        tensors, baked = self.split(args, kwargs)
        if self.graph is None:
            self.inputs, self.baked = tensors, baked
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.eager(*args, **kwargs)  # the warm-up: this step's own forward
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records without running: re-records this same step's writes
                self.out = self.eager(*args, **kwargs)
            return out
        step = self.calls - 1
        for key, value in baked.items():
            if value != self.baked.get(key):
                raise PropertyFailure(
                    f"graph-capture: CUDA graph replay of static decode step {step}: the model's argument {key!r} "
                    f"changed since the captured step ({describe_baked(self.baked.get(key))} -> {describe_baked(value)}): "
                    f"a replay runs with the captured one (a Python int that changes per step, or a cache that "
                    f"moved) [{describe(self.c.ctx(step=step))}]")
        if set(tensors) != set(self.inputs):
            raise PropertyFailure(f"graph-capture: CUDA graph replay of static decode step {step}: the model was "
                                  f"called with tensors {sorted(map(str, tensors))}, captured with "
                                  f"{sorted(map(str, self.inputs))} [{describe(self.c.ctx(step=step))}]")
        for key, t in tensors.items():
            captured = self.inputs[key]
            if tuple(t.shape) != tuple(captured.shape) or t.dtype != captured.dtype:
                raise PropertyFailure(
                    f"graph-capture: CUDA graph replay of static decode step {step}: the model's argument {key!r} is "
                    f"{tuple(t.shape)} {t.dtype}, captured as {tuple(captured.shape)} {captured.dtype} (a shape that "
                    f"changes per step) [{describe(self.c.ctx(step=step))}]")
            if t.data_ptr() != captured.data_ptr():
                captured.copy_(t)
        self.graph.replay()
        return self.out


def describe_baked(value) -> str:
    if isinstance(value, tuple) and value[:1] == ("tensor",):
        return f"tensor at {value[1]:#x} {list(value[2])}"
    if isinstance(value, tuple) and value[:1] == ("object",):
        return f"object {value[1]:#x}"
    return repr(value)


def graphed_generation(runner, c: Context, tokens, want) -> str:
    """The static path again, its decode steps through `GraphedDecode`; each step's logits against
    the eager generation's (`logits:same`: the same kernels replayed)."""
    ids, mask = c.case.inputs(c.device)
    graphed = GraphedDecode(runner.model, c)
    session = copied(runner).session("static", c.case.total_len)
    session.prefill(ids, mask)
    for step, token in enumerate(tokens):
        with forward_as(runner.model, graphed.forward):
            try:
                got = session.decode(token)
            except (PropertyFailure, *NOT_CRASHES):
                raise
            except Exception as e:  # noqa: BLE001  the capture or a replay raised (a host sync while capturing, ...)
                raise PropertyFailure(f"graph-capture: CUDA graph capture of static decode step {step} failed: "
                                      f"{type(e).__name__}: {first_lines(e)} [{describe(c.ctx(step=step))}]") from e
        torch.cuda.synchronize()
        if graphed.calls != step + 1:
            raise RuntimeError(f"{c.target}: decode step {step} did not call runner.model, so nothing of it was "
                               "captured: graph-capture captures runner.model's forward")
        assert_close(got, want[step], c.tol("logits:same"), "CUDA graph replay vs eager decode logits",
                     c.ctx(step=step))
    return (f"graph-capture: {c.target} on cuda: step 0 captured as one CUDA graph, steps 1-{len(tokens) - 1} "
            "replayed, equal to eager")
