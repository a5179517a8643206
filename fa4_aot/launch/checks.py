"""Input checks for the attention launches: every rule, one typed error each, before launch.

The kernels address memory through TMA descriptors and int32 coordinates; anything they
cannot address exactly is refused here rather than read or written out of bounds.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

from ..errors import (
    CudaError, DeviceError, DTypeError, LayoutError, NoDeviceError, OptionError, OverlapError, ShapeError,
    UnsupportedVariantError,
)
from .arrays import ADDRESS_END, DeviceArray
from .driver import call, cu, init

INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
TMA_DIM_MAX = 2**32
TMA_STRIDE_MAX = 2**40


# a NamedTuple: made at import, it costs a fresh process a tenth of a frozen dataclass's time
class ForwardProblem(NamedTuple):
    """A dense call's sizes. ``head_dim``: the kernels' (calls.served: the narrowest built
    head dim at least as wide as both tensors' own); ``columns``: q and k's head dim,
    ``columns_v``: v and out's."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    columns: int
    columns_v: int

    @property
    def sizes(self) -> dict:
        return {
            "batch": self.batch, "seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k,
            "heads_q": self.heads_q, "heads_kv": self.heads_kv, "head_dim": self.head_dim, "columns": self.columns,
            "columns_v": self.columns_v,
        }


def check_bshd(name: str, t: DeviceArray) -> None:
    if len(t.shape) != 4:
        raise ShapeError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim); got shape {t.shape}")
    if any(n <= 0 for n in t.shape):
        raise ShapeError(f"{name} has a zero or negative size: shape {t.shape}")
    if any(n > INT32_MAX for n in t.shape):
        raise ShapeError(f"{name} shape {t.shape} has a size past 2**31-1")
    if t.shape[3] * t.itemsize % 16:
        raise UnsupportedVariantError(f"{name} head_dim {t.shape[3]}: the kernels serve multiples of "
                                      f"{16 // t.itemsize} (whole 16-byte units a row)")
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
    dv = v.shape[3]
    if k.shape[0] != b or k.shape[3] != d:
        raise ShapeError(f"k {k.shape} must be (batch={b}, seqlen_k, heads_kv, head_dim={d}) to match q {q.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ShapeError(f"v {v.shape} must be (batch, seqlen_k, heads_kv) = {k.shape[:3]} like k, with its own "
                         "head_dim")
    if out.shape != (b, sq, hq, dv):
        raise ShapeError(f"out {out.shape} must be q's (batch, seqlen_q, heads_q) with v's head_dim: "
                         f"{(b, sq, hq, dv)}")
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
    return ForwardProblem(b, sq, sk, hq, hkv, max(d, dv), q.dtype, d, dv)


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
        init()  # no driver: NoDeviceError, as where the arrays name their device
        try:
            mem_type, ordinal = call(cu.cuPointerGetAttributes, len(attrs), attrs, t.ptr)
        except NoDeviceError:
            raise  # no driver: the same error whether or not an array names its device
        except CudaError as e:
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
FLOAT32_MAX = 3.4028234663852886e38
SCALE_MAX = FLOAT32_MAX / math.log2(math.e)  # the kernels take scale * log2(e) as a float32


