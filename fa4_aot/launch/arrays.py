"""Device arrays from any framework, without importing the framework.

``DeviceArray`` is the raw layer: a device pointer, a shape, element strides and a dtype
name. ``as_device_array`` turns into one anything that speaks
``__cuda_array_interface__`` (CuPy, Numba, PyTorch for fp16/fp32, JAX) or ``__dlpack__``
(PyTorch, CuPy, JAX, incl. bf16), reading the DLPack capsule with ctypes.

Streams: given the launch's stream, a DLPack producer is asked for the array on it
(``__dlpack__(stream=dlpack_stream(handle))``: the producer makes that stream wait for its
work), and a ``__cuda_array_interface__`` (v3) ``stream`` that is not the launch's is
returned, for the launch to wait on it first (``as_device_arrays``; the loader records an
event on it and makes the launch stream wait for that event).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..errors import DeviceError, DTypeError, LayoutError, ShapeError

# u8: workspaces; i32: sequence lengths; e4m3: FP8 KV caches (float8_e4m3fn)
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "u8": 1, "i32": 4, "e4m3": 1}


_EXACT_INT = frozenset({int})
ADDRESS_END = 2**64  # addresses and handles are 64-bit


@dataclass(frozen=True)
class DeviceArray:
    ptr: int  # device address of element [0, 0, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # a name of ITEMSIZE
    # The CUDA device ordinal, where the array's producer says it (torch, DLPack); None:
    # fa4_aot.launch.checks.device_of asks the driver about the pointer.
    device: int | None = None

    def __post_init__(self):
        # the common case in one pass of C-level checks (this runs for every array of every
        # call: the host path, benchmarks/launch_overhead.py); the detailed refusal after
        shape, strides = self.shape, self.strides
        if not (type(self.ptr) is int and 0 <= self.ptr < ADDRESS_END and type(shape) is tuple and type(strides) is tuple
                and _EXACT_INT.issuperset(map(type, shape + strides)) and self.dtype in ITEMSIZE
                and len(shape) == len(strides)):
            self._refuse()

    def _refuse(self):
        if isinstance(self.ptr, bool) or not isinstance(self.ptr, int) or not 0 <= self.ptr < ADDRESS_END:
            raise DeviceError(f"ptr must be a device address (an int in [0, 2**64)); got {self.ptr!r}")
        for what, dims in (("shape", self.shape), ("strides", self.strides)):
            if not isinstance(dims, tuple) or any(isinstance(n, bool) or not isinstance(n, int) for n in dims):
                raise (ShapeError if what == "shape" else LayoutError)(f"{what} must be a tuple of ints; got {dims!r}")
        if self.dtype not in ITEMSIZE:
            raise DTypeError(f"dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        if len(self.shape) != len(self.strides):
            raise LayoutError(f"shape {self.shape} and strides {self.strides} differ in rank")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def as_launch_tensor(self) -> dict:
        return {"ptr": self.ptr, "shape": self.shape, "strides": self.strides, "itemsize": self.itemsize}


_CAI_TYPES = {"<f2": "fp16", "<f4": "fp32", "<V2": "bf16", "|u1": "u8", "<i4": "i32"}


# CUstream handles of the default streams, as the driver and both protocols spell them
LEGACY_STREAM, PER_THREAD_STREAM = 1, 2


def dlpack_stream(handle: int) -> int:
    """The ``stream`` a DLPack consumer passes for a launch on CUstream ``handle``: 1 for
    the legacy default stream (handle 0 or CU_STREAM_LEGACY), 2 for the per-thread one,
    the handle itself otherwise (the protocol disallows 0; -1, no synchronization, is
    refused by some producers, JAX's among them)."""
    return LEGACY_STREAM if handle in (0, LEGACY_STREAM) else handle


def _same_stream(a: int, b: int) -> bool:
    return dlpack_stream(a) == dlpack_stream(b)


def _from_cai(obj, stream: int | None = None) -> tuple[DeviceArray, int | None]:
    """The array, and the producer's stream where the launch must wait for it (v3's
    ``stream``: None, or a stream other than ``stream``), else None."""
    try:
        cai = obj.__cuda_array_interface__
        typestr = cai["typestr"]
        shape = tuple(int(n) for n in cai["shape"])
        ptr = int(cai["data"][0])
    except Exception as e:  # a producer's own refusal, or a malformed interface
        raise DeviceError(f"{type(obj).__name__}.__cuda_array_interface__ cannot be read: {e!r}") from e
    producer = cai.get("stream")
    if producer is not None:
        producer = int(producer)
        if producer == 0:
            raise DeviceError("__cuda_array_interface__ stream 0 is disallowed (ambiguous); the producer is wrong")
    wait = producer if producer is not None and stream is not None and not _same_stream(producer, stream) else None
    descr = cai.get("descr")
    dtype = _CAI_TYPES.get(typestr)
    if typestr == "<V2" and not (descr and "bfloat16" in str(descr)):
        dtype = None
    if dtype is None:
        raise DTypeError(f"unsupported element type {typestr!r} (descr {descr!r}); use bf16 or fp16")
    itemsize = ITEMSIZE[dtype]
    if cai.get("strides") is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    else:
        byte_strides = tuple(int(s) for s in cai["strides"])
        if any(s % itemsize for s in byte_strides):
            raise LayoutError(f"strides {byte_strides} (bytes) are not whole elements")
        strides = tuple(s // itemsize for s in byte_strides)
    return DeviceArray(ptr, shape, strides, dtype), wait


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
# kDLInt=0, kDLUInt=1, kDLFloat=2, kDLBfloat=4, kDLFloat8_e4m3fn=10 (DLPack 1.1)
_DL_TYPES = {(2, 16): "fp16", (2, 32): "fp32", (4, 16): "bf16", (1, 8): "u8", (0, 32): "i32", (10, 8): "e4m3"}


def _from_dlpack(obj, stream: int | None = None) -> DeviceArray:
    """The array, asked of its producer on the launch's ``stream`` where given (the
    producer then orders its own work before that stream's), else with no stream."""
    if hasattr(obj, "__dlpack_device__"):
        device_type, _ = obj.__dlpack_device__()
        if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise DeviceError(
                f"array is on DLPack device type {int(device_type)}, not a CUDA device: "
                "move it to the GPU first"
            )
    try:
        capsule = obj.__dlpack__() if stream is None else obj.__dlpack__(stream=dlpack_stream(stream))
    except Exception as e:  # the producer's refusal (e.g. torch: a tensor that requires grad)
        raise DeviceError(f"{type(obj).__name__}.__dlpack__ refused: {e!r}") from e
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # A DLManagedTensor (and the versioned one's dl_tensor after its header) starts with DLTensor.
    try:
        address = get(capsule, b"dltensor")
    except ValueError as e:
        raise DeviceError(f"unsupported DLPack capsule: {e}") from e
    t = _DLTensor.from_address(address)
    if t.device.device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise DeviceError(
            f"array is on DLPack device type {t.device.device_type}, not a CUDA device: "
            "move it to the GPU first"
        )
    dtype = _DL_TYPES.get((t.dtype.code, t.dtype.bits))
    if dtype is None or t.dtype.lanes != 1:
        raise DTypeError(f"unsupported DLPack dtype code={t.dtype.code} bits={t.dtype.bits}")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        strides = tuple(reversed(strides))
    device = t.device.device_id if t.device.device_type == _DL_CUDA else None  # managed: ask the driver
    return DeviceArray((t.data or 0) + t.byte_offset, shape, strides, dtype, device)


def as_device_array(obj, stream: int | None = None) -> DeviceArray:
    """A DeviceArray view of ``obj``; the caller keeps ``obj`` alive during the launch.
    ``stream``: the CUstream handle the array will be used on, which a DLPack producer
    is asked to order its work before (None: not asked); a __cuda_array_interface__
    stream is not waited for here (``as_device_arrays`` returns it)."""
    return _view(obj, stream)[0]


def as_device_arrays(named: dict, stream: int) -> tuple[dict, tuple]:
    """({name: DeviceArray}, the producer streams a launch on ``stream`` must first wait
    for: those of __cuda_array_interface__ v3 arrays made on another stream)."""
    arrays, waits = {}, []
    for name, obj in named.items():
        if obj is None:
            raise DeviceError(f"{name} is required; got None")
        arrays[name], wait = _view(obj, stream)
        if wait is not None and wait not in waits:
            waits.append(wait)
    return arrays, tuple(waits)


def _view(obj, stream: int | None) -> tuple[DeviceArray, int | None]:
    if isinstance(obj, DeviceArray):
        return obj, None
    if hasattr(type(obj), "__dlpack__"):
        return _from_dlpack(obj, stream), None
    if hasattr(type(obj), "__cuda_array_interface__"):
        return _from_cai(obj, stream)
    raise DeviceError(
        f"{type(obj).__name__} is not a device array: pass a DeviceArray or an object with "
        "__cuda_array_interface__ or __dlpack__ (host arrays such as numpy's are not accepted)"
    )
