"""flash_attn_fwd and flash_attn_bwd: fa4_aot.forward and fa4_aot.backward on torch
tensors, outputs and workspace from torch's caching allocator, launches on torch's
current stream; and what the autograd paths over them (autograd.py, ops.py) share."""

from __future__ import annotations

import functools

import torch

from ..dense import backward_workspace_bytes, forward_workspace_bytes, run_backward, run_forward
from ..errors import Fa4AotError
from ..policy import DENSE_DECODE_MAX_SEQLEN_Q
from ..launch import checks
from ..launch.calls import default_library
from .tensors import KERNEL_DTYPES, as_device_array, check_tensors, current_stream, passed, repeat_key, stream_of


def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
                   causal: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   q_tiles: int | None = None, window_size=(-1, -1), softcap: float = 0.0,
                   learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (b, s_q, h_q, d), k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v): out (b,
    s_q, h_q, d_v); see fa4_aot.forward
    (``learnable_sink``: float32 (h_q,); decode shapes take the decode kernel, its split
    workspace from torch's allocator). Every option is keyword-only."""
    repeat, stream, workspace = None, None, None
    if (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and q.is_cuda and q.dim() == 4
            and k.dim() == 4 and v.dim() == 4 and type(out) in (torch.Tensor, type(None))
            and type(lse) in (torch.Tensor, type(None))
            and (learnable_sink is None or type(learnable_sink) is torch.Tensor)):
        # outputs (and a decode shape's workspace) made first, so that a call without them
        # (autograd's) repeats too: the caching allocator gives a training step's the same
        # addresses step after step
        out, lse = _outputs(q, v, out, lse)
        workspace = _workspace(q, k, v, causal, q_tiles, window_size, softcap, learnable_sink)
        device = q.get_device()
        stream = current_stream(device)
        repeat = ("fwd", q.data_ptr(), q.shape, q.stride(), q.dtype, k.data_ptr(), k.shape, k.stride(), k.dtype,
                  v.data_ptr(), v.shape, v.stride(), v.dtype, out.data_ptr(), out.shape, out.stride(), out.dtype,
                  lse.data_ptr(), lse.shape, lse.stride(), lse.dtype, softmax_scale, causal, q_tiles, window_size,
                  softcap, device, stream)
        if learnable_sink is not None:  # gpt-oss's layers all give sinks: their repeats too
            repeat += (learnable_sink.data_ptr(), learnable_sink.shape, learnable_sink.stride(), learnable_sink.dtype,
                       learnable_sink.device)
        if workspace is not None:  # the kept launch writes it: a repeat needs the same one
            repeat += (workspace.data_ptr(), workspace.numel())
        if default_library().launch_again(repeat):  # tensors.repeat_key's key, spelt out
            return out, lse
    return launch_forward(q, k, v, out, lse, workspace, softmax_scale=softmax_scale, causal=causal, q_tiles=q_tiles,
                          window_size=window_size, softcap=softcap, learnable_sink=learnable_sink, stream=stream,
                          keep=(repeat,) if repeat else ())


def launch_forward(q, k, v, out, lse, workspace, *, softmax_scale, causal, q_tiles, window_size, softcap,
                   learnable_sink, stream=None, keep=()) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_fwd past its repeat: every check, the outputs (and a decode shape's
    workspace) not given made, the launch kept under each key of ``keep`` too (keys an
    adapter builds from its own tensors, for its repeated calls: the SDPA hook's)."""
    check_tensors({"q": q, "k": k, "v": v}, passed(out=out, lse=lse, learnable_sink=learnable_sink,
                                                    workspace=workspace))
    out, lse = _outputs(q, v, out, lse)
    if workspace is None:
        workspace = _workspace(q, k, v, causal, q_tiles, window_size, softcap, learnable_sink)
    arrays = [as_device_array(t) for t in (q, k, v, out, lse)]
    sink = None if learnable_sink is None else as_device_array(learnable_sink)
    stream = stream_of(q) if stream is None else stream  # asked once a call
    run_forward(*arrays, softmax_scale, causal, q_tiles, stream, None, tuple((key, ()) for key in keep),
                window_size, softcap, sink, None if workspace is None else as_device_array(workspace))
    return out, lse


def _workspace(q, k, v, causal, q_tiles, window_size, softcap, learnable_sink) -> torch.Tensor | None:
    """The forward's workspace where the problem is a decode shape that the decode kernel
    splits (fa4_aot.forward_workspace_bytes), else None."""
    size = forward_workspace_size(q, k, v, causal, q_tiles, window_size, softcap, learnable_sink is not None)
    return torch.empty(size, dtype=torch.uint8, device=q.device) if size else None


def forward_workspace_size(q, k, v, causal, q_tiles=None, window_size=(-1, -1), softcap=0.0, sink=False) -> int:
    """Bytes of the forward's workspace for q, k, v (b, s, h, d) on a GPU: a decode shape's
    split workspace, 0 for the prefill kernel or a call the checks refuse."""
    if q_tiles is not None or q.shape[1] > DENSE_DECODE_MAX_SEQLEN_Q:  # the prefill kernel: no workspace
        return 0
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    try:
        return _forward_workspace_bytes(tuple(q.shape), tuple(k.shape), v.shape[-1], KERNEL_DTYPES.get(q.dtype),
                                        causal, window, softcap, sink, q.get_device(), default_library())
    except TypeError:  # an option that is not hashable: the checks say what they make of it
        return 0


@functools.lru_cache(maxsize=256)
def _forward_workspace_bytes(q_shape, k_shape, head_dim_v, dtype, causal, window_size, softcap, sink, device,
                             library) -> int:
    """forward_workspace_bytes of a problem on GPU ``device``; 0 for one the checks refuse
    (the call then raises there, with the checks' message)."""
    b, s_q, h_q, d = q_shape
    if dtype is None or k_shape[2] < 1:
        return 0
    try:
        return forward_workspace_bytes(b, s_q, h_q, k_shape[2], d, k_shape[1], causal=causal, window_size=window_size,
                                       softcap=softcap, learnable_sink=sink, dtype=dtype,
                                       sm_count=library.sm_count(device), head_dim_v=head_dim_v, library=library)
    except Fa4AotError:
        return 0


def _outputs(q: torch.Tensor, v: torch.Tensor, out, lse):
    """out and lse as given, or made for q (b, s_q, h_q, d) and v (..., d_v): out (b, s_q,
    h_q, d_v) of q's dtype, lse float32 (b, h_q, s_q)."""
    if out is None:
        out = q.new_empty((*q.shape[:3], v.shape[-1]))
    if lse is None:
        b, s_q, h_q, _ = q.shape
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    return out, lse


def flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, *, softmax_scale: float | None = None, causal: bool = False,
                   deterministic: bool = False, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
                   dv: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                   q_tiles: int | None = None, window_size=(-1, -1), softcap: float = 0.0,
                   learnable_sink: torch.Tensor | None = None, dsink: torch.Tensor | None = None) -> tuple:
    """(dq, dk, dv), and with ``learnable_sink`` (dq, dk, dv, dsink), dsink float32 (h_q,);
    see fa4_aot.backward, whose argument order this shares (q, k, v, out, dout, lse;
    ``q_tiles``, ``window_size``, ``softcap`` too). Every option is keyword-only. The
    workspace (uint8, at least ``fa4_aot.backward_workspace_bytes`` bytes, any contents)
    and the gradients come from torch's allocator unless given."""
    repeat, stream = None, None
    if (all(type(t) is torch.Tensor for t in (q, k, v, out, dout, lse)) and q.is_cuda and q.dim() == k.dim() == 4
            and all(type(t) in (torch.Tensor, type(None)) for t in (dq, dk, dv, workspace, learnable_sink, dsink))
            and (dsink is None or learnable_sink is not None)):  # a dsink alone is refused, never repeated
        # gradients and workspace made first, so that autograd's calls (none given) repeat
        # too: the caching allocator gives a training step's the same addresses each step
        dq, dk, dv, workspace, dsink = _gradients(q, k, v, (dq, dk, dv, workspace, dsink), causal, deterministic,
                                                  window_size, softcap, learnable_sink)
        sinks = () if learnable_sink is None else (learnable_sink, dsink)
        device = q.get_device()
        stream = current_stream(device)
        repeat = repeat_key("bwd", (q, k, v, out, dout, lse, dq, dk, dv, workspace) + sinks,
                            (softmax_scale, causal, deterministic, q_tiles, window_size, softcap, device, stream))
        if default_library().launch_again(repeat):
            return (dq, dk, dv) + sinks[1:]
    return launch_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, softmax_scale=softmax_scale, causal=causal,
                           deterministic=deterministic, q_tiles=q_tiles, window_size=window_size, softcap=softcap,
                           learnable_sink=learnable_sink, dsink=dsink, stream=stream,
                           keep=(repeat,) if repeat else ())


