"""PyTorch adapter: torch ops (traceable by torch.compile) and autograd over the kernels.

    from fa4_aot.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # differentiable
    out, lse = flash_attn_func(q, k, v, return_lse=True)

This module and its siblings (``torch_autograd``: flash_attn_func; ``torch_ops``: its
custom ops, registered by its first torch.compile trace; ``torch_varlen``;
``torch_kvcache``; ``torch_sdpa``) import torch; nothing else in fa4_aot does. Launches go
to torch's current stream; outputs and the backward's workspace come from torch's
caching allocator. ``flash_attn_func`` and the varlen functions are imported from their
modules on first use (``_LAZY``).
"""

from __future__ import annotations

import torch

from . import api as _api
from .api import _backward as _launch_backward
from .api import _forward as _launch_forward
from .api import backward_workspace_bytes, default_library
from .arrays import DeviceArray
from .errors import DeviceError, ShapeError

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
           torch.int32: "i32"}
_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # what q, k, v may be


def as_device_array(t: torch.Tensor) -> DeviceArray:
    from .errors import DTypeError

    device = t.device
    if device.type != "cuda":
        raise DeviceError(f"tensor is on {device}; move it to a CUDA device")
    if t.dtype not in _DTYPES:
        raise DTypeError(f"tensor dtype {t.dtype} is not bf16, fp16, fp32, uint8 or int32")
    # the device torch knows: fa4_aot then asks the driver nothing about the pointer
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype], device.index)


def _stream(t: torch.Tensor) -> int:
    return _current_stream(t.get_device())


# The raw handle of a device's current stream, as torch's own generated code asks for it,
# without building the Stream object torch.cuda.current_stream(device).cuda_stream does;
# the public spelling where this torch lacks the private one.
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


def _repeat_key(kind: str, tensors, options) -> tuple:
    """What determines a launch, read off torch tensors without building DeviceArrays:
    a call with outputs given whose key was launched before is launched again at once
    (its arrays and options were checked then; the host path, benchmarks/launch_overhead.py).
    No device: under unified addressing a pointer names its device."""
    key = [kind]
    for t in tensors:
        key += (t.data_ptr(), t.shape, t.stride(), t.dtype)
    key += options
    return tuple(key)


def _given(**named) -> dict:
    return {name: t for name, t in named.items() if t is not None}


def _check_tensors(rank4: dict, others: dict = None) -> None:
    """torch.Tensors (DeviceError otherwise, as for any non-array), ``rank4`` of rank 4
    (ShapeError): what the adapter reads before it allocates anything."""
    for name, t in {**rank4, **(others or {})}.items():
        if not isinstance(t, torch.Tensor):
            raise DeviceError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
    for name, t in rank4.items():
        if t.dim() != 4:
            raise ShapeError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")


def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
                   causal: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                   q_tiles: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (b, s_q, h_q, d), k, v (b, s_k, h_kv, d); see fa4_aot.forward.
    Every option is keyword-only."""
    repeat, stream = None, None
    if type(out) is torch.Tensor and type(lse) is torch.Tensor and type(q) is torch.Tensor and q.is_cuda:
        stream = _current_stream(q.get_device())
        repeat = ("fwd", q.data_ptr(), q.shape, q.stride(), q.dtype, k.data_ptr(), k.shape, k.stride(), k.dtype,
                  v.data_ptr(), v.shape, v.stride(), v.dtype, out.data_ptr(), out.shape, out.stride(), out.dtype,
                  lse.data_ptr(), lse.shape, lse.stride(), lse.dtype, softmax_scale, causal, q_tiles, stream)
        if (_api._default_library or default_library()).launch_again(repeat):  # _repeat_key, spelt out
            return out, lse
    _check_tensors({"q": q, "k": k, "v": v}, _given(out=out, lse=lse))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        b, s_q, h_q, _ = q.shape
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    arrays = [as_device_array(t) for t in (q, k, v, out, lse)]
    stream = _stream(q) if stream is None else stream  # asked once a call
    _launch_forward(*arrays, softmax_scale, causal, q_tiles, stream, None, ((repeat, ()),) if repeat else ())
    return out, lse


def flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, *, softmax_scale: float | None = None, causal: bool = False,
                   deterministic: bool = False, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
                   dv: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                   q_tiles: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv); see fa4_aot.backward, whose argument order this shares (q, k, v, out,
    dout, lse; ``q_tiles`` too). Every option is keyword-only. The workspace (uint8, at
    least ``fa4_aot.backward_workspace_bytes`` bytes, any contents) comes from torch's
    allocator unless given."""
    given = (q, k, v, out, dout, lse, dq, dk, dv, workspace)
    repeat, stream = None, None
    if all(type(t) is torch.Tensor for t in given) and q.is_cuda:
        stream = _stream(q)
        repeat = _repeat_key("bwd", given, (softmax_scale, causal, deterministic, q_tiles, stream))
        if (_api._default_library or default_library()).launch_again(repeat):
            return dq, dk, dv
    _check_tensors({"q": q, "k": k, "v": v, "out": out, "dout": dout},
                   {"lse": lse, **_given(dq=dq, dk=dk, dv=dv, workspace=workspace)})
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    b, s_q, h_q, d = q.shape
    if workspace is None:
        size = backward_workspace_bytes(b, s_q, h_q, d, causal=causal, deterministic=deterministic,
                                        seqlen_k=k.shape[1], heads_kv=k.shape[2], dtype=_KERNEL_DTYPES.get(q.dtype))
        workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    arrays = [as_device_array(t) for t in (q, k, v, out, dout, lse, dq, dk, dv, workspace)]
    stream = _stream(q) if stream is None else stream  # asked once a call
    _launch_backward(*arrays, softmax_scale, causal, deterministic, q_tiles, stream, None,
                     ((repeat, ()),) if repeat else ())
    return dq, dk, dv


# name -> the module that defines it, imported on first use: registering a custom op
# costs milliseconds (torch.library reads the source of each) that a caller of
# flash_attn_fwd / flash_attn_bwd alone need not spend.
_LAZY = {"flash_attn_func": "torch_autograd", "_fwd_op": "torch_ops", "_bwd_op": "torch_ops",
         "_FlashAttention": "torch_autograd", "flash_attn_varlen_func": "torch_varlen",
         "flash_attn_varlen_fwd": "torch_varlen", "flash_attn_varlen_bwd": "torch_varlen",
         "flash_attn_with_kvcache": "torch_kvcache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
