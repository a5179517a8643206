"""The custom ops torch.compile traces for ``flash_attn_func`` (fa4_aot::fwd, fa4_aot::bwd,
the forward's autograd through the backward op) and ``flash_attn_with_kvcache``
(fa4_aot::kvcache), imported by their first trace: eager calls never register them.
"""

from __future__ import annotations

import torch

from .kvcache import attend_with_cache
from .dense import backward_options, flash_attn_bwd, flash_attn_fwd, setup_context
from .tensors import kernel_ready_dout, needs_grad


@torch.library.custom_op("fa4_aot::fwd", mutates_args=(), device_types="cuda")
def fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
           deterministic: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
           learnable_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                          softcap=softcap, learnable_sink=learnable_sink)


@fwd_op.register_fake
def _(q, k, v, causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
      learnable_sink=None):
    b, s_q, h_q, _ = q.shape
    return q.new_empty((b, s_q, h_q, v.shape[-1])), q.new_empty((b, h_q, s_q), dtype=torch.float32)


@torch.library.custom_op("fa4_aot::bwd", mutates_args=(), device_types="cuda")
def bwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
           lse: torch.Tensor, causal: bool, softmax_scale: float, deterministic: bool, window_left: int = -1,
           window_right: int = -1, softcap: float = 0.0, learnable_sink: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink empty (0,) without sinks."""
    grads = flash_attn_bwd(q, k, v, out, kernel_ready_dout(dout), lse, softmax_scale=softmax_scale, causal=causal,
                           deterministic=deterministic, window_size=(window_left, window_right), softcap=softcap,
                           learnable_sink=learnable_sink)
    return (*grads, q.new_empty((0,), dtype=torch.float32)) if learnable_sink is None else grads


@bwd_op.register_fake
def _(q, k, v, out, dout, lse, causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
      learnable_sink=None):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            q.new_empty((0,) if learnable_sink is None else learnable_sink.shape, dtype=torch.float32))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sink = ctx.saved_tensors
    if not needs_grad(ctx, 9):
        sink = None
    window = backward_options(ctx)["window_size"]
    dq, dk, dv, dsink = bwd_op(q, k, v, out, dout, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic, *window,
                               ctx.softcap, sink)
    return dq, dk, dv, None, None, None, None, None, None, dsink if sink is not None else None


fwd_op.register_autograd(_backward, setup_context=setup_context)


@torch.library.custom_op("fa4_aot::kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, cache_seqlens: torch.Tensor, page_table: torch.Tensor | None,
                softmax_scale: float | None, causal: bool, num_splits: int | None, window_left: int,
                window_right: int, softcap: float, learnable_sink: torch.Tensor | None,
                k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_with_kvcache under torch.compile: appends k, v into the caches (declared
    mutated) and attends; (out, lse)."""
    return attend_with_cache(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal, num_splits,
                    (window_left, window_right), softcap, learnable_sink, k_descale, v_descale)


@kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal, num_splits, window_left,
      window_right, softcap, learnable_sink, k_descale=None, v_descale=None):
    return (q.new_empty((*q.shape[:3], v_cache.shape[-1])),
            q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32))
