"""CUtensorMap descriptors from a manifest recipe and a tensor, via cuTensorMapEncodeTiled.

A recipe (see build_kernels.py) names the tensor's axes innermost first by the letters of
its (b, s, h, d) layout, and the box, swizzle and promotion the kernel was compiled for.
The descriptor holds the base address, so it is encoded per tensor (and kept: see encode).
"""

from __future__ import annotations

import ctypes
import functools

from .driver import call, cu

DATA_TYPES = {
    "bf16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    "fp16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    "fp32": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    "e4m3": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,  # TMA moves bytes: FP8 as uint8
}
SWIZZLE = {
    "NONE": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
    "32B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
    "64B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
    "128B": cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
}
L2_PROMOTION = {
    "NONE": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
    "64B": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
    "128B": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
    "256B": cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
}
INTERLEAVE = {"NONE": cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE}
OOB_FILL = {"NONE": cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE}
AXIS = {"b": 0, "s": 1, "h": 2, "d": 3}


def _descriptor_strides(shape: tuple, strides: tuple, itemsize: int) -> list[int]:
    """The element strides of s, h, b (the descriptor's dims after d), each axis of size 1
    given the smallest 16-byte multiple past the extent of the axes before it."""
    out, inner = [], shape[3]
    for axis in (1, 2, 0):
        stride = strides[axis]
        if shape[axis] == 1:
            stride = -(-inner * itemsize // 16) * 16 // itemsize
        out.append(stride)
        inner = stride * shape[axis]
    return out


def encode(recipe: dict, ptr: int, shape: tuple, strides: tuple, itemsize: int) -> bytes:
    """128 descriptor bytes for a (b, s, h, d) tensor with element ``strides``.

    An axis of size 1 is never stepped, so its stride may be anything (frameworks give
    such axes any stride); a descriptor still needs a valid one (a multiple of 16 bytes):
    it gets the smallest past the axes inside it. The bytes are a pure function of these
    arguments, so they are kept (ENCODED_CACHE entries, least recently used out): an
    encode costs about 15 us of host time, and a training loop passes the same tensors
    call after call."""
    return _encode(recipe["dtype"], tuple(recipe["dims"]), tuple(recipe["box"]), tuple(recipe["element_strides"]),
                   recipe["interleave"], recipe["swizzle"], recipe["l2_promotion"], recipe["oob_fill"],
                   ptr, tuple(shape), tuple(strides), itemsize)


ENCODED_CACHE = 1024


@functools.lru_cache(maxsize=ENCODED_CACHE)
def _encode(dtype, dims_order, box, element_strides, interleave, swizzle, l2_promotion, oob_fill,
            ptr, shape, strides, itemsize) -> bytes:
    axes = [AXIS[a] for a in dims_order]
    dims = [shape[a] for a in axes]
    byte_strides = [stride * itemsize for stride in _descriptor_strides(shape, strides, itemsize)]
    tmap = call(
        cu.cuTensorMapEncodeTiled,
        DATA_TYPES[dtype],
        len(dims),
        ptr,
        [cu.cuuint64_t(n) for n in dims],
        [cu.cuuint64_t(n) for n in byte_strides],
        [cu.cuuint32_t(n) for n in box],
        [cu.cuuint32_t(n) for n in element_strides],
        INTERLEAVE[interleave],
        SWIZZLE[swizzle],
        L2_PROMOTION[l2_promotion],
        OOB_FILL[oob_fill],
    )
    return ctypes.string_at(tmap.getPtr(), 128)
