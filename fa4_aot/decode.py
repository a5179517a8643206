"""Decode: a few query tokens per sequence against a KV cache, contiguous or paged
(``forward_kvcache``), from raw pointers or any framework's arrays.

Layouts (flash-attn's): q (batch, seqlen_q, heads_q, head_dim), out (batch, seqlen_q,
heads_q, head_dim_v); the cache either contiguous, k_cache (batch, max_cache, heads_kv,
head_dim) and v_cache (batch, max_cache, heads_kv, head_dim_v), or paged, (num_pages,
page_size, heads_kv, head_dim or head_dim_v) with page_table int32 (batch, max_pages)
(head_dim_v: v_cache's, head_dim's or another):
key j of sequence b is row j % page_size of page page_table[b, j // page_size];
cache_seqlens int32 (batch,) on the device: sequence b's keys are its first
cache_seqlens[b] (None: every sequence's whole cache, max_cache or max_pages x page_size
keys; the kernels then read no lengths). lse float32 (batch, heads_q, seqlen_q), contiguous. Causal aligns each
sequence's queries to the end of its cache (query i of seqlen_q sees keys j <= i +
cache_seqlens[b] - seqlen_q).

The contents of cache_seqlens and page_table are not checked on the host (that would need
a sync): the kernel clamps each length to the cache (max_cache, or max_pages x page_size)
and each page number to the pages, so metadata that lies gives wrong numbers at worst
and is never read out of bounds.

An FP8 cache: k_cache and v_cache of float8_e4m3fn (dtype "e4m3") with q and out bf16 or
fp16; ``k_descale``, ``v_descale`` float32, (batch, heads_kv) (any strides, 0 included)
or one value (shape () or (1,)), the cache's dequantization scales (None: 1), as
flash-attn 3 names them: the attention is that of k_cache * k_descale and v_cache *
v_descale. The kernels widen the tiles to q's dtype on chip (exact) and apply the scales
to the scores and to O (docs/design.md, "Decode": FP8 cache).

The key range of each (sequence, KV head) is split over ``num_splits`` CTAs (None:
fa4_aot.policy.decode_splits, from the shapes alone, so a CUDA graph may be captured);
with more than one, their partial results go to ``workspace``
(``forward_kvcache_workspace_bytes``) and a combine kernel merges them. For a given
num_splits the result is bitwise the same every run.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from . import policy
from .errors import DeviceError, DTypeError, LayoutError, OptionError, ShapeError
from .launch import checks
from .launch import workspace as ws
from .launch.arrays import DeviceArray, as_device_arrays
from .launch.calls import LOG2E, check_built, default_library, kernel_head_dim, launch_tensors, repeat_key, served_sizes
from .launch.checks import (
    GRID_YZ_MAX, INT32_MAX, check_bshd, check_no_overlap, default_scale, device_of, read, written,
)
from .launch.loader import KernelLibrary

OPTIONAL = ("cache_seqlens", "page_table", "workspace", "sink", "k_descale", "v_descale")  # may be None
KV_DTYPES = ("e4m3",)  # cache dtypes other than q's (an FP8 cache's variants: kv_dtype)
WRITTEN = ("out", "lse", "workspace")  # what the launches write (the workspace: the splits' partials)


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
    for name, t in (("q", q), ("out", out)):
        if t.dtype not in ("bf16", "fp16"):
            raise DTypeError(f"{name} is {t.dtype}; q and out must be bf16 or fp16")
    for name, t in (("k_cache", k), ("v_cache", v)):
        if t.dtype not in ("bf16", "fp16", *KV_DTYPES):
            raise DTypeError(f"{name} is {t.dtype}; a cache is bf16, fp16 (q's dtype) or {', '.join(KV_DTYPES)}")
    if q.dtype != out.dtype or k.dtype != v.dtype or k.dtype not in (q.dtype, *KV_DTYPES):
        raise DTypeError(f"q and out must share one dtype, k_cache and v_cache one dtype, q's or "
                         f"{', '.join(KV_DTYPES)}; got q {q.dtype}, k_cache {k.dtype}, v_cache {v.dtype}, out {out.dtype}")
    kv_dtype = "same" if k.dtype == q.dtype else k.dtype
    for name in ("k_descale", "v_descale"):
        if name in arrays:
            if kv_dtype == "same":
                raise DTypeError(f"{name} dequantizes an FP8 cache; k_cache is {k.dtype}, q's dtype")
            _check_descale(name, arrays[name], (q.shape[0], k.shape[2]))
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v), ("out", out)):
        check_bshd(name, t)
    b, sq, hq, d = q.shape
    pages, rows, hkv, dk = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ShapeError(f"v_cache {v.shape} must be k_cache's {k.shape[:3]} with its own head_dim")
    if out.shape != (*q.shape[:3], v.shape[3]):
        raise ShapeError(f"out {out.shape} must be q's (batch, seqlen_q, heads_q) with v_cache's head_dim: "
                         f"{(*q.shape[:3], v.shape[3])}")
    if dk != d:
        raise ShapeError(f"k_cache head_dim {dk} must be q's {d}")
    if hq % hkv:
        raise ShapeError(f"heads_q={hq} must be a multiple of heads_kv={hkv} (MQA/GQA)")
    if lse.dtype != "fp32":
        raise DTypeError(f"lse must be fp32; got {lse.dtype}")
    if tuple(lse.shape) != (b, hq, sq) or tuple(lse.strides) != (hq * sq, sq, 1):
        raise ShapeError(f"lse {lse.shape} (strides {lse.strides}) must be contiguous (batch, heads_q, seqlen_q) "
                         f"= {(b, hq, sq)}")
    if lse.ptr % 4:
        raise LayoutError(f"lse's data pointer {lse.ptr:#x} is not 4-byte aligned")
    if "cache_seqlens" in arrays:
        _check_vector("cache_seqlens", arrays["cache_seqlens"], (b,))
    paged = "page_table" in arrays
    if paged:
        table = arrays["page_table"]
        if len(table.shape) != 2 or table.shape[0] != b:
            raise ShapeError(f"page_table must have shape (batch={b}, max_pages); got {table.shape}")
        _check_vector("page_table", table, tuple(table.shape))
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
    return {"batch": b, "seqlen_q": sq, "heads_q": hq, "heads_kv": hkv, "head_dim": d, "head_dim_v": v.shape[3],
            "dtype": q.dtype, "kv_dtype": kv_dtype,
            "cache_rows": rows, "cache_pages": pages, "max_pages": max_pages, "paged": int(paged),
            "max_seqlen_k": reach}


def _check_descale(name: str, t: DeviceArray, shape: tuple) -> None:
    """A dequantization scale: float32 of ``shape`` (batch, heads_kv), any strides, or one
    value (shape () or (1,)); 4-byte aligned."""
    if t.dtype != "fp32":
        raise DTypeError(f"{name} must be float32; got {t.dtype}")
    if tuple(t.shape) not in ((), (1,), shape):
        raise ShapeError(f"{name} {t.shape} must be (batch, heads_kv) = {shape}, or one value (shape () or (1,))")
    if any(n > 1 and s < 0 for n, s in zip(t.shape, t.strides)):
        raise LayoutError(f"{name} strides {t.strides} must not be negative")
    if t.ptr % 4:
        raise LayoutError(f"{name}'s data pointer {t.ptr:#x} is not 4-byte aligned")


def _descale_values(arrays: dict, values: dict, tensors: dict) -> None:
    """An FP8 call's descale tensors and values (their strides over (batch, heads_kv), and
    whether given: one not given reads nothing, its address lse's)."""
    for name in ("k_descale", "v_descale"):
        t = arrays.get(name)
        sb, sh = t.strides if t is not None and len(t.shape) == 2 else (0, 0)
        values.update({f"{name}_sb": sb, f"{name}_sh": sh, f"use_{name}": int(t is not None)})
        tensors.setdefault(name, tensors["lse"])


