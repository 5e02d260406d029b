"""Targets under graph capture, as production generation runs them: the properties run on these too.

A graph replays the operations it captured and returns the graph's own static output tensor,
which the next replay of that graph overwrites (issue 12). `graphed(runner, kind)` returns a
runner that generates this way and declares it (`Capabilities(graph_outputs=True)`), so P1, P2
and P4 run on what a Gaudi or CUDA deployment runs, and the copy rule (results.py) is what keeps
P1 and P2 from comparing a buffer with itself.

- hpu: `wrap_in_hpu_graph(model)`, as optimum-habana's text generation with `--use_hpu_graphs`:
  each forward is captured the first time its input shapes are seen, then replayed.
- cuda: the static path's decode steps are captured with `torch.cuda.graph` (one graph per
  `cache_idx`) and replayed, their inputs copied into the captured tensors; prefill, the concat
  path and uncached forwards stay eager, as in CUDA-graph generation loops (gpt-fast's).
- cpu: no graph capture. `StaticOutputs` mimics its effect: every result is written into one
  buffer per output shape and that buffer is returned, so the control flow is tested on CPU.

The hpu and cuda paths drive targets with the `token_idx` protocol (`TokenIdxSession`: the
reference and optimum-habana's model); written against the documented APIs, not run on this
CPU machine (static_shape.py's graph replay uses the same calls).
"""

from __future__ import annotations

import dataclasses

import torch

from mpt_kv.errors import Unsupported
from mpt_kv.model.session import TokenIdxSession
from mpt_kv.targets import Capabilities


def declared_graph_outputs(runner, declared: bool = True) -> Capabilities:
    return dataclasses.replace(runner.capabilities, graph_outputs=declared)


# P4's note names who declared graph_outputs=True: the suite's wrapper here, not the target
DECLARED_BY = "graph_outputs_declared_by"


class Delegate:
    """Everything not overridden is the wrapped object's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --- cpu: one output buffer per shape ---------------------------------------------------------------
class StaticOutputs(Delegate):
    """A runner whose every returned tensor is a buffer kept per (shape, dtype) and overwritten by
    the next call that returns that shape: what a graph replay hands back. `declared=False` is a
    target that does this without saying so (P4 must fail it)."""

    def __init__(self, runner, declared: bool = True):
        super().__init__(runner)
        self.capabilities = declared_graph_outputs(runner, declared)
        setattr(self, DECLARED_BY, "the suite's CPU graph stand-in (graphs.StaticOutputs: one output buffer per "
                                   "shape, as a graph replay returns) wrapping the target")
        self.buffers: dict[tuple, torch.Tensor] = {}

    def out(self, t: torch.Tensor) -> torch.Tensor:
        key = (tuple(t.shape), t.dtype, t.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty_like(t)
        return self.buffers[key].copy_(t)

    def logits(self, input_ids, attention_mask):
        return self.out(self.inner.logits(input_ids, attention_mask))

    def session(self, path, max_len, bucket=None):
        return StaticOutputSession(self.inner.session(path, max_len, bucket), self)


class StaticOutputSession(Delegate):
    def __init__(self, session, runner: StaticOutputs):
        super().__init__(session)
        self.runner = runner

    def prefill(self, input_ids, attention_mask):
        return self.runner.out(self.inner.prefill(input_ids, attention_mask))

    def decode(self, tokens):
        return self.runner.out(self.inner.decode(tokens))


# --- hpu: wrap_in_hpu_graph --------------------------------------------------------------------------
def hpu_graphed(runner):
    """The target's model wrapped in HPU graphs, in place (build a runner for this use only)."""
    from habana_frameworks.torch.hpu import wrap_in_hpu_graph  # as optimum-habana's text-generation does

    if hasattr(runner.model, "validate"):
        runner.model.validate = False  # the reference's input checks read the device: not inside a graph
    runner.model = wrap_in_hpu_graph(runner.model)
    runner.capabilities = declared_graph_outputs(runner)
    setattr(runner, DECLARED_BY, "the suite's HPU graphs (wrap_in_hpu_graph) around the target's model")
    return runner


# --- cuda: captured static decode steps ---------------------------------------------------------------
class CudaGraphRunner(Delegate):
    """Static-path decode steps replayed from CUDA graphs (see the module doc)."""

    def __init__(self, runner):
        super().__init__(runner)
        self.capabilities = declared_graph_outputs(runner)
        setattr(self, DECLARED_BY, "the suite's CUDA graphs (graphs.CudaGraphRunner: static decode steps "
                                   "replayed) wrapping the target")

    def session(self, path, max_len, bucket=None):
        session = self.inner.session(path, max_len, bucket)
        if path == "static":
            capture_decode_steps(session)
        return session


def capture_decode_steps(session: TokenIdxSession) -> None:
    """Replace the session's decode forward by graph replays: one graph per cache_idx, captured
    at its first use after a warm-up run on a side stream (the CUDA docs' recipe); each replay
    first copies the step's tokens, mask and token_idx into the captured input tensors."""
    eager = session._forward
    graphs: dict = {}

    def forward(input_ids, mask, token_idx=None, cache_idx=None):
        if session.written == 0:  # the prefill runs eagerly
            return eager(input_ids, mask, token_idx, cache_idx)
        key = (tuple(input_ids.shape), tuple(mask.shape), cache_idx)
        if key not in graphs:
            static_in = [input_ids.clone(), mask.clone(), token_idx.clone()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = eager(*static_in, cache_idx)  # warm-up: this step's real forward
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records without running: re-records this same step's writes
                static_out = eager(*static_in, cache_idx)
            graphs[key] = (graph, static_in, static_out)
            return logits
        graph, static_in, static_out = graphs[key]
        for placeholder, value in zip(static_in, (input_ids, mask, token_idx)):
            placeholder.copy_(value)
        graph.replay()
        return static_out

    session._forward = forward


def graphed(runner, kind: str):
    """`runner` generating under graphs on device `kind` (see the module doc); `Unsupported` with
    the reason where this target cannot be graphed here."""
    if kind == "cpu":
        return StaticOutputs(runner)
    probe = runner.session("static", 1)
    if not isinstance(probe, TokenIdxSession) or (kind == "cuda" and not hasattr(runner.model, "validate")):
        raise Unsupported(f"{runner.name}: graphs are driven here through the token_idx protocol "
                          f"(reference-style models on cuda; TokenIdxSession targets on hpu), not {type(probe).__name__}")
    if kind == "hpu":
        return hpu_graphed(runner)
    runner.model.validate = False
    return CudaGraphRunner(runner)
