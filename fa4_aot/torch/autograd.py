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
from .dense import backward_options, flash_attn_bwd, flash_attn_fwd, setup_context
from .tensors import check_tensors, kernel_ready_dout


class FlashAttention(torch.autograd.Function):
    """Eager autograd over the kernels: the custom ops (ops.py) are what torch.compile traces,
    but torch.library's per-call dispatch and aliasing checks cost about 100 us a forward
    and 400 a backward on the H200's host (benchmarks/launch_overhead.py), several times
    the launches themselves; eager calls take this path instead. Same kernels, same
    results."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, deterministic: bool, window_left: int = -1,
                window_right: int = -1, softcap: float = 0.0, learnable_sink=None):
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
        if not ctx.needs_input_grad[9]:
            sink = None  # no sinks' gradient asked for: none computed
        grads = flash_attn_bwd(q, k, v, out, kernel_ready_dout(dout), lse, softmax_scale=ctx.softmax_scale,
                               causal=ctx.causal, deterministic=ctx.deterministic, learnable_sink=sink,
                               **backward_options(ctx))
        return *grads[:3], None, None, None, None, None, None, grads[3] if sink is not None else None


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