def check_limits(sizes: dict, limits: dict) -> None:
    """What the decode kernels take (their rows' ``limits``): query tokens per sequence
    and page sizes."""
    if sizes["seqlen_q"] > limits["max_seqlen_q"]:
        raise ShapeError(f"seqlen_q={sizes['seqlen_q']} is past the decode kernels' {limits['max_seqlen_q']} query "
                         "tokens per sequence; use fa4_aot.forward (or forward_varlen) for prefill")
    if sizes["paged"] and sizes["cache_rows"] % limits["page_align"]:
        raise ShapeError(f"page size {sizes['cache_rows']} (k_cache.shape[1]) must be a multiple of "
                         f"{limits['page_align']}")


def pair_sizes(manifest, sizes: dict, mods=None) -> dict | None:
    """The sizes (``served_sizes``') of a call that reads pairs of adjacent KV heads as one
    head of twice the width (policy.decode_pairs: a narrow head's 128-byte rows; docs/
    design.md, "Decode"): heads_kv halved, the head dim of the narrowest decode kernel
    built for pairs (config ``pairs``) that holds both heads, pair_heads 2 (an FP8 cache:
    each row takes its own head's scales; with sinks, each row its own head's sink); None
    where the call is not paired (other sizes, a cap, a window bounded behind or a cache
    too short for the local pairs, or no such kernel built for the cache's dtype and the
    call's ScoreMods ``mods``, None: plain). The cache's layout is the caller's to check
    (``heads_adjacent``)."""
    width = max(sizes["columns"], sizes["columns_v"])
    local = mods is not None and mods.local
    if (local and mods.softcap > 0) or not policy.decode_pairs(
            width, sizes["heads_q"], sizes["heads_kv"], sizes["seqlen_q"],
            (mods.left, sizes["max_seqlen_k"]) if local else None):
        return None
    head_dim = _pair_head_dim(manifest, width, sizes.get("kv_dtype", "same"), local)
    if head_dim is None:
        return None
    return {**sizes, "heads_kv": sizes["heads_kv"] // 2, "head_dim": head_dim, "pair_heads": 2}


@functools.lru_cache(maxsize=64)
def _pair_head_dim(manifest, width: int, kv_dtype: str = "same", local: bool = False) -> int | None:
    """The narrowest decode head dim of ``manifest`` whose rows for a ``kv_dtype`` cache,
    with a window and sinks (not capped) where ``local``, are built for pairs (config
    ``pairs``) and hold two heads ``width`` wide; None if none. Kept per manifest: it
    decodes only those rows, once (a first call reads few rows)."""
    for head_dim in sorted({v.head_dim for v in manifest.variants if v.kind == "decode" and v.head_dim >= 2 * width}):
        rows = manifest.matching(kind="decode", head_dim=head_dim, local=local, softcap=False, kv_dtype=kv_dtype)
        if rows and all(r["config"].get("pairs") for r in rows):
            return head_dim
    return None


def span_row(manifest, axes: dict, arch: str, sizes: dict, mods, sm_count: int | None) -> dict:
    """The row of the decode kernel ``axes`` (kind decode, dtype, head dim, ScoreMods
    ``mods``' axes) that serves a call of ``sizes`` (batch, seqlen_q, heads_q, heads_kv) on
    ``arch``, ``sm_count`` SMs: the span-narrow kernel where policy.decode_narrow says and
    one is built, else the span-any one (also where sm_count is None: not known)."""
    if mods.local and mods.left >= 0 and sm_count is not None:
        narrow = dict(axes, arch=arch, q_tiles=1, span="narrow")
        if manifest.built(**narrow):
            row = manifest.find(**narrow)
            if policy.decode_narrow(mods.left, mods.right, sizes["seqlen_q"], _ctas(sizes, row["config"]["tile_m"]),
                                    sm_count):
                return row
    return manifest.find(**axes, arch=arch, q_tiles=1)


def heads_adjacent(k: DeviceArray, v: DeviceArray) -> bool:
    """Whether each KV head of the cache follows the one before with nothing between (head
    stride = head dim, in K and V): a pair of them is then one row of twice the width."""
    return k.strides[2] == k.shape[3] and v.strides[2] == v.shape[3]


def _pair_view(t: DeviceArray) -> dict:
    """The launch tensor of cache ``t`` (pages, rows, heads, d) with adjacent heads, as
    (pages, rows, heads / 2, 2 d): a pair of heads one head."""
    pages, rows, heads, d = t.shape
    return {"ptr": t.ptr, "shape": (pages, rows, heads // 2, 2 * d), "strides": (*t.strides[:2], 2 * d, 1),
            "itemsize": t.itemsize}


def _check_splits(value, most: int | None = None) -> None:
    """num_splits: None, or an int from 1 (to ``most``, the rows' max_splits, where known)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                              or (most is not None and value > most)):
        raise OptionError(f"num_splits must be an int in 1..{most or 'the kernels’ most'} or None; got {value!r}")


def _splits(value, sizes: dict, row: dict, sm_count: int, mods=None) -> int:
    """The call's splits: ``value``, or the policy's for the key tiles a row tile reads
    (with a window ``mods``, no more than without: the workspace is sized without it)."""
    most = row["limits"]["max_splits"]
    _check_splits(value, most)
    if value is not None:
        return value
    cfg = row["config"]
    ctas, tiles = _ctas(sizes, cfg["tile_m"]), -(-sizes["max_seqlen_k"] // cfg["tile_n"])
    slots = sm_count * cfg.get("ctas_per_sm", 1)  # the CTAs resident at once
    splits = policy.decode_splits(ctas, tiles, slots, most)
    if mods is not None and mods.left >= 0 and mods.right >= 0:
        span = mods.left + mods.right + sizes["seqlen_q"]  # keys a row tile's windows cover
        splits = min(splits, policy.decode_splits(ctas, min(tiles, -(-span // cfg["tile_n"]) + 1), slots, most))
    return splits


def splits_for(sizes: dict, row: dict, sm_count: int, mods) -> int:
    """The splits a call of ``sizes`` (with max_seqlen_k) and ScoreMods ``mods`` takes on
    ``row`` where the caller names none."""
    return _splits(None, sizes, row, sm_count, mods if mods.local else None)


def _ctas(sizes: dict, tile_m: int) -> int:
    """CTAs of one split: row tiles x KV heads x batch."""
    group = sizes["heads_q"] // sizes["heads_kv"]
    return -(-group * sizes["seqlen_q"] // tile_m) * sizes["heads_kv"] * sizes["batch"]


def forward_kvcache_workspace_bytes(batch: int, seqlen_q: int, heads_q: int, heads_kv: int, head_dim: int,
                                    max_seqlen_k: int, *, num_splits: int | None = None,
                                    library: KernelLibrary | None = None, sm_count: int | None = None,
                                    head_dim_v: int | None = None) -> int:
    """Bytes of device memory ``forward_kvcache`` needs as its ``workspace`` (0: none)
    for ``num_splits`` splits, or where None for the splits it picks for these sizes
    (``max_seqlen_k``: the cache's keys per sequence, max_cache or max_pages x page_size)
    on a GPU of ``sm_count`` multiprocessors; with neither, for the most splits it could
    pick on any GPU (no GPU is asked: enough wherever the call runs). ``head_dim_v``:
    v_cache's head dim where it is not q's."""
    checks.check_sizes(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       max_seqlen_k=max_seqlen_k)
    if sm_count is not None:
        checks.check_sizes(sm_count=sm_count)
    library = library or default_library()
    head_dim_q = head_dim
    head_dim = kernel_head_dim(library.manifest, "decode", head_dim, head_dim_v)
    rows = library.manifest.matching(kind="decode", head_dim=head_dim)
    if not rows:
        check_built(library.manifest, dict(kind="decode", head_dim=head_dim, dtype="bf16", causal=False), 1)
    sizes = {"batch": batch, "seqlen_q": seqlen_q, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
             "max_seqlen_k": max_seqlen_k}
    _check_splits(num_splits)

    def most(row, sizes):  # the splits a call on this row can take: policy.decode_splits takes at most this many
        if num_splits is None and sm_count is None:
            return max(1, min(row["limits"]["max_splits"], -(-max_seqlen_k // row["config"]["tile_n"])))
        return _splits(num_splits, sizes, row, sm_count or 1)

    def need(sizes, rows):  # the most of every row (their key tiles and CTAs per SM differ: local d64)
        splits, row = max((most(r, sizes), i, r) for i, r in enumerate(rows))[::2]
        if splits == 1:
            return 0
        rule = row["workspace"]
        return ws.total_bytes(rule, ws.regions(rule, ws.names(rule, {**sizes, "splits": splits})))

    bytes_ = need(sizes, rows)
    # a call of these sizes may read pairs of KV heads (pair_sizes), on those kernels, with
    # sinks and no window too (the local ones): the most of every head dim built for pairs
    columns = {**sizes, "columns": head_dim_q, "columns_v": head_dim_v or head_dim_q}
    paired = {p["head_dim"]: p for p in (pair_sizes(library.manifest, columns, mods)
                                         for mods in (None, checks.ScoreMods(-1, -1, 0.0, True))) if p is not None}
    for pair_dim, pair in paired.items():
        pair_rows = [r for r in library.manifest.matching(kind="decode", head_dim=pair_dim) if r["config"].get("pairs")]
        bytes_ = max(bytes_, need({n: pair[n] for n in sizes}, pair_rows))
    return bytes_


def forward_kvcache(q, k_cache, v_cache, out, lse, cache_seqlens=None, workspace=None, *, page_table=None,
                    causal: bool = False, softmax_scale: float | None = None, num_splits: int | None = None,
                    window_size=(-1, -1), softcap: float = 0.0, learnable_sink=None, k_descale=None,
                    v_descale=None, stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v and lse, each sequence against its cache.

    Layouts and metadata: see the module's docstring. ``workspace``: contiguous device
    memory of ``forward_kvcache_workspace_bytes(...)`` bytes, 256-byte aligned, any
    contents; may be None where that is 0 (one split). ``window_size``, ``softcap``,
    ``learnable_sink``: as ``fa4_aot.forward``'s, each sequence's queries at the end of its
    cache (key tiles wholly outside the windows are not read). ``k_descale``,
    ``v_descale``: an FP8 cache's scales (the module's docstring). ``stream``: a raw CUstream
    handle. Asynchronous and allocation-free; bad arguments raise a Fa4AotError before
    anything is launched.
    """
    library = library or default_library()
    _check_splits(num_splits)
    # a repeated call of DeviceArrays on an int stream: its launches again, as packed
    # (the raw API's key by the arrays' ids, pinned by the kept plan: fa4_aot.launch.calls.repeat_key)
    given = tuple(a for a in (q, k_cache, v_cache, out, lse, cache_seqlens, workspace, page_table, learnable_sink,
                              k_descale, v_descale) if a is not None)
    repeat = repeat_key("decode", given, (workspace is None, page_table is None, learnable_sink is None,
                                          k_descale is None, v_descale is None, causal, softmax_scale, num_splits,
                                          window_size, softcap, policy.DECODE_TURN_STRIDE), stream)
    if repeat is not None and library.launch_again(repeat):
        return
    arrays, waits, mods, scale, stream = _read_call(
        (q, k_cache, v_cache, out, lse, cache_seqlens, page_table, workspace, learnable_sink, k_descale, v_descale),
        causal, softmax_scale, window_size, softcap, stream)
    # the decode and its combine are kept as one plan under the arrays' values (and the
    # repeat key's ids): a call with the same ones is launched again as packed
    key = ("decode", *arrays.items(), mods, scale, num_splits, policy.DECODE_TURN_STRIDE, stream)
    aliases = ((repeat, given),) if repeat is not None else ()
    if library.launch_again(key, waits, aliases):
        return
    prepare_checked(arrays, mods, scale, num_splits, stream, library).issue(key, waits, aliases)


class PreparedDecode(NamedTuple):
    """A checked decode call's launches, packed (``prepare_kvcache``); ``issue`` launches them."""

    library: KernelLibrary
    prepared: object

    def issue(self, key=None, waits=(), aliases=()) -> None:
        self.library.issue(self.prepared, key, waits, aliases)


def prepare_kvcache(q, k_cache, v_cache, out, lse, cache_seqlens=None, workspace=None, *, page_table=None,
                    causal: bool = False, softmax_scale: float | None = None, num_splits: int | None = None,
                    window_size=(-1, -1), softcap: float = 0.0, learnable_sink=None, k_descale=None,
                    v_descale=None, stream: int = 0, library: KernelLibrary | None = None) -> PreparedDecode:
    """``forward_kvcache``'s every check and its launches packed, not issued: for a caller
    that writes something once the call is known good (fa4_aot.torch's cache append),
    then calls ``.issue()``. A bad argument raises here, before anything is written."""
    library = library or default_library()
    _check_splits(num_splits)
    arrays, waits, mods, scale, stream = _read_call(
        (q, k_cache, v_cache, out, lse, cache_seqlens, page_table, workspace, learnable_sink, k_descale, v_descale),
        causal, softmax_scale, window_size, softcap, stream)
    if waits:
        raise DeviceError("prepare_kvcache takes arrays of its stream (no __cuda_array_interface__ of another)")
    return prepare_checked(arrays, mods, scale, num_splits, stream, library)


ARRAY_NAMES = ("q", "k_cache", "v_cache", "out", "lse", "cache_seqlens", "page_table", "workspace", "sink",
               "k_descale", "v_descale")
SINK_AT = ARRAY_NAMES.index("sink")


def _read_call(given: tuple, causal, softmax_scale, window_size, softcap, stream):
    """A decode call's options checked and its arrays (``given`` in ARRAY_NAMES' order)
    read on its stream: (arrays, waits, ScoreMods, scale, stream)."""
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    mods = checks.score_mods(causal, window_size, softcap, given[SINK_AT] is not None)
    stream = checks.stream_handle(stream)
    arrays, waits = as_device_arrays({name: x for name, x in zip(ARRAY_NAMES, given)
                                      if x is not None or name not in OPTIONAL}, stream)
    return arrays, waits, mods, scale, stream


def prepare_checked(arrays: dict, mods, scale, num_splits, stream: int, library: KernelLibrary) -> PreparedDecode:
    """Every check of a decode call whose arrays (DeviceArrays by ARRAY_NAMES) and options
    (``mods``: checks.ScoreMods) are read, and its launches (the decode, and the combine
    where split) packed: forward_kvcache's, and fa4_aot.forward's for decode shapes."""
    sizes = served_sizes(library.manifest, "decode", check_forward_kvcache(arrays))
    paired = pair_sizes(library.manifest, sizes, mods)
    if paired is not None and heads_adjacent(arrays["k_cache"], arrays["v_cache"]):
        sizes = paired
    else:
        paired = None
    if mods.sink:
        checks.check_sink(arrays["sink"], sizes["heads_q"])
    check_no_overlap(written(arrays, *WRITTEN), read(arrays, *WRITTEN))
    axes = dict(kind="decode", dtype=sizes["dtype"], head_dim=sizes["head_dim"], kv_dtype=sizes["kv_dtype"],
                **mods.axes())
    check_built(library.manifest, axes, 1)
    check_limits(sizes, library.manifest.matching(**axes)[0]["limits"])
    device = device_of(arrays)
    arch = library.arch(device)
    sm_count = library.sm_count(device)
    row = span_row(library.manifest, axes, arch, sizes, mods, sm_count)
    splits = _splits(num_splits, sizes, row, sm_count, mods if mods.local else None)
    tensors = {}
    if splits > 1:
        if "workspace" not in arrays:
            raise ShapeError(f"{splits} splits need a workspace (fa4_aot.forward_kvcache_workspace_bytes)")
        space = arrays["workspace"]
        checks.check_workspace(space)
        tensors.update(ws.carve(row["workspace"], ws.names(row["workspace"], {**sizes, "splits": splits}), space.ptr,
                                math.prod(space.shape) * space.itemsize))
    else:
        dummy = arrays["lse"].as_launch_tensor()  # never read or written with one split
        tensors.update(o_partial=dummy, lse_partial=dummy)
    scale = default_scale(sizes["columns"]) if scale is None else scale
    tensors.update(launch_tensors(arrays))
    if paired is not None:  # each pair of adjacent KV heads one head of twice the width
        tensors.update(k_cache=_pair_view(arrays["k_cache"]), v_cache=_pair_view(arrays["v_cache"]))
    full_cache = "cache_seqlens" not in arrays
    if full_cache:  # every sequence's whole cache: no lengths read
        tensors["cache_seqlens"] = arrays["lse"].as_launch_tensor()
    tensors.setdefault("page_table", tensors["cache_seqlens"])  # not paged: read by no one
    values = {**{n: x for n, x in sizes.items() if n not in ("dtype", "kv_dtype")}, "scale_log2": scale * LOG2E, "splits": splits,
              "turn_stride": policy.DECODE_TURN_STRIDE, "full_cache": int(full_cache)}
    mods.add_launch_values(values, tensors, scale, LOG2E)
    if sizes["kv_dtype"] != "same":
        _descale_values(arrays, values, tensors)
    # the combine found, and both packed, before anything is launched: a call refused
    # after the decode ran would have kept a plan of the decode alone for its repeats
    then = ()
    if splits > 1:
        combine = library.manifest.find(kind="combine", dtype=sizes["dtype"], head_dim=sizes["head_dim"],
                                        causal=False, arch=arch, q_tiles=1)
        then = ((combine, values, tensors),)
    return PreparedDecode(library, library.prepare(row, device, stream, values, tensors, then=then))
