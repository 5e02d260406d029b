"""CPU stand-ins for the HPU kernels optimum-habana's ports call with no CPU fallback, written from
their documented semantics and from optimum-habana's own callers (no Habana code is copied or run).

    FusedSDPA.apply                      habana_frameworks.torch.hpex.kernels.FusedSDPA
    RotaryPosEmbeddingHelperV2.apply     habana_frameworks.torch.hpex.kernels (the ports' `FusedRoPE`)
    FusedRMSNorm.apply                   habana_frameworks.torch.hpex.normalization.FusedRMSNorm
    mixture_of_experts                   torch.ops.hpu.mixture_of_experts
    mark_step                            habana_frameworks.torch.core.mark_step (no lazy graph on CPU)
    wrap_in_hpu_graph                    habana_frameworks.torch.hpu.wrap_in_hpu_graph (the module itself)
    sdp_kernel                           habana_frameworks.torch.hpu.sdp_kernel (FusedSDPA's recompute context)
    hpu_branch(function)                 a port's own function with its device test answered as on an HPU,
                                         its kernel names bound to these (where its CPU branch cannot run)

Each is a plain function of torch tensors, tested against a plain torch reference
(tests/test_habana_standin.py). They are computed in float32 and cast to the input's dtype: the
values exact arithmetic gives; the HPU's own rounding inside a kernel is not modeled (a finding
that lives below bf16's resolution is not seen through them).

They are only ever reached through `mpt_kv.families.habana_standin`: the kernel stand-in registers
them for the import of a port whose entry declares them (`GaudiPort.kernels`), and they run only
inside that port's forward (`habana_standin.kernel_scope`); called anywhere else they raise
`StandinOutOfScope`, so a port that did not declare them never runs one unnoticed. Where a real
habana_frameworks is installed none of this is imported: the real kernels run. A standalone repro of a
finding seen through them ships this file as it is (mpt_kv/findings/port_repros.py `standin_kernels`):
it imports nothing of mpt_kv.

Sources: Intel Gaudi PyTorch Python API, https://docs.habana.ai/en/latest/PyTorch/Python_Packages.html
(sections hpex/kernels/FusedSDPA, hpex/kernels/RotaryPosEmbeddingHelper, hpex/normalization/FusedRMSNorm,
hpu graphs); torch.nn.functional.scaled_dot_product_attention's documentation, of which FusedSDPA is the
fused counterpart; and the callers in optimum-habana 1.21.2 named at each function.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import inspect
import math
import textwrap
import types

import torch
import torch.nn.functional as F


class StandinOutOfScope(RuntimeError):
    """A stand-in kernel called outside the forward of a port declared to use it. Defined here, not in
    mpt_kv/errors.py with every other: this file is shipped verbatim beside the standalone repros, which must
    run without mpt-kv (mpt_kv.errors lists it)."""

# how many times each stand-in ran, by name (the tests read it)
CALLS: collections.Counter = collections.Counter()
# the open kernel scope (habana_standin.kernel_scope): how deep, and the kernels its port declared
_scope = {"depth": 0, "kernels": frozenset()}


def _enter(name: str) -> None:
    if _scope["depth"] == 0 or name not in _scope["kernels"]:
        where = ("outside the forward of a port whose entry declares it" if _scope["depth"] == 0 else
                 f"in the forward of a port whose entry declares only {sorted(_scope['kernels'])}")
        raise StandinOutOfScope(
            f"mpt-kv's CPU stand-in for the HPU kernel {name} was called {where} (GaudiPort.kernels, "
            "mpt_kv/families/habana_standin.py): a module imported under the kernel stand-in keeps it, but only "
            "the cells of a port that declares it (labelled cpu+standin) may run it")
    CALLS[name] += 1


def _refuse(name: str, what: str) -> None:
    raise NotImplementedError(f"mpt-kv's CPU stand-in for {name}: {what} is not modeled (no optimum-habana port "
                              "mpt-kv drives passes it); the stand-in refuses it rather than guess")


# --- FusedSDPA -------------------------------------------------------------------------------------------------------

SOFTMAX_MODES = ("none", "fast", "fp32")
PADDING_SIDES = ("left", "right", "none")


def fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
               recompute_mode=None, valid_sequence_lengths=None, padding_side="left"):
    """`FusedSDPA.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, softmax_mode,
    recompute_mode, valid_sequence_lengths, padding_side)`, positional as optimum-habana calls it
    (models/llama/modeling_llama.py:296-308, ModuleFusedSDPA.forward; minicpm: modeling_minicpm.py:903-911):

    - query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev): Hq a multiple of Hkv, each group of
      Hq / Hkv consecutive query heads attending to one K/V head (GQA and MQA: what the kernel's GQA path
      does, and the ports' repeat_kv, models/llama/modeling_llama.py gaudi_llama_repeat_kv);
    - attn_mask: None, a boolean mask (True: takes part) or a float mask added to the scores,
      broadcastable to (B, Hq, L, S) (torch's SDPA rule; the ports pass (B, 1, L, S));
    - is_causal: the upper-left causal mask (query i attends keys j <= i: torch's SDPA semantics for a
      square or non-square score matrix); with a mask as well it is refused (torch refuses both; the ports
      never pass both: llama passes None with causal, :740-752, minicpm `is_causal and attention_mask is
      None`, :909);
    - scale: default 1 / sqrt(E);
    - dropout_p: must be 0 (inference: the ports pass 0.0 outside training);
    - softmax_mode "None" or "fast" (llama: "fast" with flash_attention_fast_softmax, :739), or "fp32" (the
      softmax in float32: qwen2 and qwen2_moe pass it, models/qwen2/modeling_qwen2.py:492-493, "Qwen2 Family
      should not use fast/bf16 softmax for SDPA due to its magnitude issue"). "fast" is the HPU's
      reduced-precision softmax, whose arithmetic Habana does not document: the stand-in computes the exact
      softmax for every mode (declared, not approximated: a value check under "fast" holds the port to exact
      arithmetic, so it can fail a port, never pass one that exact arithmetic would fail);
    - recompute_mode (None, True, False): the recompute variant recomputes the attention in the backward
      pass to save memory; forward values are the same, so it is accepted and changes nothing here;
    - valid_sequence_lengths (B,) with padding_side "left" or "right": only with is_causal and no mask
      (inference, the first token: llama :740-752 passes them with "left"); the keys of row b outside
      its valid positions (the first S - len[b] with left padding, the last with right padding) take no
      part, and the output at its padded query positions, which the kernel does not document and no
      caller reads, is zero here. padding_side "None" (the decode call, :722-734) is ignored without
      valid_sequence_lengths.

    Computed in float32, the result in the query's dtype."""
    _enter("FusedSDPA")
    mode = str(softmax_mode).lower()
    if mode not in SOFTMAX_MODES:
        raise ValueError(f"FusedSDPA stand-in: softmax_mode {softmax_mode!r}; the kernel takes 'None', 'fast' or 'fp32'")
    side = str(padding_side).lower()
    if side not in PADDING_SIDES:
        raise ValueError(f"FusedSDPA stand-in: padding_side {padding_side!r}; expected 'left' or 'right'")
    if recompute_mode not in (None, True, False):
        raise ValueError(f"FusedSDPA stand-in: recompute_mode {recompute_mode!r}; expected None, True or False")
    if dropout_p:
        _refuse("FusedSDPA", f"dropout_p={dropout_p} (training)")
    if is_causal and attn_mask is not None:
        raise ValueError("FusedSDPA stand-in: is_causal with an attn_mask as well (torch's SDPA refuses both)")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"FusedSDPA stand-in: expected 4-D (batch, heads, seq, dim) query, key and value, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batch, q_heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"FusedSDPA stand-in: {q_heads} query heads are not a multiple of {kv_heads} K/V heads")
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q, k, v = query.float(), key.float(), value.float()
    if kv_heads != q_heads:
        k = k.repeat_interleave(q_heads // kv_heads, dim=1)
        v = v.repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    allowed = torch.ones(length, keys, dtype=torch.bool, device=query.device)
    if is_causal:
        allowed = allowed.tril()
    allowed = allowed.expand(batch, 1, length, keys)
    query_valid = None
    if valid_sequence_lengths is not None:
        if not is_causal:
            raise ValueError("FusedSDPA stand-in: valid_sequence_lengths is supported with is_causal only (inference, "
                             "the first token)")
        if side == "none":
            raise ValueError("FusedSDPA stand-in: valid_sequence_lengths needs padding_side 'left' or 'right'")
        lengths = valid_sequence_lengths.reshape(-1, 1).to(query.device)
        positions = torch.arange(keys, device=query.device).unsqueeze(0)
        key_valid = positions >= keys - lengths if side == "left" else positions < lengths  # (B, S)
        allowed = allowed & key_valid[:, None, None, :]
        q_positions = torch.arange(length, device=query.device).unsqueeze(0)
        query_valid = q_positions >= length - lengths if side == "left" else q_positions < lengths  # (B, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    weights = torch.softmax(scores, dim=-1)
    # a padded query row whose every key is left out has no softmax (NaN): zero, never read; a NaN that
    # comes from the inputs stays
    weights = weights.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    out = torch.matmul(weights, v)
    if query_valid is not None:
        out = out * query_valid[:, None, :, None]
    return out.to(query.dtype)


class FusedSDPA:
    """The face the ports use: `FusedSDPA.apply(...)` (a torch.autograd.Function on an HPU)."""

    apply = staticmethod(fused_sdpa)


# --- RotaryPosEmbeddingHelperV2 (the ports' FusedRoPE) ---------------------------------------------------------------

def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_pos_embedding(x, cos, sin, position_ids=None, *mode):
    """`RotaryPosEmbeddingHelperV2.apply(x, cos, sin, position_ids)`: the rotary embedding in the
    rotate-half layout, x * cos + rotate_half(x) * sin. With position_ids (B, S), cos and sin are tables
    (1, 1, positions, E) and row b, token s takes position position_ids[b, s]; without, they broadcast
    against x as given. Its reference is the ports' own CPU fallback of the same call: optimum-habana
    1.21.2 models/llama/modeling_llama.py:1616-1620 (`apply_customized_rope`: the kernel with
    cos.unsqueeze(0).unsqueeze(0) and position_ids on an HPU, models/modeling_all_models.py:81-105, else
    transformers' apply_rotary_pos_emb(q, k, cos[position_ids], sin[position_ids])). Only the
    rotate-half mode is modeled, RotaryPosEmbeddingMode.BLOCKWISE, which Habana documents as the default
    of the kernel's mode argument (PAIRWISE, GPT-J's interleaved layout, must be asked for): a mode
    argument is refused. (A port that calls the kernel on an interleaved rope without asking for PAIRWISE
    computes another rotation than its CPU branch: deepseek_v2's prefill, a finding seen only so.)"""
    _enter("RotaryPosEmbeddingHelperV2")
    if mode:
        _refuse("RotaryPosEmbeddingHelperV2", f"a rotary mode argument {mode!r}")
    if position_ids is not None:
        if cos.dim() != 4 or cos.shape[0] != 1 or cos.shape[1] != 1:
            raise ValueError(f"RotaryPosEmbeddingHelperV2 stand-in: with position_ids, cos must be a (1, 1, positions, "
                             f"dim) table, got {tuple(cos.shape)}")
        cos = cos[0, 0][position_ids].unsqueeze(1)  # (B, 1, S, E)
        sin = sin[0, 0][position_ids].unsqueeze(1)
    out = x.float() * cos.float() + rotate_half(x.float()) * sin.float()
    return out.to(x.dtype)


class RotaryPosEmbeddingHelperV2:
    apply = staticmethod(rotary_pos_embedding)


# --- FusedRMSNorm ----------------------------------------------------------------------------------------------------

def fused_rms_norm(x, weight, eps):
    """`FusedRMSNorm.apply(x, weight, eps)`: x / sqrt(mean(x^2 over the last dim) + eps) * weight,
    normalized in float32, cast to x's dtype, then scaled by the weight: the ports' own CPU fallback of
    the same call (optimum-habana 1.21.2 models/llama/modeling_llama.py:59-79, gaudi_llama_rmsnorm_forward;
    the ports cast x to the weight's dtype before the kernel, :67-70)."""
    _enter("FusedRMSNorm")
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class FusedRMSNorm:
    apply = staticmethod(fused_rms_norm)


# --- torch.ops.hpu.mixture_of_experts --------------------------------------------------------------------------------

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}
FP8_ARGUMENTS = ("d_scale_hidden_states", "d_scale_intermediate_hidden_states", "d_scale_w1", "d_scale_w2",
                 "d_scale_w3", "d_scale_w12", "block_size")


def mixture_of_experts(hidden_states, expert_routing_table, router_weights, w1=None, w2=None, w3=None, *,
                       w12=None, permuted_weights=True, activation="silu", experts_min=0, experts_max=None,
                       **other):
    """`torch.ops.hpu.mixture_of_experts(...)` as optimum-habana's ports call it (keywords only:
    models/mixtral/modeling_mixtral.py:249-260, qwen2_moe/modeling_qwen2_moe.py:564-575,
    qwen3_moe/modeling_qwen3_moe.py:638-649, deepseek_v2/modeling_deepseek_v2.py:678-689,
    deepseek_v3/modeling_deepseek_v3.py:606-617):

    - hidden_states (T, H); expert_routing_table (T, k): each token's k experts by their global index;
      router_weights (T, k): each one's weight;
    - w1, w2, w3: one weight per expert of the range, in the kernel's naming w1 the gate projection, w2
      the up projection, w3 the down projection (the ports pass their gate_proj, up_proj and down_proj
      so: deepseek_v2 :682-684; mixtral passes its w1, w3, w2 with the comment that the naming differs,
      :254-256); or the fused `w12` (gate and up concatenated on the output dim, gate first) and w3;
    - permuted_weights=True: the weights as torch.nn.Linear stores them, (out, in) (what every caller
      passes); False is refused;
    - activation: "silu" (every caller), "gelu" or "relu";
    - experts_min, experts_max: the range of experts the weight lists hold, inclusive; the list's entry
      i is expert experts_min + i, and a routed expert outside the range adds nothing (deepseek_v2 calls
      the op once per slice of experts and sums the slices, :670-690: so a slice must add exactly its own
      experts' share, and its lists start at experts_min).

    Token t's output: sum over its k routed experts e in the range of
    router_weights[t, j] * w3[e] @ (act(w1[e] @ x_t) * (w2[e] @ x_t)), summed in float32, returned in
    hidden_states' dtype. The reference it is tested against is a plain loop over the experts, as
    transformers' MixtralSparseMoeBlock (models/mixtral/modeling_mixtral.py) computes it. Any other
    argument (the FP8 scales, block_size, chunk_size, total_experts) is refused."""
    _enter("mixture_of_experts")
    unknown = sorted(other)
    if unknown:
        _refuse("mixture_of_experts", f"argument(s) {unknown}" + (" (FP8)" if set(unknown) & set(FP8_ARGUMENTS) else ""))
    if not permuted_weights:
        _refuse("mixture_of_experts", "permuted_weights=False")
    if activation not in ACTIVATIONS:
        raise ValueError(f"mixture_of_experts stand-in: activation {activation!r}; modeled: {sorted(ACTIVATIONS)}")
    if w12 is not None:
        if w1 is not None or w2 is not None or w3 is None:
            raise ValueError("mixture_of_experts stand-in: pass either w1, w2 and w3, or w12 and w3")
        gates, ups = zip(*(w.chunk(2, dim=0) for w in w12))
    else:
        if w1 is None or w2 is None or w3 is None:
            raise ValueError("mixture_of_experts stand-in: w1, w2 and w3 (or w12 and w3) are required")
        gates, ups = list(w1), list(w2)
    downs = list(w3)
    count = len(downs)
    if not (len(gates) == len(ups) == count):
        raise ValueError(f"mixture_of_experts stand-in: weight lists of {len(gates)}, {len(ups)} and {count} experts")
    experts_max = experts_min + count - 1 if experts_max is None else experts_max
    if experts_max - experts_min + 1 != count:
        raise ValueError(f"mixture_of_experts stand-in: experts_min {experts_min} .. experts_max {experts_max} is "
                         f"{experts_max - experts_min + 1} experts, the weight lists hold {count}")
    act = ACTIVATIONS[activation]
    x = hidden_states.float()
    out = torch.zeros_like(x)
    routing = expert_routing_table.reshape(x.shape[0], -1)
    weights = router_weights.reshape(x.shape[0], -1).float()
    for i in range(count):
        token, slot = torch.nonzero(routing == experts_min + i, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token]
        y = F.linear(act(F.linear(h, gates[i].float())) * F.linear(h, ups[i].float()), downs[i].float())
        out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
    return out.to(hidden_states.dtype)


# --- habana_frameworks.torch.core / .hpu -----------------------------------------------------------------------------

def mark_step(*args, **kwargs) -> None:
    """`htcore.mark_step()`: on an HPU in lazy mode it executes the graph accumulated so far; CPU
    runs eagerly, so there is nothing to execute (the loading stand-in's, too)."""


@contextlib.contextmanager
def sdp_kernel(enable_recompute=False, *args, **kwargs):
    """`habana_frameworks.torch.hpu.sdp_kernel(enable_recompute=...)`: the context in which FusedSDPA runs its
    recompute variant (the attention recomputed in the backward pass instead of kept: memory, not values;
    Habana's FusedSDPA documentation). The ports open it around FusedSDPA.apply with
    --flash_attention_recompute (models/gemma2/modeling_gemma2.py:302-330, falcon :394-401, mpt :122-126); here it
    changes nothing, as `fused_sdpa`'s `recompute_mode` changes nothing."""
    _enter("FusedSDPA")
    yield


def wrap_in_hpu_graph(module, *args, **kwargs):
    """`habana_frameworks.torch.hpu.wrap_in_hpu_graph(module, ...)`: the module itself (an HPU graph
    records and replays the module's ops; on CPU the module runs eagerly, the same values)."""
    return module


# --- a port's own function with its device test answered as on an HPU --------------------------------------------------

# the names the ports give the kernels they import (`... RotaryPosEmbeddingHelperV2 as FusedRoPE`)
ALIASES = {"FusedRoPE": "RotaryPosEmbeddingHelperV2", "FusedSDPA": "FusedSDPA", "FusedRMSNorm": "FusedRMSNorm"}


def _kernel_globals(function) -> dict:
    """`function`'s module globals with every name of an HPU kernel (`ALIASES`) the stand-in's, and every
    optimum-habana function it calls that reads one (`apply_customized_rope_module` of
    models/modeling_all_models.py, whose own FusedRoPE is what that module's first import found) a copy
    reading the stand-in's (`with_kernels`); the modules themselves are left untouched."""
    scope = dict(function.__globals__)
    for name, value in list(scope.items()):
        if (isinstance(value, types.FunctionType) and value is not function
                and value.__module__.startswith("optimum.habana.")
                and set(value.__code__.co_names) & set(ALIASES)):
            scope[name] = with_kernels(value)
    scope.update({alias: globals()[name] for alias, name in ALIASES.items()})
    return scope


def with_kernels(function):
    """A copy of an upstream function whose global names of HPU kernels (`ALIASES`) are the stand-in's:
    the function's own code, run with the stand-in kernels, its module left as it is."""
    scope = dict(function.__globals__)
    scope.update({alias: globals()[name] for alias, name in ALIASES.items()})
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = f"{function.__qualname__} (with mpt-kv's stand-in kernels)"
    return copy


class _AsOnHpu(ast.NodeTransformer):
    """`<x>.device.type == "hpu"` -> True (and `!= "hpu"`, `== "cpu"`, ... as an HPU answers them)."""

    def __init__(self):
        self.answered = []

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        left, right = node.left, node.comparators[0]
        if not (isinstance(left, ast.Attribute) and left.attr == "type" and isinstance(left.value, ast.Attribute)
                and left.value.attr == "device" and isinstance(right, ast.Constant) and isinstance(right.value, str)):
            return node
        answer = (right.value == "hpu") == isinstance(node.ops[0], ast.Eq)
        self.answered.append(f"line {node.lineno}: {ast.unparse(node)} -> {answer}")
        return ast.copy_location(ast.Constant(answer), node)


def hpu_branch(function):
    """The port's own `function` with its device tests answered as on an HPU (`q.device.type == "hpu"`
    is True), compiled from its source with its upstream file and line numbers, its kernels the
    stand-in's (`_kernel_globals`): the branch a Gaudi runs, where the CPU branch cannot run (mixtral's,
    gpt_oss's and the DeepSeek ports' RoPE: `GaudiPort.hpu_branches`). A function with no device test is
    an error, never a silent copy."""
    source = textwrap.dedent(inspect.getsource(function))
    tree = ast.parse(source)
    ast.increment_lineno(tree, function.__code__.co_firstlineno - 1)
    answer = _AsOnHpu()
    tree = ast.fix_missing_locations(answer.visit(tree))
    if not answer.answered:
        raise ValueError(f"{function.__module__}.{function.__qualname__} has no device test (`<x>.device.type == "
                         "'hpu'`): GaudiPort.hpu_branches names it for nothing")
    scope = _kernel_globals(function)
    exec(compile(tree, inspect.getsourcefile(function) or "<port>", "exec"), scope)
    branch = scope[function.__name__]
    branch.__qualname__ = f"{function.__qualname__} (its HPU branch: {'; '.join(answer.answered)})"
    return branch
