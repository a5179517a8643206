"""PyTorch adapter for packed variable-length sequences (imports torch; re-exported by
``fa4_aot.torch``).

    from fa4_aot.torch import flash_attn_varlen_func
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

The forward only, for now: the varlen backward is not built, so a gradient through this
raises UnsupportedVariantError (fa4_aot.variants.NOT_BUILT_REASONS).
"""

from __future__ import annotations

import math

import torch

from .arrays import DeviceArray
from .errors import DeviceError, DTypeError, UnsupportedVariantError
from .varlen import forward_varlen

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}


def _array(t: torch.Tensor) -> DeviceArray:
    if t.device.type != "cuda":
        raise DeviceError(f"tensor is on {t.device}; move it to a CUDA device")
    if t.dtype not in _DTYPES:
        raise DTypeError(f"tensor dtype {t.dtype} is not one of {sorted(str(d) for d in _DTYPES)}")
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype], t.device.index)


def flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                          seqused_q=None, seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                          out=None, lse=None):
    """(out, lse): out (total_q, h_q, d) like q, lse (h_q, total_q) float32; rows of no
    sequence (past seqused, or past the last cu_seqlens_q) are left as allocated."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if lse is None:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    used = {n: _array(t) for n, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)) if t is not None}
    forward_varlen(*(_array(t) for t in (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)), int(max_seqlen_q),
                   int(max_seqlen_k), causal=causal, softmax_scale=softmax_scale,
                   stream=torch.cuda.current_stream(q.device).cuda_stream, **used)
    return out, lse


@torch.library.custom_op("fa4_aot::fwd_varlen", mutates_args=(), device_types="cuda")
def _fwd_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                   seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, causal: bool,
                   softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 seqused_q=seqused_q, seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale)


@_fwd_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, causal,
      softmax_scale):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def _no_backward(ctx, dout, dlse):
    raise UnsupportedVariantError("the variable-length backward is not built yet: flash_attn_varlen_func "
                                  "computes the forward only (fa4_aot.variants.NOT_BUILT_REASONS)")


def _remember(ctx, inputs, output):
    pass


_fwd_varlen_op.register_autograd(_no_backward, setup_context=_remember)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           seqused_q=None, seqused_k=None, softmax_scale: float | None = None, causal: bool = False,
                           deterministic: bool = False, return_lse: bool = False):
    """flash-attn's varlen attention: q (total_q, h_q, d), k, v (total_k, h_kv, d),
    cu_seqlens int32 (batch + 1,) on the device, max_seqlen ints from the caller; see
    fa4_aot.forward_varlen. Traceable by torch.compile (a custom op). ``deterministic``:
    the forward always is."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = _fwd_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                              seqused_q, seqused_k, bool(causal), scale)
    return (out, lse) if return_lse else out