def softmax_scale(value) -> float | None:
    """None (1/sqrt(head_dim), applied later) or a real number whose multiple by log2(e)
    is a finite float32, as a float; a string, a bool, NaN or an infinity is refused."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"softmax_scale must be a real number or None; got {value!r} ({type(value).__name__})")
    scale = float(value)
    if not abs(scale) < SCALE_MAX:  # NaN too
        raise OptionError(f"softmax_scale must be finite and below {SCALE_MAX:.3g} in magnitude (float32 "
                          f"times log2(e)); got {value!r}")
    return scale


def flag(name: str, value) -> bool:
    """A bool option: True, False (numpy's bools, and the ints 0 and 1, taken too)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):  # numpy's too
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise OptionError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")


class ScoreMods(NamedTuple):
    """What a call adds to plain attention: a window (left, right keys of each query's
    diagonal, -1 unbounded; causal is right 0), a softcap (0: none), whether it gives
    sinks. ``local``: whether it takes the local kernels (window or sinks or softcap; a
    window of (-1, -1) or (-1, 0) alone is the plain or the causal kernel)."""

    left: int
    right: int
    softcap: float
    sink: bool

    @property
    def local(self) -> bool:
        return self.sink or self.softcap > 0 or self.left >= 0 or self.right > 0

    def keys_seen(self, seqlen_k: int) -> int:
        """The most keys one query row sees: ``seqlen_k``, or a window's span where it is
        bounded on both sides and narrower."""
        if self.left >= 0 and self.right >= 0:
            return min(seqlen_k, self.left + self.right + 1)
        return seqlen_k

    @property
    def causal(self) -> bool:
        """Where not local: whether the plain kernel is the causal one."""
        return self.right == 0

    def axes(self) -> dict:
        """The variant axes of the kernel that serves the call: causal or not, or local."""
        if self.local:
            return {"causal": False, "local": True, "softcap": self.softcap > 0}
        return {"causal": self.causal}

    def add_launch_values(self, values: dict, tensors: dict, scale: float, log2e: float) -> None:
        """Where local, the kernels' run-time values for softmax_scale ``scale`` into
        ``values`` (the softmax's scale replaced by the cap's where capped), and, without
        sinks, lse's address for the sinks' (use_sink 0: never read)."""
        if not self.local:
            return
        cap = self.softcap
        values.update({"window_left": self.left, "window_right": self.right, "use_sink": int(self.sink),
                       "scale_log2": (cap if cap > 0 else scale) * log2e,
                       "softcap_scale": scale / cap if cap > 0 else 0.0})
        tensors.setdefault("sink", tensors["lse"])


def backward_mods(causal: bool, window_size, softcap, learnable_sink, dsink) -> ScoreMods:
    """A backward's ScoreMods (``score_mods``, with the forward's options): ``sink`` where
    the call asks for the sinks' gradient (``dsink`` given, which needs the
    ``learnable_sink`` it is the gradient of); OptionError for a dsink without sinks."""
    if dsink is not None and learnable_sink is None:
        raise OptionError("dsink is the gradient of learnable_sink: give both, or neither")
    return score_mods(causal, window_size, softcap, learnable_sink is not None)


def add_backward_values(mods: ScoreMods, values: dict, tensors: dict, slots: int, scale: float,
                        log2e: float) -> None:
    """Where local, a backward's run-time values: the window; where ``tensors`` has a
    dsink, use_sink 1 and the sink_partial slots per head (the preprocess's blocks);
    where capped, the exponentials' scale cap * log2(e) and softmax_scale / cap (dQ and
    dK keep ``scale``, the derivative's outer factor). Absent arrays read as lse's
    address (never read where use_sink is 0)."""
    if not mods.local:
        return
    cap = mods.softcap
    values.update({"window_left": mods.left, "window_right": mods.right, "use_sink": int("dsink" in tensors),
                   "sink_slots": slots, "softcap_scale": scale / cap if cap > 0 else 0.0})
    if cap > 0:
        values["scale_log2"] = cap * log2e
    tensors.setdefault("sink", tensors["lse"])
    tensors.setdefault("dsink", tensors["lse"])


def score_mods(causal: bool, window_size, softcap, sink: bool) -> ScoreMods:
    """A call's ScoreMods from flash-attn's options: ``window_size`` (left, right), ints of
    at least -1 (None for -1), within int32; causal makes right 0; ``softcap`` a finite
    number >= 0 (0 or None: none)."""
    # the options of every call without a window or a cap, answered without the checks'
    # abstract-class tests (3 us a call, twice a training step's attention)
    if (type(window_size) is tuple and window_size in _PLAIN_WINDOWS and type(window_size[0]) is int
            and type(window_size[1]) is int and (softcap is None or type(softcap) in (float, int) and softcap == 0)):
        return ScoreMods(-1, 0 if causal or window_size[1] == 0 else -1, 0.0, bool(sink))
    if window_size is None:
        window_size = (-1, -1)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise OptionError(f"window_size must be a pair (left, right); got {window_size!r}")
    sides = []
    for side, n in zip(("left", "right"), window_size):
        n = -1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not -1 <= n <= INT32_MAX:
            raise OptionError(f"window_size's {side} must be an int >= -1 (-1 or None: unbounded); got {n!r}")
        sides.append(int(n))
    if softcap is None:
        softcap = 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 <= float(softcap) < SCALE_MAX:
        raise OptionError(f"softcap must be a finite number >= 0 (0: none); got {softcap!r}")
    left, right = sides
    if causal:
        right = 0
    return ScoreMods(left, right, float(softcap), bool(sink))


_PLAIN_WINDOWS = ((-1, -1), (-1, 0))


def check_sink(sink: DeviceArray, heads_q: int, name: str = "learnable_sink") -> None:
    """The sinks (or, ``name`` dsink, their gradient): float32 (heads_q,), contiguous, 4-byte aligned."""
    if sink.dtype != "fp32":
        raise DTypeError(f"{name} must be float32; got {sink.dtype}")
    if tuple(sink.shape) != (heads_q,):
        raise ShapeError(f"{name} {sink.shape} must be (heads_q,) = ({heads_q},)")
    if heads_q > 1 and sink.strides[0] != 1:
        raise LayoutError(f"{name} must be contiguous; stride {sink.strides[0]}")
    if sink.ptr % 4:
        raise LayoutError(f"{name}'s data pointer {sink.ptr:#x} is not 4-byte aligned")


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
    if not 0 <= handle < ADDRESS_END:
        raise OptionError(f"stream handle {handle} is not a 64-bit handle")
    return handle


def positive_int(name: str, value) -> int:
    """A size option given as a number (max_seqlen): a positive int within int32, not a
    bool, a float or a string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= INT32_MAX:
        raise ShapeError(f"{name} must be a positive int below 2**31; got {value!r}")
    return int(value)


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
    for name, t, like in (("dout", dout, out), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t.dtype != q.dtype:
            raise DTypeError(f"{name} is {t.dtype}; it must be {q.dtype} like q")
        check_bshd(name, t)
        if t.shape != like.shape:
            raise ShapeError(f"{name} {t.shape} must have shape {like.shape}")
    return problem


# ---------------------------------------------------------------- overlaps
def written(arrays: dict, *names) -> dict:
    """The arrays of ``names`` a call gives: those its launches write."""
    return {n: arrays[n] for n in names if n in arrays}


def read(arrays: dict, *written_names) -> dict:
    """The arrays a call gives but ``written_names``: those its launches only read."""
    return {n: a for n, a in arrays.items() if n not in written_names}


def check_no_overlap(outputs: dict, inputs: dict) -> None:
    """OverlapError unless each of ``outputs`` (arrays a launch writes) shares no byte with
    another output or with any of ``inputs`` (arrays it reads). Views of one packed tensor
    (the q, k, v or dq, dk, dv of a (b, s, 3, h, d) buffer) share none and pass.

    The arrays' byte ranges are swept in order of their starts, so that only ranges that
    meet are compared (``may_share``): a call's dozen arrays mostly lie apart
    (docs/design.md, "Run time: the host path"). The pair reported is the first met: the
    output with the lower start, or the output where one of the two is an input."""
    spans = sorted(((span, written, name, t)
                    for written, given in ((True, outputs), (False, inputs)) for name, t in given.items()
                    for span in (_span(t),) if span is not None), key=lambda x: x[0][0])
    open_ = []  # the ranges swept whose ends are past the current start
    for span, written, name, t in spans:
        open_ = [x for x in open_ if x[0][1] > span[0]]
        for other_span, other_written, other, u in open_:
            if (written or other_written) and may_share(u, t, other_span, span):
                out, o, inp, i = (other, u, name, t) if other_written else (name, t, other, u)
                raise OverlapError(f"{out} shares memory with {inp} ({out} at {o.ptr:#x}, {inp} at {i.ptr:#x}): "
                                   f"writing {out} would corrupt {inp}; give it its own memory")
        open_.append((span, written, name, t))


def _span(t: DeviceArray) -> tuple[int, int] | None:
    """The byte range [start, end) ``t``'s elements lie in; None if it has none."""
    low = high = 0
    for n, s in zip(t.shape, t.strides):  # one plain loop: a checked call takes a dozen spans
        if n <= 0:
            return None
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    size = t.itemsize
    return t.ptr + low * size, t.ptr + (high + 1) * size


def may_share(a: DeviceArray, b: DeviceArray, span_a=False, span_b=False) -> bool:
    """Whether ``a`` and ``b`` may have a byte in common: exactly for two views of one
    layout (same strides and item size: the parts of a packed tensor), else whether their
    byte ranges meet (``span_a``, ``span_b``: their ``_span``s where known)."""
    span_a = _span(a) if span_a is False else span_a
    span_b = _span(b) if span_b is False else span_b
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    delta, rem = divmod(b.ptr - a.ptr, a.itemsize)
    if (a.itemsize != b.itemsize or a.strides != b.strides or len(a.shape) != len(b.shape) or rem
            or any(s <= 0 for n, m, s in zip(a.shape, b.shape, a.strides) if max(n, m) > 1)):
        return True
    # an element of a, sum(i_k s_k), is one of b, delta + sum(j_k s_k), iff
    # sum(c_k s_k) = delta for digits c_k = i_k - j_k in [-(nb_k - 1), na_k - 1]
    axes = sorted(((s, na, nb) for s, na, nb in zip(a.strides, a.shape, b.shape) if max(na, nb) > 1), reverse=True)
    return _reachable(delta, axes, [64])


def _reachable(target: int, axes: list, budget: list) -> bool:
    """Whether digits on ``axes`` ((stride, na, nb), strides descending) sum to ``target``;
    True where the search would pass its ``budget`` of steps (a conservative answer)."""
    if not axes:
        return target == 0
    budget[0] -= 1
    if budget[0] < 0:
        return True
    (stride, na, nb), rest = axes[0], axes[1:]
    low = -sum((m - 1) * s for s, _, m in rest)
    high = sum((n - 1) * s for s, n, _ in rest)
    first = max(-(nb - 1), -((high - target) // stride))  # ceil((target - high) / stride)
    last = min(na - 1, (target - low) // stride)
    if last - first > 3:
        return True
    return any(_reachable(target - c * stride, rest, budget) for c in range(first, last + 1))
