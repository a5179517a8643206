"""PyTorch adapter: torch ops (traceable by torch.compile) and autograd over the kernels.

    from fa4_aot.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # differentiable
    out, lse = flash_attn_func(q, k, v, return_lse=True)

This module imports torch; nothing else in fa4_aot does. Launches go to torch's current
stream; outputs and the backward's workspace come from torch's caching allocator.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .api import _backward as _launch_backward
from .api import _forward as _launch_forward
from .api import backward_workspace_bytes, default_library
from .arrays import DeviceArray
from .errors import DeviceError, ShapeError

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8"}
_KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # what q, k, v may be


def as_device_array(t: torch.Tensor) -> DeviceArray:
    from .errors import DTypeError

    device = t.device
    if device.type != "cuda":
        raise DeviceError(f"tensor is on {device}; move it to a CUDA device")
    if t.dtype not in _DTYPES:
        raise DTypeError(f"tensor dtype {t.dtype} is not bf16, fp16 or fp32")
    # the device torch knows: fa4_aot then asks the driver nothing about the pointer
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), _DTYPES[t.dtype], device.index)


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


def _repeat_key(kind: str, tensors, options) -> tuple:
    """What determines a launch, read off torch tensors without building DeviceArrays:
    a call with outputs given whose key was launched before is launched again at once
    (its arrays and options were checked then; the host path, benchmarks/launch_overhead.py)."""
    return (kind, *((t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()) for t in tensors), *options)


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
        stream = _stream(q)
        repeat = _repeat_key("fwd", (q, k, v, out, lse), (softmax_scale, causal, q_tiles, stream))
        if default_library().launch_again(repeat):
            return out, lse
    _check_tensors({"q": q, "k": k, "v": v}, _given(out=out, lse=lse))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if lse is None:
        b, s_q, h_q, _ = q.shape
        lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    arrays = [as_device_array(t) for t in (q, k, v, out, lse)]
    stream = _stream(q) if stream is None else stream  # asked once a call
    _launch_forward(*arrays, softmax_scale, causal, q_tiles, stream, None, (repeat,) if repeat else ())
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
        if default_library().launch_again(repeat):
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
                     (repeat,) if repeat else ())
    return dq, dk, dv


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


from .torch_varlen import flash_attn_varlen_bwd, flash_attn_varlen_func, flash_attn_varlen_fwd  # noqa: E402,F401,E501
