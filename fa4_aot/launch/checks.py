"""Input checks for the attention launches: every rule, one typed error each, before launch.

The kernels address memory through TMA descriptors and int32 coordinates; anything they
cannot address exactly is refused here rather than read or written out of bounds.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

from .arrays import DeviceArray
from .driver import call, cu
from ..errors import DeviceError, DTypeError, LayoutError, OptionError, ShapeError

INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
TMA_DIM_MAX = 2**32
TMA_STRIDE_MAX = 2**40


# a NamedTuple: made at import, it costs a fresh process a tenth of a frozen dataclass's time
class ForwardProblem(NamedTuple):
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str

    @property
    def sizes(self) -> dict:
        return {
            "batch": self.batch, "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
            "heads_q": self.heads_q, "heads_kv": self.heads_kv, "head_dim": self.head_dim,
        }


def check_bshd(name: str, t: DeviceArray) -> None:
    if len(t.shape) != 4:
        raise ShapeError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim); got shape {t.shape}")
    if any(n <= 0 for n in t.shape):
        raise ShapeError(f"{name} has a zero or negative size: shape {t.shape}")
    if any(n > INT32_MAX for n in t.shape):
        raise ShapeError(f"{name} shape {t.shape} has a size past 2**31-1")
    if t.strides[3] != 1:
        raise LayoutError(f"{name}'s last dimension must be contiguous (stride 1); strides are {t.strides}")
    for axis in range(3):
        byte_stride = t.strides[axis] * t.itemsize
        if t.shape[axis] > 1 and (byte_stride <= 0 or byte_stride % 16 or byte_stride >= TMA_STRIDE_MAX):
            raise LayoutError(
                f"{name} stride {t.strides[axis]} of dim {axis} is {byte_stride} bytes: strides must be "
                "positive multiples of 16 bytes below 2**40 (e.g. make the tensor contiguous)"
            )
    if t.ptr % 16:
        raise LayoutError(f"{name}'s data pointer {t.ptr:#x} is not 16-byte aligned")


def check_forward(q: DeviceArray, k: DeviceArray, v: DeviceArray, out: DeviceArray,
                  lse: DeviceArray) -> ForwardProblem:
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dtype not in ("bf16", "fp16"):
            raise DTypeError(f"{name} is {t.dtype}; q, k, v and out must be bf16 or fp16")
    if len({q.dtype, k.dtype, v.dtype, out.dtype}) != 1:
        raise DTypeError(
            f"q, k, v, out must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}"
        )
    if lse.dtype != "fp32":
        raise DTypeError(f"lse must be fp32; got {lse.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        check_bshd(name, t)
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ShapeError(f"k {k.shape} must be (batch={b}, seqlen_k, heads_kv, head_dim={d}) to match q {q.shape}")
    if v.shape != k.shape:
        raise ShapeError(f"v {v.shape} must have k's shape {k.shape}")
    if out.shape != q.shape:
        raise ShapeError(f"out {out.shape} must have q's shape {q.shape}")
    if hq % hkv:
        raise ShapeError(f"heads_q={hq} must be a multiple of heads_kv={hkv} (MQA/GQA)")
    if tuple(lse.shape) != (b, hq, sq):
        raise ShapeError(f"lse {lse.shape} must be (batch, heads_q, seqlen_q) = {(b, hq, sq)}")
    if tuple(lse.strides) != (hq * sq, sq, 1):
        raise LayoutError(f"lse must be contiguous; strides {lse.strides}, expected {(hq * sq, sq, 1)}")
    if lse.ptr % 4:
        raise LayoutError(f"lse's data pointer {lse.ptr:#x} is not 4-byte aligned")
    if b * hq * sq > INT32_MAX:
        raise ShapeError(f"batch*heads_q*seqlen_q = {b * hq * sq} overflows the kernel's int32 LSE index")
    if hq > GRID_YZ_MAX or b > GRID_YZ_MAX:
        raise ShapeError(f"heads_q={hq} and batch={b} must each be at most {GRID_YZ_MAX} (grid limits)")
    return ForwardProblem(b, sq, sk, hq, hkv, d, q.dtype)


def device_of(arrays: dict[str, DeviceArray]) -> int:
    """The one CUDA device all arrays live on; host or foreign memory is refused. An
    array whose producer gave its device (DeviceArray.device) is taken at its word; the
    driver is asked about the others' pointers (about 8 us an array)."""
    attrs = [
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    ]
    devices = {}
    for name, t in arrays.items():
        if t.device is not None:
            devices[name] = t.device
            continue
        try:
            mem_type, ordinal = call(cu.cuPointerGetAttributes, len(attrs), attrs, t.ptr)
        except Exception as e:
            raise DeviceError(f"{name} ({t.ptr:#x}) is not CUDA memory: {e}") from e
        if int(mem_type) != int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE):
            raise DeviceError(f"{name} is not device memory (memory type {int(mem_type)}); copy it to the GPU")
        devices[name] = int(ordinal)
    if len(set(devices.values())) != 1:
        raise DeviceError(f"arrays are on different devices: {devices}")
    return next(iter(devices.values()))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# ---------------------------------------------------------------- options
