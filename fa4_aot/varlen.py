"""Attention over packed variable-length sequences (cu_seqlens), from raw pointers or any
framework's arrays: the forward (``forward_varlen``).

Layouts (flash-attn's): q, out (total_q, heads_q, head_dim); k, v (total_k, heads_kv,
head_dim); lse (heads_q, total_q) float32, contiguous; cu_seqlens_q, cu_seqlens_k int32
(batch + 1,) on the device: sequence i has rows [cu[i], cu[i + 1]); seqused_q, seqused_k
int32 (batch,), optional: only the first seqused[i] rows of sequence i are used (fewer
than packed). max_seqlen_q, max_seqlen_k: the longest sequence, from the caller, so
nothing waits for the device. The contents of cu_seqlens and seqused are not checked on
the host (that would need a sync); the kernels clamp every sequence to the packed tensors,
so metadata that lies (decreasing, past the totals, a max_seqlen too small) gives wrong
numbers at worst and is never read or written out of bounds.
"""

from __future__ import annotations

from . import checks
from .api import LOG2E, _check_built, _tma_tensor, default_library
from .arrays import DeviceArray, as_device_arrays
from .checks import GRID_YZ_MAX, INT32_MAX, default_scale, device_of
from .checks import check_forward as _check_dense
from .errors import DTypeError, LayoutError, ShapeError
from .loader import KernelLibrary


def _as_packed(t: DeviceArray) -> DeviceArray:
    """(total, h, d) as the (1, total, h, d) the kernels' dense checks and tensor maps take."""
    if len(t.shape) != 3:
        raise ShapeError(f"packed tensors have rank 3 (total, heads, head_dim); got shape {t.shape}")
    total, h, d = t.shape
    return DeviceArray(t.ptr, (1, total, h, d), (total * t.strides[0], *t.strides), t.dtype, t.device)


def _check_lengths(name: str, t: DeviceArray, n: int) -> None:
    if t.dtype != "i32":
        raise DTypeError(f"{name} must be int32; got {t.dtype}")
    if len(t.shape) != 1 or t.shape[0] != n:
        raise ShapeError(f"{name} must have shape ({n},); got {t.shape}")
    if t.strides[0] != 1:
        raise LayoutError(f"{name} must be contiguous; stride {t.strides[0]}")
    if t.ptr % 4:
        raise LayoutError(f"{name}'s data pointer {t.ptr:#x} is not 4-byte aligned")


def _check_max(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= INT32_MAX:
        raise ShapeError(f"{name} must be a positive int below 2**31; got {value!r}")
    return value


def check_forward_varlen(arrays: dict, max_seqlen_q, max_seqlen_k) -> dict:
    """Every rule the host can check without the device; returns the launch's sizes."""
    packed = {n: _as_packed(arrays[n]) for n in ("q", "k", "v", "out")}
    lse = arrays["lse"]
    total_q, heads_q = packed["q"].shape[1], packed["q"].shape[2]
    if lse.dtype == "fp32" and len(lse.shape) == 2:
        if tuple(lse.shape) != (heads_q, total_q):
            raise ShapeError(f"lse {lse.shape} must be (heads_q, total_q) = {(heads_q, total_q)}")
        lse = DeviceArray(lse.ptr, (1, *lse.shape), (heads_q * total_q, *lse.strides), lse.dtype, lse.device)
    elif lse.dtype == "fp32":
        raise ShapeError(f"lse must have rank 2 (heads_q, total_q); got shape {lse.shape}")
    problem = _check_dense(packed["q"], packed["k"], packed["v"], packed["out"], lse)
    batch = arrays["cu_seqlens_q"].shape[0] - 1 if len(arrays["cu_seqlens_q"].shape) == 1 else -1
    if batch < 1:
        raise ShapeError(f"cu_seqlens_q must have shape (batch + 1,) with batch >= 1; got "
                         f"{arrays['cu_seqlens_q'].shape}")
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        _check_lengths(name, arrays[name], batch + 1)
    for name in ("seqused_q", "seqused_k"):
        if name in arrays:
            _check_lengths(name, arrays[name], batch)
    max_q, max_k = _check_max("max_seqlen_q", max_seqlen_q), _check_max("max_seqlen_k", max_seqlen_k)
    if batch > GRID_YZ_MAX:
        raise ShapeError(f"batch={batch} must be at most {GRID_YZ_MAX} (grid limits)")
    total_k = problem.seqlen_k
    return {"total_q": total_q, "total_k": total_k, "heads_q": heads_q, "heads_kv": problem.heads_kv,
            "one": 1, "batch": batch, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
            "head_dim": problem.head_dim, "dtype": problem.dtype, "packed": packed}


def forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   seqused_q=None, seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                   stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v and lse, per packed sequence.

    Layouts and metadata: see the module's docstring. Causal masking is aligned to the
    bottom-right corner of each sequence (query i of a sequence sees keys j <= i +
    seqlen_k - seqlen_q); seqlen_q may differ from seqlen_k in each sequence; zero-length
    sequences write nothing; a query row that sees no key gets out 0 and lse -inf.
    GQA/MQA: heads_q a multiple of heads_kv. ``stream``: a raw CUstream handle.
    Asynchronous and allocation-free.
    """
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    stream = checks.stream_handle(stream)
    named = (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q), ("seqused_k", seqused_k))
    arrays, waits = as_device_arrays({name: x for name, x in named if x is not None}, stream)
    library = library or default_library()
    key = ("fwd_varlen", *arrays.items(), max_seqlen_q, max_seqlen_k, causal, scale, stream)
    if library.launch_again(key, waits):
        return
    sizes = check_forward_varlen(arrays, max_seqlen_q, max_seqlen_k)
    axes = dict(kind="fwd", dtype=sizes["dtype"], head_dim=sizes["head_dim"], causal=causal, varlen=True)
    _check_built(library.manifest, axes, 1)
    device = device_of(arrays)
    row = library.manifest.find(**axes, arch=library.arch(device), q_tiles=1)
    scale = default_scale(sizes["head_dim"]) if scale is None else scale
    packed = sizes.pop("packed")
    tensors = {name: _tma_tensor(packed[name]) for name in ("q", "k", "v")}
    for name in ("out", "lse", "cu_seqlens_q", "cu_seqlens_k"):
        tensors["o" if name == "out" else name] = arrays[name].as_launch_tensor()
    for name in ("seqused_q", "seqused_k"):
        # not given: any int32 vector of at least batch entries (the kernel reads it, but
        # does not use it): cu_seqlens
        tensors[name] = arrays.get(name, arrays["cu_seqlens_" + name[-1]]).as_launch_tensor()
    values = {**{n: v for n, v in sizes.items() if n != "dtype"}, "scale_log2": scale * LOG2E,
              "stride.o.s": arrays["out"].strides[0], "stride.o.h": arrays["out"].strides[1],
              "use_seqused_q": int("seqused_q" in arrays), "use_seqused_k": int("seqused_k" in arrays)}
    library.launch(row, device, stream, values, tensors, key=key, waits=waits)
