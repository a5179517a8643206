"""Decode: a few query tokens per sequence against a KV cache, contiguous or paged
(``forward_kvcache``), from raw pointers or any framework's arrays.

Layouts (flash-attn's): q, out (batch, seqlen_q, heads_q, head_dim); the cache either
contiguous, k_cache and v_cache (batch, max_cache, heads_kv, head_dim), or paged,
(num_pages, page_size, heads_kv, head_dim) with page_table int32 (batch, max_pages):
key j of sequence b is row j % page_size of page page_table[b, j // page_size];
cache_seqlens int32 (batch,) on the device: sequence b's keys are its first
cache_seqlens[b]. lse float32 (batch, heads_q, seqlen_q), contiguous. Causal aligns each
sequence's queries to the end of its cache (query i of seqlen_q sees keys j <= i +
cache_seqlens[b] - seqlen_q).

The contents of cache_seqlens and page_table are not checked on the host (that would need
a sync): the kernel clamps each length to the cache (max_cache, or max_pages x page_size)
and each page number to the pages, so metadata that lies gives wrong numbers at worst
and is never read out of bounds.

The key range of each (sequence, KV head) is split over ``num_splits`` CTAs (None:
fa4_aot.policy.decode_splits, from the shapes alone, so a CUDA graph may be captured);
with more than one, their partial results go to ``workspace``
(``forward_kvcache_workspace_bytes``) and a combine kernel merges them. For a given
num_splits the result is bitwise the same every run.
"""

from __future__ import annotations

import math

from . import checks, policy
from . import workspace as ws
from .api import LOG2E, _check_built, _repeat_key, default_library, launch_tensors
from .arrays import DeviceArray, as_device_arrays
from .checks import GRID_YZ_MAX, INT32_MAX, _check_bshd, default_scale, device_of
from .errors import DTypeError, LayoutError, OptionError, ShapeError
from .loader import KernelLibrary

MAX_SEQLEN_Q = 128  # query tokens per sequence (speculative and chunked decoding); more: the dense forward
PAGE_ALIGN = 16  # page sizes are multiples of this many keys


def _check_vector(name: str, t: DeviceArray, shape: tuple) -> None:
    if t.dtype != "i32":
        raise DTypeError(f"{name} must be int32; got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name} must have shape {shape}; got {t.shape}")
    contiguous = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if any(n != 1 and s != c for n, s, c in zip(shape, t.strides, contiguous)):
        raise LayoutError(f"{name} must be contiguous; strides {t.strides}")
    if t.ptr % 4:
        raise LayoutError(f"{name}'s data pointer {t.ptr:#x} is not 4-byte aligned")


