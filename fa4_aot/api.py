"""The public entry points: attention from raw pointers or any framework's arrays."""

from __future__ import annotations

import math
import threading

from .arrays import DeviceArray, as_device_array
from .checks import check_backward, check_forward, default_scale, device_of
from .errors import LayoutError, ManifestError, ShapeError
from .loader import KernelLibrary
from .variants import (TAIL_COUNTERS, TAIL_MAX_TILES, bwd_query_rows, bwd_step_tiles, bwd_tail_split, bwd_tiling,
                       dq_chains, tail_split)

LOG2E = math.log2(math.e)
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


# Keys up to which the forward takes two query tiles per CTA (``q_tiles`` 2, where built):
# measured 1-13% faster at 1k and 4k keys, 2-3% slower at 16k (docs/perf-notes.md, session 5).
TWO_TILES_MAX_SEQLEN_K = 4096


def forward_row(manifest, axes: dict, seqlen_k: int, q_tiles: int | None = None) -> dict:
    """The forward's manifest row for ``axes`` (kind, arch, dtype, head_dim, causal): with
    ``q_tiles`` query tiles per CTA, or when None two up to TWO_TILES_MAX_SEQLEN_K keys
    where they are built, else one."""
    return _row(manifest, axes, q_tiles, seqlen_k <= TWO_TILES_MAX_SEQLEN_K)


def _row(manifest, axes: dict, q_tiles: int | None, two_tiles: bool) -> dict:
    """The row of ``axes`` with ``q_tiles``, or when None 2 where ``two_tiles`` and built, else 1."""
    if q_tiles is None:
        q_tiles = 2 if two_tiles and manifest.built(**axes, q_tiles=2) else 1
    return manifest.find(**axes, q_tiles=int(q_tiles))


# Keys above which the backward takes two query tiles per step where a variant has both
# kernels (``q_tiles`` 2: head_dim 64 causal, not deterministic): the one-tile kernel's
# CTAs are persistent up to these keys (bwd_sm90.PERSISTENT_MAX_KEYS), where the two-tile one
# measured 5% slower (1k), and it 2% faster at 4k and 16k (docs/perf-notes.md, session 19).
BWD_ONE_TILE_MAX_SEQLEN_K = 2048


def backward_row(manifest, axes: dict, seqlen_k: int, q_tiles: int | None = None) -> dict:
    """The backward's manifest row for ``axes`` (kind, arch, dtype, head_dim, causal,
    deterministic): with ``q_tiles`` query tiles per step, or when None two above
    BWD_ONE_TILE_MAX_SEQLEN_K keys where they are built, else one."""
    return _row(manifest, axes, q_tiles, seqlen_k > BWD_ONE_TILE_MAX_SEQLEN_K)


