"""flash_attn_func: autograd over the kernels (re-exported by ``fa4_aot.torch``, which
imports this module when ``flash_attn_func`` is first asked for). Eager calls take
``FlashAttention``; a torch.compile trace the custom ops of ``ops``, imported by the first
trace: registering them costs a fresh process some 10 ms (torch.library looks up each
fake's source) that eager callers need not spend.

    from fa4_aot.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # differentiable
"""

from __future__ import annotations

import math

import torch

from ..launch import checks
from ..launch.calls import default_library
from .dense import (backward_options, backward_workspace_size, flash_attn_bwd, flash_attn_fwd, forward_workspace_size,
                    launch_backward, launch_forward, setup_context)
from .tensors import check_tensors, current_stream, kernel_ready_dout


class FlashAttention(torch.autograd.Function):
    """Eager autograd over the kernels: the custom ops (ops.py) are what torch.compile traces,
    but torch.library's per-call dispatch and aliasing checks cost about 100 us a forward
    and 400 a backward on the H200's host (benchmarks/launch_overhead.py), several times
    the launches themselves; eager calls take this path instead. Same kernels, same
    results. A call without sinks takes the step's own repeat path (``_Step``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, deterministic: bool, window_left: int = -1,
                window_right: int = -1, softcap: float = 0.0, learnable_sink=None):
        ctx.step = None
        if learnable_sink is None and type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and q.is_cuda:
            out, lse = _Step.forward(ctx, q, k, v, causal, softmax_scale, deterministic, window_left, window_right,
                                     softcap)
        else:
            out, lse = flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                      window_size=(window_left, window_right), softcap=softcap,
                                      learnable_sink=learnable_sink)
        setup_context(ctx, (q, k, v, causal, softmax_scale, deterministic, window_left, window_right, softcap,
                            learnable_sink), (out, lse))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None, None, None, None, None, None
        q, k, v, out, lse, sink = ctx.saved_tensors
        if ctx.step is not None and type(dout) is _Tensor:
            return (*_Step.backward(ctx, q, k, v, out, lse, kernel_ready_dout(dout)),
                    None, None, None, None, None, None, None)
        if not ctx.needs_input_grad[9]:
            sink = None  # no sinks' gradient asked for: none computed
        grads = flash_attn_bwd(q, k, v, out, kernel_ready_dout(dout), lse, softmax_scale=ctx.softmax_scale,
                               causal=ctx.causal, deterministic=ctx.deterministic, learnable_sink=sink,
                               **backward_options(ctx))
        return *grads[:3], None, None, None, None, None, None, grads[3] if sink is not None else None


_Tensor = torch.Tensor


class _Step:
    """A training step's attention (no sinks) on its repeat path: the launches of
    flash_attn_fwd and flash_attn_bwd, kept under keys of the step's own. The outputs, gradients and
    workspaces are made here, so their sizes, strides and dtypes follow from q's, k's and
    v's and the options (the signature), and only their pointers join the keys: a step
    whose launches were made before with the same signature and pointers (the caching
    allocator gives a training loop's the same ones step after step) launches them again
    with no check and no packing. A new key takes the checked path (launch_forward,
    launch_backward: every check, then the launches kept under it); the workspace bytes
    are reckoned once per signature. (docs/design.md, "Run time: the host path")"""

    workspaces: dict = {}  # signature -> [forward workspace bytes, backward's or None until asked]
    KEPT = 1024  # signatures; all dropped past it (a shape that changes every step)

    @classmethod
    def forward(cls, ctx, q, k, v, causal, scale, deterministic, left, right, softcap):
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:  # refused by the checks, typed
            return flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right),
                                  softcap=softcap)
        library, device = default_library(), q.get_device()
        signature = ("step", q.shape, q.stride(), q.dtype, k.shape, k.stride(), k.dtype, v.shape, v.stride(),
                     v.dtype, device, causal, scale, deterministic, left, right, softcap, library)
        try:
            sizes = cls.workspaces.get(signature)
        except TypeError:  # an unhashable option: the checked path says what it makes of it
            return flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right),
                                  softcap=softcap)
        if sizes is None:
            if len(cls.workspaces) >= cls.KEPT:
                cls.workspaces.clear()
            sizes = cls.workspaces[signature] = [forward_workspace_size(q, k, v, causal, None, (left, right), softcap),
                                                 None]
        b, s_q, h_q, _ = q.shape
        out = q.new_empty((b, s_q, h_q, v.shape[3]))
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
        workspace = torch.empty(sizes[0], dtype=torch.uint8, device=q.device) if sizes[0] else None
        stream = current_stream(device)
        key = (signature, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
               workspace.data_ptr() if sizes[0] else 0, stream)
        if not library.launch_again(key):
            launch_forward(q, k, v, out, lse, workspace, softmax_scale=scale, causal=causal, q_tiles=None,
                           window_size=(left, right), softcap=softcap, learnable_sink=None, stream=stream,
                           keep=(key,))
        ctx.step = signature
        ctx.step_options = (library, causal, scale, deterministic, left, right, softcap)
        return out, lse

    @classmethod
    def backward(cls, ctx, q, k, v, out, lse, dout) -> tuple:
        """(dq, dk, dv) for the forward ``ctx`` keeps (its signature, ``ctx.step``)."""
        signature = ctx.step
        library, causal, scale, deterministic, left, right, softcap = ctx.step_options
        sizes = cls.workspaces.get(signature)
        if sizes is None or sizes[1] is None:  # a refusal raises here, typed, before anything is made
            size = backward_workspace_size(q, k, v, causal, deterministic, (left, right), softcap)
            if sizes is not None:
                sizes[1] = size
        else:
            size = sizes[1]
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
        stream = current_stream(q.get_device())
        key = (signature, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), dout.data_ptr(),
               dout.shape, dout.stride(), dout.dtype, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
               workspace.data_ptr(), stream)
        if not library.launch_again(key):
            launch_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, softmax_scale=scale, causal=causal,
                            deterministic=deterministic, q_tiles=None, window_size=(left, right), softcap=softcap,
                            learnable_sink=None, dsink=None, stream=stream, keep=(key,))
        return dq, dk, dv


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
                    causal: bool = False, deterministic: bool = False, return_lse: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, learnable_sink: torch.Tensor | None = None):
    """Differentiable attention: q (b, s_q, h_q, d), k, v (b, s_k, h_kv, d) -> out like q
    (and its lse, float32 (b, h_q, s_q), with ``return_lse``). FA4's names; every option
    is keyword-only; ``window_size``, ``softcap``, ``learnable_sink`` as fa4_aot.forward's.

    The gradient flows to q, k, v and learnable_sink through the backward kernels (not
    through lse), through the window and the softcap too.
    """
    check_tensors({"q": q, "k": k, "v": v}, {} if learnable_sink is None else {"learnable_sink": learnable_sink})
    scale = checks.softmax_scale(softmax_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal, deterministic = checks.flag("causal", causal), checks.flag("deterministic", deterministic)
    mods = checks.score_mods(causal, window_size, softcap, learnable_sink is not None)
    if not mods.local:
        causal = mods.causal  # a window of (-1, 0) is causal
    options = (causal, scale, deterministic, mods.left, mods.right, mods.softcap, learnable_sink)
    if torch.compiler.is_compiling():  # traced: the custom ops, registered on the first trace
        from .ops import fwd_op

        out, lse = fwd_op(q, k, v, *options)
    else:
        out, lse = FlashAttention.apply(q, k, v, *options)
    return (out, lse) if checks.flag("return_lse", return_lse) else out