def launch_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, *, softmax_scale, causal, deterministic, q_tiles,
                    window_size, softcap, learnable_sink, dsink, stream=None, keep=()) -> tuple:
    """flash_attn_bwd past its repeat: every check, the gradients and workspace not given
    made, the launch kept under each key of ``keep`` too (as launch_forward's)."""
    check_tensors({"q": q, "k": k, "v": v, "out": out, "dout": dout},
                  {"lse": lse, **passed(dq=dq, dk=dk, dv=dv, workspace=workspace, learnable_sink=learnable_sink,
                                        dsink=dsink)})
    dq, dk, dv, workspace, dsink = _gradients(q, k, v, (dq, dk, dv, workspace, dsink), causal, deterministic,
                                              window_size, softcap, learnable_sink)
    arrays = [as_device_array(t) for t in (q, k, v, out, dout, lse, dq, dk, dv, workspace)]
    sink_arrays = [None if t is None else as_device_array(t) for t in (learnable_sink, dsink)]
    stream = stream_of(q) if stream is None else stream  # asked once a call
    run_backward(*arrays, softmax_scale, causal, deterministic, q_tiles, stream, None,
                 tuple((key, ()) for key in keep), window_size, softcap, *sink_arrays)
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


def _gradients(q, k, v, given, causal, deterministic, window_size, softcap, learnable_sink):
    """(dq, dk, dv, workspace, dsink) as ``given``, each one not given made: the gradients
    like q, k, v (dsink like the sinks, where there are sinks), the workspace of
    ``fa4_aot.backward_workspace_bytes`` bytes for the problem (kept per problem: its
    rules are evaluated once)."""
    dq, dk, dv, workspace, dsink = given
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if workspace is None:
        size = backward_workspace_size(q, k, v, causal, deterministic, window_size, softcap, learnable_sink is not None)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    if learnable_sink is not None and dsink is None:
        dsink = torch.empty_like(learnable_sink, memory_format=torch.contiguous_format)
    return dq, dk, dv, workspace, dsink


