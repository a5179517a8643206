"""flash_attn_func: autograd over the kernels, and the custom ops torch.compile traces
(imports torch; re-exported by ``fa4_aot.torch``, which imports this module when
``flash_attn_func`` is first asked for: registering the ops costs milliseconds that a
caller of ``flash_attn_fwd`` / ``flash_attn_bwd`` alone need not spend).

    from fa4_aot.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # differentiable
"""

from __future__ import annotations

import math

import torch

from . import checks
from .torch import _check_tensors, flash_attn_bwd, flash_attn_fwd


def _kernel_ready_dout(dout: torch.Tensor) -> torch.Tensor:
    """dout as the backward takes it: last dim contiguous, 16-byte-aligned strides."""
    if dout.stride(-1) != 1 or any(s % 8 for s in dout.stride()[:-1]):
        return dout.contiguous()
    return dout


class _FlashAttention(torch.autograd.Function):
    """Eager autograd over the kernels: the custom ops below are what torch.compile traces,
    but torch.library's per-call dispatch and aliasing checks cost about 100 us a forward
    and 400 a backward on the H200's host (benchmarks/launch_overhead.py), several times
    the launches themselves; eager calls take this path instead. Same kernels, same
    results."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, deterministic: bool):
        out, lse = flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)
        _setup_context(ctx, (q, k, v, causal, softmax_scale, deterministic), (out, lse))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(q, k, v, out, _kernel_ready_dout(dout), lse, softmax_scale=ctx.softmax_scale,
                                    causal=ctx.causal, deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None


@torch.library.custom_op("fa4_aot::fwd", mutates_args=(), device_types="cuda")
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal)


@_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale, deterministic):
    b, s_q, h_q, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h_q, s_q), dtype=torch.float32)


@torch.library.custom_op("fa4_aot::bwd", mutates_args=(), device_types="cuda")
def _bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
            lse: torch.Tensor, causal: bool, softmax_scale: float,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attn_bwd(q, k, v, out, _kernel_ready_dout(dout), lse, softmax_scale=softmax_scale, causal=causal,
                          deterministic=deterministic)


@_bwd_op.register_fake
def _(q, k, v, out, dout, lse, causal, softmax_scale, deterministic):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(q, k, v, out, dout, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
                    causal: bool = False, deterministic: bool = False, return_lse: bool = False):
    """Differentiable attention: q (b, s_q, h_q, d), k, v (b, s_k, h_kv, d) -> out like q
    (and its lse, float32 (b, h_q, s_q), with ``return_lse``). FA4's names; every option
    is keyword-only.

    The gradient flows to q, k and v through the backward kernels (not through lse).
    """
    _check_tensors({"q": q, "k": k, "v": v})
    scale = checks.softmax_scale(softmax_scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    causal, deterministic = checks.flag("causal", causal), checks.flag("deterministic", deterministic)
    if torch.compiler.is_compiling():  # traced: the registered custom ops
        out, lse = _fwd_op(q, k, v, causal, scale, deterministic)
    else:
        out, lse = _FlashAttention.apply(q, k, v, causal, scale, deterministic)
    return (out, lse) if checks.flag("return_lse", return_lse) else out