def forward(q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
            q_tiles: int | None = None, stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v, and lse = logsumexp of the scaled scores.

    q, out: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    bf16 or fp16, last dim contiguous, other strides and pointers 16-byte aligned;
    heads_q a multiple of heads_kv. lse: float32, contiguous (batch, heads_q, seqlen_q).
    Each is a DeviceArray or an object with __dlpack__ / __cuda_array_interface__.
    Causal masking is aligned to the bottom-right corner (query i sees keys
    j <= i + seqlen_k - seqlen_q); a query row that sees no key gets out = 0, lse = -inf.
    ``q_tiles``: query tiles per CTA, 1 or 2; None picks by seqlen_k
    (TWO_TILES_MAX_SEQLEN_K). ``stream`` is a raw CUstream handle (0: the legacy default
    stream). Asynchronous: nothing is allocated and nothing waits for the GPU.
    """
    arrays = {name: as_device_array(x) for name, x in
              (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))}
    library = library or default_library()
    # The arrays (pointers, shapes, strides, dtypes) and options determine every check and
    # every parameter: a call made before with the same ones is launched again as packed.
    key = ("fwd", *arrays.values(), bool(causal), softmax_scale, q_tiles, int(stream))
    if library.launch_again(key):
        return
    problem = check_forward(arrays["q"], arrays["k"], arrays["v"], arrays["out"], arrays["lse"])
    device = device_of(arrays)
    axes = dict(kind="fwd", arch=library.arch(device), dtype=problem.dtype, head_dim=problem.head_dim,
                causal=bool(causal))
    row = forward_row(library.manifest, axes, problem.sizes["seqlen_k"], q_tiles)
    scale = default_scale(problem.head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    tensors = {name: _tma_tensor(arrays[src]) for name, src in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))}
    tensors["lse"] = arrays["lse"].as_launch_tensor()
    library.launch(row, device, int(stream), {**problem.sizes, "scale_log2": scale * LOG2E}, tensors, key=key)


def backward_workspace_bytes(batch: int, seqlen_q: int, heads_q: int, head_dim: int, *, causal: bool = False,
                             deterministic: bool = False, seqlen_k: int | None = None,
                             heads_kv: int | None = None) -> int:
    """Bytes of device memory ``backward`` needs as its ``workspace`` for this problem
    (called with the same ``causal`` and ``deterministic``: the deterministic non-causal
    backward keeps more than one copy of its fp32 dQ accumulator). With ``seqlen_k`` and
    ``heads_kv`` too, the split last wave's partial sums are sized for the problem's key
    tiles (at most variants.TAIL_MAX_TILES; none with GQA); without, for the most."""
    tiles = TAIL_MAX_TILES
    if seqlen_k is not None and heads_kv is not None:
        tiles = _partial_tiles(batch, seqlen_k, heads_q, heads_kv, head_dim, bool(causal))
    return _workspace_bytes(_workspace_regions(batch, seqlen_q, heads_q, head_dim, bool(causal), bool(deterministic),
                                               tiles))


def _partial_tiles(batch: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int, causal: bool) -> int:
    """Bound on the key tiles the problem's split last wave can take: its key tiles, at
    most TAIL_MAX_TILES (backward_tail_split)."""
    return min(TAIL_MAX_TILES, _splittable_items(batch, seqlen_k, heads_q, heads_kv, head_dim, causal))


def _splittable_items(batch: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int, causal: bool) -> int:
    """The backward's (key tile, KV head, batch) items a split last wave takes its tiles
    from: none with GQA (a piece walks one query head's tiles)."""
    if heads_q != heads_kv:
        return 0
    return -(-seqlen_k // bwd_tiling(head_dim, causal).tile_n) * heads_kv * batch


def _workspace_bytes(regions) -> int:
    """The regions back to back, each but the last padded to 256 bytes (as _carve lays them)."""
    return sum(-(-size // 256) * 256 for _, size in regions[:-1]) + regions[-1][1]


def _workspace_regions(b: int, sq: int, hq: int, d: int, causal: bool, deterministic: bool,
                       partial_tiles: int = TAIL_MAX_TILES):
    chains = dq_chains(causal, deterministic)
    tiling = bwd_tiling(d, causal)
    # LSE2 and D per (batch, head) padded to whole query tiles: the kernel copies a tile's
    # values into shared memory with one bulk copy (4 * tile_m bytes), 16-byte aligned.
    m_blocks = -(-sq // tiling.tile_m)
    rows = b * hq * m_blocks * tiling.tile_m * 4
    # the accumulator padded to whole query tiles too: where variants.dq_fragment_order the
    # kernels keep it as whole tiles in fragment order (fa4_aot/src/bwd_rows_sm90.py), else
    # as rows
    # dq_done: per (batch, query head), the key tiles whose dQ adds are complete (the
    # postprocess converts a head's tiles once all have counted themselves)
    # tail_counters, dkv_partial: the split last wave's (variants.tail_split): counters per
    # split tile (cleared by the preprocess) and its dK, dV partial sums in fp32
    partial = partial_tiles * 2 * tiling.tile_n * d * 4 if bwd_tail_split(d, causal, deterministic) else 0
    return [("lse2", rows), ("dsum", rows), ("dq_accum", chains * b * m_blocks * tiling.tile_m * hq * d * 4),
            ("dq_semaphore", chains * b * hq * m_blocks * 4), ("dq_done", b * hq * 4),
            ("tail_counters", TAIL_MAX_TILES * TAIL_COUNTERS * 4), ("dkv_partial", partial)]


def _carve(workspace: DeviceArray, problem, causal: bool, deterministic: bool) -> dict:
    regions = _workspace_regions(problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim, causal,
                                 deterministic, _partial_tiles(problem.batch, problem.seqlen_k, problem.heads_q,
                                                               problem.heads_kv, problem.head_dim, causal))
    need = _workspace_bytes(regions)
    have = math.prod(workspace.shape) * workspace.itemsize
    if have < need:
        raise ShapeError(f"workspace has {have} bytes; this problem needs {need} "
                         "(fa4_aot.backward_workspace_bytes, with the same causal and deterministic)")
    if workspace.ptr % 256:
        raise LayoutError(f"workspace pointer {workspace.ptr:#x} is not 256-byte aligned")
    out, at = {}, workspace.ptr
    for name, size in regions:
        out[name] = {"ptr": at, "shape": None, "strides": None, "itemsize": 4}
        at += -(-size // 256) * 256
    b, sq, hq, d = problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim
    chains = dq_chains(causal, deterministic)
    # TMA reduce target: copy c of batch i is batch i * chains + c
    out["dq_accum"].update(shape=(b * chains, sq, hq, d), strides=(sq * hq * d, hq * d, d, 1))
    return out


def backward_tail_split(sizes: dict, causal: bool, deterministic: bool, sm_count: int) -> tuple[int, int]:
    """(tiles, pieces) of the backward's split last wave for a problem's sizes (batch,
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) on ``sm_count`` SMs: variants.tail_split
    where the variant splits and a CTA walks one query head's tiles (not GQA), else (0, 1)."""
    d = sizes["head_dim"]
    items = _splittable_items(sizes["batch"], sizes["seqlen_k"], sizes["heads_q"], sizes["heads_kv"], d, causal)
    if not bwd_tail_split(d, causal, deterministic) or items == 0:
        return 0, 1
    step_rows = bwd_query_rows(d, causal) * bwd_step_tiles(d, causal, deterministic)
    return tail_split(items, sm_count, -(-sizes["seqlen_q"] // step_rows))


def deterministic_turn_tiles(causal: bool, head_dim: int, seqlen_k: int) -> int:
    """Query tiles per ordered dQ turn of the deterministic backward: 2 where measured
    faster than 1 (up to head_dim 192, not causal, and 16k keys and more), else 1 (causal
    head_dim 256 below 16k keys: 2 measured 8-9% slower). Speed only: the bits of the
    results are the same either way (docs/perf-notes.md, sessions 6, 7 and 12)."""
    return 2 if head_dim <= 192 or not causal or seqlen_k >= 16384 else 1


def first_write_dq(deterministic: bool, seqlen_k: int) -> bool:
    """Whether the backward skips clearing its fp32 dQ accumulator, each query tile's first
    share being stored instead of added (fa4_aot/src/bwd_dq_handoff.py). It halves the
    preprocess's bytes. Deterministic, the first turn at a tile stores, and the turns
    order the rest anyway: +4% at 4k keys, +7-10% at 1k, 0 to +1.5% at 16k. Not
    deterministic, the first CTA to take a tile's ticket stores and the others wait for
    that store: +2-5% at 1k keys, +1-1.5% at 4k, but at 16k keys 0 to -0.5% not causal and
    3-12% slower causal, where each CTA follows the one above it through the query tiles
    and waits for its stores (docs/perf-notes.md, session 14). Speed only: the results are
    the same sums (bitwise so, deterministic)."""
    return deterministic or seqlen_k <= 4096


def backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, *, causal: bool = False,
             softmax_scale: float | None = None, deterministic: bool = False, q_tiles: int | None = None,
             stream: int = 0, library: KernelLibrary | None = None) -> None:
    """Gradients dq, dk, dv of ``forward``'s out for the upstream gradient dout.

    q, k, v, out, lse: as given to and produced by ``forward`` (same causal, same scale).
    dout, dq: shaped like q; dk, dv: shaped like k; same dtype and layout rules as forward.
    workspace: contiguous device memory of ``backward_workspace_bytes(..., causal=causal,
    deterministic=deterministic)`` bytes, 256-byte aligned, any contents (the kernels
    clear or overwrite what they read). ``deterministic``: dq is summed in a fixed
    order, so repeated runs are bitwise identical (dk, dv always are). GQA/MQA: dk and
    dv of a shared KV head sum every query head of its group. ``q_tiles``: query tiles
    per step where the variant has both kernels (head_dim 64 causal, not deterministic),
    None picks by seqlen_k (backward_row). Asynchronous, allocation-free.
    """
    arrays = {name: as_device_array(x) for name, x in (
        ("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse),
        ("dq", dq), ("dk", dk), ("dv", dv), ("workspace", workspace))}
    library = library or default_library()
    key = ("bwd", *arrays.values(), bool(causal), softmax_scale, bool(deterministic), q_tiles, int(stream))
    if library.launch_again(key):  # as in forward
        return
    problem = check_backward(**{n: a for n, a in arrays.items() if n != "workspace"})
    chains = dq_chains(bool(causal), bool(deterministic))
    device = device_of(arrays)
    axes = dict(kind="bwd", arch=library.arch(device), dtype=problem.dtype, head_dim=problem.head_dim,
                causal=bool(causal), deterministic=bool(deterministic))
    row = backward_row(library.manifest, axes, problem.seqlen_k, q_tiles)
    if row.get("dq_chains", 1) != chains:
        raise ManifestError(f"{row['name']} was built with {row.get('dq_chains', 1)} dQ accumulator copies; this "
                            f"fa4_aot sizes the workspace for {chains}: rebuild the kernels with this version")
    # the workspace is laid out by the variant's tiles and tail split, which the cubin must share
    split = bwd_tail_split(problem.head_dim, bool(causal), bool(deterministic))
    if (row["tiling"]["tile_m"] != bwd_query_rows(problem.head_dim, bool(causal))
            or (row["launches"][1]["grid"][0][0] == "split_tail") != split):
        raise ManifestError(f"{row['name']} was built with another tile or tail split than this fa4_aot lays "
                            "its workspace out for: rebuild the kernels with this version")
    regions = _carve(arrays["workspace"], problem, bool(causal), bool(deterministic))
    scale = default_scale(problem.head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    tensors = {name: _tma_tensor(arrays[src]) for name, src in (
        ("q", "q"), ("k", "k"), ("v", "v"), ("do", "dout"), ("dk", "dk"), ("dv", "dv"),
        ("o", "out"), ("dq", "dq"))}
    tensors["lse"] = arrays["lse"].as_launch_tensor()
    tensors.update(regions)
    turn_tiles = deterministic_turn_tiles(bool(causal), problem.head_dim, problem.seqlen_k) if deterministic else 1
    first_write = first_write_dq(bool(deterministic), problem.seqlen_k)
    tail_tiles, tail_pieces = backward_tail_split(problem.sizes, bool(causal), bool(deterministic),
                                                  library.sm_count(device))
    values = {**problem.sizes, "scale": scale, "scale_log2": scale * LOG2E, "turn_tiles": turn_tiles,
              "first_write": int(first_write), "dq_batch": problem.batch * chains,
              "tail_tiles": tail_tiles, "tail_pieces": tail_pieces}
    for name, src in (("o", "out"), ("do", "dout"), ("dq", "dq")):
        for axis, stride in zip("bsh", arrays[src].strides[:3]):
            values[f"stride.{name}.{axis}"] = stride
    library.launch(row, device, int(stream), values, tensors, key=key)
