"""PyTorch adapter: allocate outputs with torch and launch on torch's current stream.

This module imports torch; nothing else in fa4_aot does.
"""

from __future__ import annotations

import torch

from .api import forward
from .arrays import DeviceArray

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def as_device_array(t: torch.Tensor) -> DeviceArray:
    from .errors import DeviceError, DTypeError

    if t.device.type != "cuda":
        raise DeviceError(f"tensor is on {t.device}; move it to a CUDA device")
    if t.dtype not in _DTYPES:
        raise DTypeError(f"tensor dtype {t.dtype} is not bf16, fp16 or fp32")
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype])


def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   softmax_scale: float | None = None, out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (b, s_q, h_q, d), k, v (b, s_k, h_kv, d); see fa4_aot.forward."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        b, s_q, h_q, _ = q.shape
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    arrays = [as_device_array(t) for t in (q, k, v, out, lse)]
    stream = torch.cuda.current_stream(q.device).cuda_stream
    forward(*arrays, causal=causal, softmax_scale=softmax_scale, stream=stream)
    return out, lse
