"""The few CUDA driver calls fa4_aot makes, through cuda-python, with typed errors."""

from __future__ import annotations

from functools import lru_cache

from ..errors import CudaError, NoDeviceError

try:
    from cuda.bindings import driver as cu
except ImportError as e:  # pragma: no cover - cuda-bindings is a hard dependency
    raise ImportError("fa4_aot needs cuda-bindings (pip install cuda-bindings)") from e


SUCCESS = cu.CUresult.CUDA_SUCCESS


def failed(fn, status) -> CudaError:
    """The typed error for ``fn``'s non-success ``status``."""
    _, name = cu.cuGetErrorName(status)
    _, text = cu.cuGetErrorString(status)
    return CudaError(fn.__name__, name.decode() if name else status, text.decode() if text else "")


def call(fn, *args):
    """Call a driver function; return its results without the status, or raise CudaError."""
    try:
        result = fn(*args)
    except RuntimeError as e:  # the driver library could not be loaded or lacks the symbol
        raise NoDeviceError(str(e)) from e
    status, rest = result[0], result[1:]
    if status != SUCCESS:
        raise failed(fn, status)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


@lru_cache(maxsize=1)
def init() -> int:
    """cuInit once; returns the driver's CUDA version (e.g. 13000)."""
    try:
        result = cu.cuInit(0)
    except Exception as e:  # DynamicLibNotFoundError when no driver is installed
        raise NoDeviceError(f"the NVIDIA driver library could not be loaded ({e})") from e
    if result[0] != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(result[0])
        raise NoDeviceError(f"cuInit failed with {name.decode() if name else result[0]}")
    return call(cu.cuDriverGetVersion)


def device_count() -> int:
    init()
    return call(cu.cuDeviceGetCount)


def compute_capability(device: int) -> tuple[int, int]:
    attr = cu.CUdevice_attribute
    major = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
    minor = call(cu.cuDeviceGetAttribute, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
    return major, minor


def multiprocessor_count(device: int) -> int:
    return call(cu.cuDeviceGetAttribute, cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)


def device_name(device: int) -> str:
    return call(cu.cuDeviceGetName, 256, device).split(b"\0")[0].decode()