def check_forward_kvcache(arrays: dict) -> dict:
    """Every rule the host can check without the device; returns the launch's sizes."""
    q, k, v, out, lse = (arrays[n] for n in ("q", "k_cache", "v_cache", "out", "lse"))
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        if t.dtype not in ("bf16", "fp16"):
            raise DTypeError(f"{name} is {t.dtype}; q, k_cache, v_cache and out must be bf16 or fp16")
    if len({q.dtype, k.dtype, v.dtype, out.dtype}) != 1:
        raise DTypeError(f"q, k_cache, v_cache, out must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"{out.dtype}")
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        _check_bshd(name, t)
    b, sq, hq, d = q.shape
    pages, rows, hkv, dk = k.shape
    if v.shape != k.shape:
        raise ShapeError(f"v_cache {v.shape} must have k_cache's shape {k.shape}")
    if out.shape != q.shape:
        raise ShapeError(f"out {out.shape} must have q's shape {q.shape}")
    if dk != d:
        raise ShapeError(f"k_cache head_dim {dk} must be q's {d}")
    if hq % hkv:
        raise ShapeError(f"heads_q={hq} must be a multiple of heads_kv={hkv} (MQA/GQA)")
    if sq > MAX_SEQLEN_Q:
        raise ShapeError(f"seqlen_q={sq} is past the decode kernels' {MAX_SEQLEN_Q} query tokens per sequence; "
                         "use fa4_aot.forward (or forward_varlen) for prefill")
    if lse.dtype != "fp32":
        raise DTypeError(f"lse must be fp32; got {lse.dtype}")
    if tuple(lse.shape) != (b, hq, sq) or tuple(lse.strides) != (hq * sq, sq, 1):
        raise ShapeError(f"lse {lse.shape} (strides {lse.strides}) must be contiguous (batch, heads_q, seqlen_q) "
                         f"= {(b, hq, sq)}")
    if lse.ptr % 4:
        raise LayoutError(f"lse's data pointer {lse.ptr:#x} is not 4-byte aligned")
    _check_vector("cache_seqlens", arrays["cache_seqlens"], (b,))
    paged = "page_table" in arrays
    if paged:
        table = arrays["page_table"]
        if len(table.shape) != 2 or table.shape[0] != b:
            raise ShapeError(f"page_table must have shape (batch={b}, max_pages); got {table.shape}")
        _check_vector("page_table", table, tuple(table.shape))
        if rows % PAGE_ALIGN:
            raise ShapeError(f"page size {rows} (k_cache.shape[1]) must be a multiple of {PAGE_ALIGN}")
        max_pages = table.shape[1]
        reach = max_pages * rows
    else:
        if pages != b:
            raise ShapeError(f"k_cache {k.shape} must be (batch={b}, max_cache, heads_kv, head_dim) without a "
                             "page_table")
        max_pages, reach = 1, rows
    if reach > INT32_MAX or b * max_pages > INT32_MAX or b * hq * sq > INT32_MAX:
        raise ShapeError("the cache's keys per sequence, the page table or the LSE rows overflow int32")
    if hkv > GRID_YZ_MAX or b > GRID_YZ_MAX:
        raise ShapeError(f"heads_kv={hkv} and batch={b} must each be at most {GRID_YZ_MAX} (grid limits)")
    return {"batch": b, "seqlen_q": sq, "heads_q": hq, "heads_kv": hkv, "head_dim": d, "dtype": q.dtype,
            "cache_rows": rows, "cache_pages": pages, "max_pages": max_pages, "paged": int(paged),
            "max_seqlen_k": reach}


def _check_splits(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 1 <= value <= policy.DECODE_MAX_SPLITS):
        raise OptionError(f"num_splits must be an int in 1..{policy.DECODE_MAX_SPLITS} or None; got {value!r}")


def _splits(value, sizes: dict, tile_m: int, tile_n: int, sm_count: int) -> int:
    _check_splits(value)
    if value is not None:
        return value
    return policy.decode_splits(_ctas(sizes, tile_m), -(-sizes["max_seqlen_k"] // tile_n), sm_count)


def _ctas(sizes: dict, tile_m: int) -> int:
    """CTAs of one split: row tiles x KV heads x batch."""
    group = sizes["heads_q"] // sizes["heads_kv"]
    return -(-group * sizes["seqlen_q"] // tile_m) * sizes["heads_kv"] * sizes["batch"]


def forward_kvcache_workspace_bytes(batch: int, seqlen_q: int, heads_q: int, heads_kv: int, head_dim: int,
                                    max_seqlen_k: int, *, num_splits: int | None = None,
                                    library: KernelLibrary | None = None, sm_count: int | None = None) -> int:
    """Bytes of device memory ``forward_kvcache`` needs as its ``workspace`` (0: none)
    for ``num_splits`` splits, or where None for the splits it picks for these sizes
    (``max_seqlen_k``: the cache's keys per sequence, max_cache or max_pages x page_size)
    on a GPU of ``sm_count`` multiprocessors (None: the first device's)."""
    checks.check_sizes(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       max_seqlen_k=max_seqlen_k)
    library = library or default_library()
    rows = library.manifest.matching(kind="decode", head_dim=head_dim)
    if not rows:
        _check_built(library.manifest, dict(kind="decode", head_dim=head_dim, dtype="bf16", causal=False), 1)
    row = rows[0]
    sizes = {"batch": batch, "seqlen_q": seqlen_q, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
             "max_seqlen_k": max_seqlen_k}
    if sm_count is None and num_splits is None:
        sm_count = library.sm_count(0)
    splits = _splits(num_splits, sizes, row["config"]["tile_m"], row["config"]["tile_n"], sm_count or 1)
    if splits == 1:
        return 0
    rule = row["workspace"]
    return ws.total_bytes(rule, ws.regions(rule, {**sizes, "splits": splits}))


def forward_kvcache(q, k_cache, v_cache, out, lse, cache_seqlens, workspace=None, *, page_table=None,
                    causal: bool = False, softmax_scale: float | None = None, num_splits: int | None = None,
                    stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v and lse, each sequence against its cache.

    Layouts and metadata: see the module's docstring. ``workspace``: contiguous device
    memory of ``forward_kvcache_workspace_bytes(...)`` bytes, 256-byte aligned, any
    contents; may be None where that is 0 (one split). ``stream``: a raw CUstream handle.
    Asynchronous and allocation-free; bad arguments raise a Fa4AotError before anything
    is launched.
    """
    library = library or default_library()
    _check_splits(num_splits)
    # a repeated call of DeviceArrays on an int stream: its launches again, as packed
    # (the raw API's key by the arrays' ids, pinned by the kept plan: fa4_aot.api)
    given = tuple(a for a in (q, k_cache, v_cache, out, lse, cache_seqlens, workspace, page_table) if a is not None)
    repeat = _repeat_key("kvcache", given, (workspace is None, page_table is None, causal, softmax_scale, num_splits,
                                            policy.DECODE_TURN_STRIDE), stream)
    if repeat is not None and library.launch_again(repeat):
        return
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    stream = checks.stream_handle(stream)
    named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("lse", lse),
             ("cache_seqlens", cache_seqlens), ("page_table", page_table), ("workspace", workspace))
    arrays, waits = as_device_arrays({name: x for name, x in named if x is not None}, stream)
    # the decode and its combine are kept as one plan under the arrays' values (and the
    # repeat key's ids): a call with the same ones is launched again as packed
    key = ("kvcache", *arrays.items(), causal, scale, num_splits, policy.DECODE_TURN_STRIDE, stream)
    aliases = ((repeat, given),) if repeat is not None else ()
    if library.launch_again(key, waits, aliases):
        return
    sizes = check_forward_kvcache(arrays)
    axes = dict(kind="decode", dtype=sizes["dtype"], head_dim=sizes["head_dim"], causal=causal)
    _check_built(library.manifest, axes, 1)
    device = device_of(arrays)
    arch = library.arch(device)
    row = library.manifest.find(**axes, arch=arch, q_tiles=1)
    cfg = row["config"]
    splits = _splits(num_splits, sizes, cfg["tile_m"], cfg["tile_n"], library.sm_count(device))
    tensors = {}
    if splits > 1:
        if "workspace" not in arrays:
            raise ShapeError(f"{splits} splits need a workspace (fa4_aot.forward_kvcache_workspace_bytes)")
        space = arrays["workspace"]
        checks.check_workspace(space)
        tensors.update(ws.carve(row["workspace"], {**sizes, "splits": splits}, space.ptr,
                                math.prod(space.shape) * space.itemsize))
    else:
        dummy = arrays["lse"].as_launch_tensor()  # never read or written with one split
        tensors.update(o_partial=dummy, lse_partial=dummy)
    scale = default_scale(sizes["head_dim"]) if scale is None else scale
    piece = math.gcd(sizes["cache_rows"], cfg["tile_n"]) if sizes["paged"] else cfg["tile_n"]
    launch_row = _with_piece(row, piece)
    tensors.update(launch_tensors(arrays))
    tensors.setdefault("page_table", tensors["cache_seqlens"])  # not paged: read by no one
    group = sizes["heads_q"] // sizes["heads_kv"]
    values = {**{n: x for n, x in sizes.items() if n != "dtype"}, "scale_log2": scale * LOG2E, "splits": splits,
              "piece_rows": piece, "turn_stride": policy.DECODE_TURN_STRIDE,
              "decode_ctas": -(-group * sizes["seqlen_q"] // cfg["tile_m"]) * splits,
              "combine_rows": sizes["batch"] * sizes["seqlen_q"] * sizes["heads_q"]}
    library.launch(launch_row, device, stream, values, tensors, key=key, waits=waits, aliases=aliases)
    if splits > 1:
        combine = library.manifest.find(kind="combine", dtype=sizes["dtype"], head_dim=sizes["head_dim"],
                                        causal=False, arch=arch, q_tiles=1)
        library.launch(combine, device, stream, values, tensors, key=key, aliases=aliases, append=True)


_PIECE_ROWS: dict = {}


def _with_piece(row: dict, piece: int) -> dict:
    """``row`` with its K/V tensor maps' key box ``piece`` rows (a paged cache whose page
    size the key tile does not divide is loaded in pieces of the pages' common rows)."""
    if piece == row["config"]["tile_n"]:
        return row
    key = (row["name"], row["sha256"], piece)
    found = _PIECE_ROWS.get(key)
    if found is None:
        maps = {name: {**recipe, "box": [recipe["box"][0], piece, *recipe["box"][2:]]}
                for name, recipe in row["tensormaps"].items()}
        found = _PIECE_ROWS[key] = {**row, "tensormaps": maps}
    return found