def softmax_scale(value) -> float | None:
    """None (1/sqrt(head_dim), applied later) or a finite real number, as a float; a
    string, a bool, NaN or an infinity is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"softmax_scale must be a real number or None; got {value!r} ({type(value).__name__})")
    scale = float(value)
    if not math.isfinite(scale):
        raise OptionError(f"softmax_scale must be finite; got {value!r}")
    return scale


def flag(name: str, value) -> bool:
    """A bool option: True, False (numpy's bools, and the ints 0 and 1, taken too)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy's too
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise OptionError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")


def q_tiles(value, declared=(1, 2)) -> int | None:
    """None (picked by problem) or one of ``declared``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) not in declared:
        raise OptionError(f"q_tiles must be None or one of {declared}; got {value!r}")
    return int(value)


def stream_handle(value) -> int:
    """A raw CUstream handle as an int (0: the legacy default stream, 2: per-thread), from
    an int or an object that converts to one (cuda-python's CUstream)."""
    if value is None or isinstance(value, (bool, str, bytes, float)):
        raise OptionError(f"stream must be a CUstream handle (an int); got {value!r}")
    try:
        handle = int(value)
    except (TypeError, ValueError) as e:
        raise OptionError(f"stream must be a CUstream handle (an int); got {value!r}") from e
    if handle < 0:
        raise OptionError(f"stream handle {handle} is negative")
    return handle


def check_workspace(t: DeviceArray) -> None:
    """The backward's workspace is taken as bytes from its pointer: contiguous."""
    expected, acc = [], 1
    for n in reversed(t.shape):
        expected.append(acc)
        acc *= n
    if any(n != 1 and s != e for n, s, e in zip(t.shape, t.strides, reversed(expected))):
        raise LayoutError(f"workspace must be contiguous; shape {t.shape}, strides {t.strides}")


def check_sizes(**sizes) -> None:
    """Problem sizes given as numbers: positive ints within the kernels' int32 range."""
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ShapeError(f"{name} must be an int; got {n!r}")
        if not 0 < n <= INT32_MAX:
            raise ShapeError(f"{name}={n} must be positive and at most 2**31-1")


def check_backward(q: DeviceArray, k: DeviceArray, v: DeviceArray, out: DeviceArray,
                   dout: DeviceArray, lse: DeviceArray, dq: DeviceArray, dk: DeviceArray,
                   dv: DeviceArray) -> ForwardProblem:
    problem = check_forward(q, k, v, out, lse)
    for name, t, like in (("dout", dout, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, k)):
        if t.dtype != q.dtype:
            raise DTypeError(f"{name} is {t.dtype}; it must be {q.dtype} like q")
        check_bshd(name, t)
        if t.shape != like.shape:
            raise ShapeError(f"{name} {t.shape} must have shape {like.shape}")
    return problem