def backward_workspace_size(q, k, v, causal, deterministic, window_size=(-1, -1), softcap=0.0, sink=False) -> int:
    """Bytes of the backward's workspace for q, k, v (b, s, h, d) (a refusal is raised)."""
    local = checks.score_mods(causal, window_size, softcap, sink).local
    return _workspace_bytes(tuple(q.shape), tuple(k.shape), v.shape[-1], KERNEL_DTYPES.get(q.dtype), bool(causal),
                            bool(deterministic), local, default_library())


@functools.lru_cache(maxsize=256)
def _workspace_bytes(q_shape, k_shape, head_dim_v, dtype, causal, deterministic, local, library) -> int:
    """backward_workspace_bytes of a problem (a refusal is raised, not kept)."""
    b, s_q, h_q, d = q_shape
    return backward_workspace_bytes(b, s_q, h_q, d, causal=causal, deterministic=deterministic, seqlen_k=k_shape[1],
                                    heads_kv=k_shape[2], dtype=dtype, local=local, head_dim_v=head_dim_v,
                                    library=library)


def setup_context(ctx, inputs, output):
    """The forward's inputs (q, k, v, causal, softmax_scale, deterministic, window_left,
    window_right, softcap, learnable_sink) kept for the backward."""
    q, k, v, causal, softmax_scale, deterministic, left, right, softcap, sink = (*inputs, -1, -1, 0.0, None)[:10]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sink)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.window, ctx.softcap = (left, right), softcap


def backward_options(ctx) -> dict:
    """The window and softcap flash_attn_bwd takes again (setup_context's)."""
    return {"window_size": ctx.window, "softcap": ctx.softcap}
