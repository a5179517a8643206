"""The public entry points: attention from raw pointers or any framework's arrays."""

from __future__ import annotations

import math
import threading

from .arrays import DeviceArray, as_device_array
from .checks import check_forward, default_scale, device_of
from .loader import KernelLibrary

_default_library = None
_library_lock = threading.Lock()


def default_library() -> KernelLibrary:
    """The kernels shipped in the package, loaded on first use."""
    global _default_library
    if _default_library is None:
        with _library_lock:
            if _default_library is None:
                _default_library = KernelLibrary()
    return _default_library


def _tma_tensor(t: DeviceArray) -> dict:
    """Launch view of a (b, s, h, d) array; size-1 axes get a harmless 16-byte-multiple
    stride, since a descriptor needs one even where no coordinate ever multiplies it."""
    strides = list(t.strides)
    inner_extent = t.shape[3]
    for axis in (1, 2, 0):  # s, h, b: the descriptor's dims after d
        if t.shape[axis] == 1:
            strides[axis] = -(-inner_extent * t.itemsize // 16) * 16 // t.itemsize
        inner_extent = strides[axis] * t.shape[axis]
    return {"ptr": t.ptr, "shape": t.shape, "strides": tuple(strides), "itemsize": t.itemsize}


def forward(q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
            stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v, and lse = logsumexp of the scaled scores.

    q, out: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    bf16 or fp16, last dim contiguous, other strides and pointers 16-byte aligned;
    heads_q a multiple of heads_kv. lse: float32, contiguous (batch, heads_q, seqlen_q).
    Each is a DeviceArray or an object with __dlpack__ / __cuda_array_interface__.
    Causal masking is aligned to the bottom-right corner (query i sees keys
    j <= i + seqlen_k - seqlen_q); a query row that sees no key gets out = 0, lse = -inf.
    ``stream`` is a raw CUstream handle (0: the legacy default stream). Asynchronous:
    nothing is allocated and nothing waits for the GPU.
    """
    arrays = {name: as_device_array(x) for name, x in
              (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))}
    problem = check_forward(arrays["q"], arrays["k"], arrays["v"], arrays["out"], arrays["lse"])
    library = library or default_library()
    device = device_of(arrays)
    row = library.manifest.find(kind="fwd", arch=library.arch(device), dtype=problem.dtype,
                                head_dim=problem.head_dim, causal=bool(causal))
    scale = default_scale(problem.head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    tensors = {name: _tma_tensor(arrays[src]) for name, src in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))}
    tensors["lse"] = arrays["lse"].as_launch_tensor()
    library.launch(row, device, int(stream), problem.sizes, tensors,
                   {"scale_log2": scale * math.log2(math.e)})
