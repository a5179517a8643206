"""Device arrays from any framework, without importing the framework.

``DeviceArray`` is the raw layer: a device pointer, a shape, element strides and a dtype
name. ``as_device_array`` turns into one anything that speaks
``__cuda_array_interface__`` (CuPy, Numba, PyTorch for fp16/fp32, JAX) or ``__dlpack__``
(PyTorch, CuPy, JAX, incl. bf16), reading the DLPack capsule with ctypes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .errors import DeviceError, DTypeError, LayoutError

ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "u8": 1, "i32": 4}  # u8: workspaces; i32: sequence lengths


@dataclass(frozen=True)
class DeviceArray:
    ptr: int  # device address of element [0, 0, ...]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str  # "bf16", "fp16", "fp32" or "u8"
    # The CUDA device ordinal, where the array's producer says it (torch, DLPack); None:
    # fa4_aot.checks.device_of asks the driver about the pointer.
    device: int | None = None

    def __post_init__(self):
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


def _from_cai(obj) -> DeviceArray:
    cai = obj.__cuda_array_interface__
    typestr = cai["typestr"]
    descr = cai.get("descr")
    dtype = _CAI_TYPES.get(typestr)
    if typestr == "<V2" and not (descr and "bfloat16" in str(descr)):
        dtype = None
    if dtype is None:
        raise DTypeError(f"unsupported element type {typestr!r} (descr {descr!r}); use bf16 or fp16")
    itemsize = ITEMSIZE[dtype]
    shape = tuple(int(n) for n in cai["shape"])
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
    return DeviceArray(int(cai["data"][0]), shape, strides, dtype)


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
_DL_TYPES = {(2, 16): "fp16", (2, 32): "fp32", (4, 16): "bf16", (1, 8): "u8", (0, 32): "i32"}  # kDLInt=0, kDLUInt=1, kDLFloat=2, kDLBfloat=4


def _from_dlpack(obj) -> DeviceArray:
    if hasattr(obj, "__dlpack_device__"):
        device_type, _ = obj.__dlpack_device__()
        if int(device_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise DeviceError(
                f"array is on DLPack device type {int(device_type)}, not a CUDA device: "
                "move it to the GPU first"
            )
    try:
        capsule = obj.__dlpack__(stream=-1)  # -1: the caller orders streams itself
    except TypeError:
        capsule = obj.__dlpack__()
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


def as_device_array(obj) -> DeviceArray:
    """A DeviceArray view of ``obj``; the caller keeps ``obj`` alive during the launch."""
    if isinstance(obj, DeviceArray):
        return obj
    if hasattr(type(obj), "__dlpack__"):
        return _from_dlpack(obj)
    if hasattr(type(obj), "__cuda_array_interface__"):
        return _from_cai(obj)
    raise DeviceError(
        f"{type(obj).__name__} is not a device array: pass a DeviceArray or an object with "
        "__cuda_array_interface__ or __dlpack__ (host arrays such as numpy's are not accepted)"
    )
