"""torch tensors as fa4_aot's arrays, without building more than a call needs: the
adapter's shared pieces (every module of fa4_aot.torch uses them)."""

from __future__ import annotations

import torch

from ..errors import DeviceError, DTypeError, ShapeError
from ..launch.arrays import DeviceArray

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
          torch.int32: "i32", torch.float8_e4m3fn: "e4m3"}
KERNEL_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # what q, k, v may be


def as_device_array(t: torch.Tensor) -> DeviceArray:
    """A DeviceArray view of torch tensor ``t`` (DeviceError for anything else, and for a
    tensor off the GPU; DTypeError for an element type no launch takes). The view holds
    t's address, not t: keep t alive for as long as launches take the view (a freed
    block is soon another tensor's, whose values a kernel would then read as its own)."""
    if not isinstance(t, torch.Tensor):
        raise DeviceError(f"a {type(t).__name__} is not a torch.Tensor")
    device = t.device
    if device.type != "cuda":
        raise DeviceError(f"tensor is on {device}; move it to a CUDA device")
    if t.dtype not in DTYPES:
        raise DTypeError(f"tensor dtype {t.dtype} is not bf16, fp16, fp32, uint8, int32 or float8_e4m3fn")
    # the device torch knows: fa4_aot then asks the driver nothing about the pointer
    return DeviceArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), DTYPES[t.dtype], device.index)


def stream_of(t: torch.Tensor) -> int:
    return current_stream(t.get_device())


# The raw handle of a device's current stream, as torch's own generated code asks for it,
# without building the Stream object torch.cuda.current_stream(device).cuda_stream does;
# the public spelling where this torch lacks the private one.
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda device: torch.cuda.current_stream(device).cuda_stream)


def repeat_key(kind: str, tensors, options) -> tuple:
    """What determines a launch, read off torch tensors without building DeviceArrays:
    a call with outputs given whose key was launched before is launched again at once
    (its arrays and options were checked then; the host path, benchmarks/launch_overhead.py).
    The caller puts the device among ``options``: an address freed on one device may be
    another device's later, and stream 0 is every device's default stream."""
    key = [kind]
    for t in tensors:
        key += (t.data_ptr(), t.shape, t.stride(), t.dtype)
    key += options
    return tuple(key)


def kernel_ready_dout(dout: torch.Tensor) -> torch.Tensor:
    """dout as a backward takes it: last dim contiguous, the other strides and the pointer
    16-byte aligned; else a copy in a fresh block (contiguous() would keep a contiguous
    view's misaligned pointer, which the checks then refuse). Autograd hands the backward
    whatever the graph made: an expanded gradient of sum(), a slice of a concatenation's."""
    size = dout.element_size()
    if dout.stride(-1) != 1 or any(s * size % 16 for s in dout.stride()[:-1]) or dout.data_ptr() % 16:
        return dout.clone(memory_format=torch.contiguous_format)
    return dout


def needs_grad(ctx, index: int) -> bool:
    """Whether a custom op's input ``index`` needs a gradient (False for an input the call
    left to its default, which ctx.needs_input_grad may not list)."""
    needs = ctx.needs_input_grad
    return index < len(needs) and bool(needs[index])


def passed(**named) -> dict:
    """The named tensors a call passed (those not None)."""
    return {name: t for name, t in named.items() if t is not None}


def check_tensors(rank4: dict, others: dict = None) -> None:
    """torch.Tensors (DeviceError otherwise, as for any non-array), ``rank4`` of rank 4
    (ShapeError): what the adapter reads before it allocates anything."""
    for name, t in {**rank4, **(others or {})}.items():
        if not isinstance(t, torch.Tensor):
            raise DeviceError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
    for name, t in rank4.items():
        if t.dim() != 4:
            raise ShapeError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim); got shape {tuple(t.shape)}")


def check_packed(packed: dict, others: dict = None) -> None:
    """As check_tensors, for packed varlen tensors: ``packed`` of rank 3 (total, heads,
    head_dim)."""
    check_tensors({}, {**packed, **(others or {})})
    for name, t in packed.items():
        if t.dim() != 3:
            raise ShapeError(f"{name} must have rank 3 (total, heads, head_dim); got shape {tuple(t.shape)}")


def check_on_gpu(named: dict) -> None:
    """torch.Tensors on a CUDA device, of a dtype a launch takes, read off their metadata
    alone (a torch.compile trace has no data pointers): before a custom op, whose
    dispatch would refuse a CPU tensor untyped."""
    check_tensors({}, named)
    for name, t in named.items():
        if t.device.type != "cuda":
            raise DeviceError(f"{name} is on {t.device}; move it to a CUDA device")
        if t.dtype not in DTYPES:
            raise DTypeError(f"{name} is {t.dtype}, not bf16, fp16, fp32, uint8, int32 or float8_e4m3fn")
