"""Attention over packed variable-length sequences (cu_seqlens), from raw pointers or any
framework's arrays: the forward (``forward_varlen``, its optional workspace for the
heaviest-first order sized by ``forward_varlen_workspace_bytes``) and the backward (``backward_varlen``,
its workspace sized by ``backward_varlen_workspace_bytes``).

Layouts (flash-attn's): q (total_q, heads_q, head_dim), out (total_q, heads_q, head_dim_v);
k (total_k, heads_kv, head_dim), v (total_k, heads_kv, head_dim_v) (head_dim_v: v's,
head_dim's or another); lse (heads_q, total_q) float32, contiguous; cu_seqlens_q, cu_seqlens_k int32
(batch + 1,) on the device: sequence i has rows [cu[i], cu[i + 1]); seqused_q, seqused_k
int32 (batch,), optional: only the first seqused[i] rows of sequence i are used (fewer
than packed). max_seqlen_q, max_seqlen_k: the longest sequence, from the caller, so
nothing waits for the device. The contents of cu_seqlens and seqused are not checked on
the host (that would need a sync); the kernels clamp every sequence to the packed tensors,
so metadata that lies (decreasing, past the totals, a max_seqlen too small) gives wrong
numbers at worst and is never read or written out of bounds.
"""

from __future__ import annotations

import math

from . import policy
from .errors import DTypeError, LayoutError, OptionError, ShapeError, UnsupportedVariantError
from .launch import checks
from .launch import workspace as ws
from .launch.arrays import DeviceArray, as_device_arrays
from .launch.calls import LOG2E, backward_rows, check_built, default_library, kernel_head_dim, served_sizes
from .launch.checks import (
    GRID_YZ_MAX, INT32_MAX, check_backward, check_forward, check_no_overlap, default_scale, device_of, read, written,
)
from .launch.loader import KernelLibrary, grid_of


OPTIONAL = ("seqused_q", "seqused_k", "workspace", "sink", "dsink")  # arrays a call may leave out (None)
WRITTEN_FORWARD = ("out", "lse", "workspace")  # what the launches write (the workspace: the order)
WRITTEN_BACKWARD = ("dq", "dk", "dv", "workspace", "dsink")


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
    problem = check_forward(packed["q"], packed["k"], packed["v"], packed["out"], lse)
    batch = arrays["cu_seqlens_q"].shape[0] - 1 if len(arrays["cu_seqlens_q"].shape) == 1 else -1
    if batch < 1:
        raise ShapeError(f"cu_seqlens_q must have shape (batch + 1,) with batch >= 1; got "
                         f"{arrays['cu_seqlens_q'].shape}")
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        _check_lengths(name, arrays[name], batch + 1)
    for name in ("seqused_q", "seqused_k"):
        if name in arrays:
            _check_lengths(name, arrays[name], batch)
    max_q, max_k = checks.positive_int("max_seqlen_q", max_seqlen_q), checks.positive_int("max_seqlen_k", max_seqlen_k)
    if batch > GRID_YZ_MAX:
        raise ShapeError(f"batch={batch} must be at most {GRID_YZ_MAX} (grid limits)")
    total_k = problem.seqlen_k
    return {"total_q": total_q, "total_k": total_k, "heads_q": heads_q, "heads_kv": problem.heads_kv,
            "batch": batch, "max_seqlen_q": max_q, "max_seqlen_k": max_k,
            "head_dim": problem.columns, "head_dim_v": problem.columns_v, "dtype": problem.dtype, "packed": packed}


def forward_varlen_workspace_bytes(batch: int, *, library: KernelLibrary | None = None) -> int:
    """Bytes of device memory ``forward_varlen`` needs as its ``workspace`` for ``batch``
    sequences (the heaviest-first order: the varlen forward rows' workspace rule, batch
    int32 in 256-byte units); no GPU needed."""
    checks.check_sizes(batch=batch)
    library = library or default_library()
    rules = library.manifest.workspace_rules(kind="fwd", varlen=True)
    if not rules:
        raise UnsupportedVariantError("no varlen forward kernel is built")
    return max(_workspace_bytes(rule, ws.names(rule, {"batch": batch})) for rule in rules)


def default_forward_order(batch: int, *, library: KernelLibrary | None = None) -> str:
    """The order ``forward_varlen`` takes for ``batch`` sequences where given a workspace
    and no ``order`` (policy.varlen_order, up to the sort's bound in the manifest)."""
    library = library or default_library()
    rows = library.manifest.matching(kind="fwd", varlen=True)
    return policy.varlen_order(batch, min((r["limits"]["lpt_max_batch"] for r in rows), default=0))


def _walk_order(order, row: dict, values: dict, room: bool, needs: str, default: str) -> str:
    """A varlen call's sequence order: ``order`` as given ("plain" or "lpt"), or where None
    ``default`` (the policy's) if the workspace has ``room`` for the order and the CTAs of
    the launch that walks it (the row's, by its grid rule, for the call's ``values``)
    count in int32, else "plain". ``needs``: the workspace the order needs, for the errors."""
    walker = next(launch for launch in row["launches"]
                  if "when" not in launch and any(s.get("value") == "lpt" for s in launch["params"]))
    ctas = math.prod(grid_of(walker, values))
    if order is None:
        return default if room and ctas <= INT32_MAX else "plain"
    if order not in policy.VARLEN_ORDERS:
        raise OptionError(f"order must be one of {policy.VARLEN_ORDERS} or None; got {order!r}")
    if order == "lpt":
        if not room:
            raise OptionError(f"order='lpt' needs a workspace of {needs} bytes")
        most = row["limits"]["lpt_max_batch"]
        if values["batch"] > most:
            raise ShapeError(f"order='lpt' sorts up to {most} sequences; got batch={values['batch']} "
                             "(order=None takes the plain order there)")
        if ctas > INT32_MAX:
            raise ShapeError(f"order='lpt' walks {ctas} CTAs ({walker['grid']}), past int32 indices, for "
                             f"{ {n: values[n] for n in ('batch', 'total_q', 'total_k', 'heads_q', 'heads_kv')} }")
    return order


def forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   seqused_q=None, seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                   window_size=(-1, -1), softcap: float = 0.0, learnable_sink=None,
                   stream: int = 0, library: KernelLibrary | None = None, workspace=None,
                   order: str | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v and lse, per packed sequence.

    Layouts and metadata: see the module's docstring. Causal masking is aligned to the
    bottom-right corner of each sequence (query i of a sequence sees keys j <= i +
    seqlen_k - seqlen_q); seqlen_q may differ from seqlen_k in each sequence; zero-length
    sequences write nothing; a query row that sees no key gets out 0 and lse -inf.
    GQA/MQA: heads_q a multiple of heads_kv. ``stream``: a raw CUstream handle.
    ``workspace``: contiguous device memory of ``forward_varlen_workspace_bytes(batch)``
    bytes, 4-byte aligned, any contents, for the heaviest-first order; ``order``: "lpt"
    (sequences heaviest first, a one-CTA sort launched before the kernel; up to
    the row's limits.lpt_max_batch sequences), "plain" (the caller's order), or None: the policy's
    choice where a workspace is given (policy.varlen_order), else "plain". The order
    changes which CTA computes a tile, not what it computes: the results are the same bits.
    ``window_size``, ``softcap``, ``learnable_sink``: as ``fa4_aot.forward``'s, the window
    within each sequence. Asynchronous and allocation-free.
    """
    run_forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q,
                       seqused_k=seqused_k, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                       softcap=softcap, learnable_sink=learnable_sink, stream=stream, library=library,
                       workspace=workspace, order=order)


def run_forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                       seqused_q=None, seqused_k=None, causal: bool = False, softmax_scale: float | None = None,
                       window_size=(-1, -1), softcap: float = 0.0, learnable_sink=None, stream: int = 0,
                       library: KernelLibrary | None = None, workspace=None, order: str | None = None,
                       aliases=()) -> None:
    """``forward_varlen``; its launches kept under ``aliases`` too ((key, pinned) pairs: an
    adapter's own keys, as fa4_aot.dense.run_forward's)."""
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    mods = checks.score_mods(causal, window_size, softcap, learnable_sink is not None)
    stream = checks.stream_handle(stream)
    named = (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q), ("seqused_k", seqused_k),
             ("workspace", workspace), ("sink", learnable_sink))
    arrays, waits = as_device_arrays({name: x for name, x in named if x is not None or name not in OPTIONAL}, stream)
    library = library or default_library()
    key = ("fwd_varlen", *arrays.items(), max_seqlen_q, max_seqlen_k, mods, scale, stream, order)
    if library.launch_again(key, waits, aliases):
        return
    sizes = served_sizes(library.manifest, "fwd", check_forward_varlen(arrays, max_seqlen_q, max_seqlen_k))
    if mods.sink:
        checks.check_sink(arrays["sink"], sizes["heads_q"])
    if "workspace" in arrays:
        _check_order_workspace(arrays["workspace"], sizes["batch"], library)
    check_no_overlap(written(arrays, *WRITTEN_FORWARD), read(arrays, *WRITTEN_FORWARD))
    axes = library.manifest.own_head_dim_v(dict(kind="fwd", dtype=sizes["dtype"], head_dim=sizes["head_dim"],
                                                varlen=True, **mods.axes()), sizes["columns_v"])
    check_built(library.manifest, axes, 1)
    device = device_of(arrays)
    row = library.manifest.find(**axes, arch=library.arch(device), q_tiles=1)
    scale = default_scale(sizes["columns"]) if scale is None else scale
    packed = sizes.pop("packed")
    tensors = _sequence_tensors(arrays, packed)
    walk = _walk_order(order, row, sizes, "workspace" in arrays, "forward_varlen_workspace_bytes(batch)",
                       policy.varlen_order(sizes["batch"], row["limits"]["lpt_max_batch"]))
    if walk == "lpt":
        space = arrays["workspace"]
        tensors.update(ws.carve(row["workspace"], ws.names(row["workspace"], sizes), space.ptr,
                                math.prod(space.shape) * space.itemsize))
    else:  # the kernel reads no order (cu_seqlens_q stands in for the pointer)
        tensors["order"] = tensors["cu_seqlens_q"]
    values = {**{n: v for n, v in sizes.items() if n != "dtype"}, "scale_log2": scale * LOG2E,
              "use_seqused_q": int("seqused_q" in arrays), "use_seqused_k": int("seqused_k" in arrays),
              "lpt": int(walk == "lpt")}
    mods.add_launch_values(values, tensors, scale, LOG2E)
    library.launch(row, device, stream, values, tensors, key=key, waits=waits, aliases=aliases)


def _sequence_tensors(arrays: dict, packed: dict) -> dict:
    """A varlen call's launch tensors: the packed (total, h, d) arrays as (1, total, h, d),
    LSE and the metadata as given; seqused not given: any int32 vector of at least batch
    entries, which the kernels read but do not use (cu_seqlens)."""
    tensors = {name: packed[name].as_launch_tensor() if name in packed else a.as_launch_tensor()
               for name, a in arrays.items() if name != "workspace"}
    for name in ("seqused_q", "seqused_k"):
        tensors.setdefault(name, tensors["cu_seqlens_" + name[-1]])
    return tensors


def _check_order_workspace(space: DeviceArray, batch: int, library: KernelLibrary) -> None:
    """The forward's workspace: contiguous, 4-byte aligned, at least
    forward_varlen_workspace_bytes(batch) bytes."""
    checks.check_workspace(space)
    if space.ptr % 4:
        raise LayoutError(f"workspace's data pointer {space.ptr:#x} is not 4-byte aligned")
    have, need = math.prod(space.shape) * space.itemsize, forward_varlen_workspace_bytes(batch, library=library)
    if have < need:
        raise ShapeError(f"workspace has {have} bytes; forward_varlen needs {need} "
                         f"(forward_varlen_workspace_bytes({batch}))")


def _varlen_workspace_values(rule: dict, sizes: dict, lpt: bool) -> dict:
    """The varlen backward workspace rule's names for a problem whose order is heaviest
    first where ``lpt`` (the rule's derived ws_tiles, ws_rows, order_entries)."""
    return ws.names(rule, {**sizes, "lpt": int(lpt)})


def _workspace_bytes(rule: dict, values: dict) -> int:
    return ws.total_bytes(rule, ws.regions(rule, values))


def backward_varlen_workspace_bytes(total_q: int, batch: int, heads_q: int, head_dim: int, *, causal: bool = False,
                                    deterministic: bool = False, dtype: str | None = None, local: bool = False,
                                    head_dim_v: int | None = None, library: KernelLibrary | None = None) -> int:
    """Bytes of device memory ``backward_varlen`` needs as its ``workspace``: for packed
    queries of ``total_q`` rows in ``batch`` sequences (called with the same ``causal`` and
    ``deterministic``), with room for the heaviest-first order (batch int32). The most any
    built varlen backward of this head_dim (and dtype, where given) needs; no GPU needed.
    ``local``: for a backward with a window or sinks; ``head_dim_v``: v's head dim where it
    is not q's."""
    checks.check_sizes(total_q=total_q, batch=batch, heads_q=heads_q, head_dim=head_dim)
    library = library or default_library()
    head_dim = kernel_head_dim(library.manifest, "bwd", head_dim, head_dim_v)
    rows = backward_rows(library.manifest, head_dim, causal, deterministic, dtype, varlen=True, local=local)
    sizes = {"total_q": total_q, "batch": batch, "heads_q": heads_q, "head_dim": head_dim}
    return max(_workspace_bytes(r["workspace"], _varlen_workspace_values(r["workspace"], sizes, True)) for r in rows)


def check_backward_varlen(arrays: dict, max_seqlen_q, max_seqlen_k) -> dict:
    """Every rule the host can check without the device: the forward's (check_forward_varlen)
    and the gradients' shapes, dtypes and layouts; returns the launch's sizes."""
    sizes = check_forward_varlen(arrays, max_seqlen_q, max_seqlen_k)
    packed = sizes["packed"]
    grads = {n: _as_packed(arrays[n]) for n in ("dout", "dq", "dk", "dv")}
    check_backward(packed["q"], packed["k"], packed["v"], packed["out"], grads["dout"], _lse_4d(arrays["lse"]),
                   grads["dq"], grads["dk"], grads["dv"])
    sizes["packed"] = {**packed, **grads}
    return sizes


def _lse_4d(lse: DeviceArray) -> DeviceArray:
    """(h_q, total_q) as the dense checks' (1, h_q, total_q) (check_forward_varlen has
    checked its shape)."""
    return DeviceArray(lse.ptr, (1, *lse.shape), (lse.shape[0] * lse.shape[1], *lse.strides), lse.dtype, lse.device)


def backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                    max_seqlen_k: int, workspace, *, seqused_q=None, seqused_k=None, causal: bool = False,
                    softmax_scale: float | None = None, deterministic: bool = False, stream: int = 0,
                    library: KernelLibrary | None = None, order: str | None = None, window_size=(-1, -1),
                    softcap: float = 0.0, learnable_sink=None, dsink=None) -> None:
    """Gradients dq, dk, dv of ``forward_varlen``'s out for the upstream gradient dout.

    q, k, v, out, lse, the metadata, causal and the scale: as given to and produced by
    ``forward_varlen``. dout, dq: (total_q, heads_q, head_dim) like q; dk, dv like k; rows
    of no sequence (past seqused, or past the last cu_seqlens) are not written. workspace:
    contiguous device memory of ``backward_varlen_workspace_bytes(total_q, batch, heads_q,
    head_dim, causal=causal, deterministic=deterministic)`` bytes, 256-byte aligned, any
    contents. ``deterministic``: repeated runs are bitwise identical. GQA/MQA as for
    ``backward``. A sequence with no keys gets dq 0; one with no queries dk, dv 0.
    ``order``: the main kernel's sequence order, as forward_varlen's: "lpt" (heaviest
    first by the tile pairs of their key tiles, a one-CTA sort launched first; needs the
    whole workspace), "plain", or None: the policy's (policy.varlen_backward_order) where
    the workspace has room for the order (batch int32 more than the plain order needs),
    else "plain". The order moves CTAs, not their math: deterministic, the same bits either
    way. Asynchronous and allocation-free; bad arguments raise before any launch.
    ``window_size``, ``softcap``, ``learnable_sink``, ``dsink``: as ``fa4_aot.backward``'s.
    """
    run_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        workspace, seqused_q=seqused_q, seqused_k=seqused_k, causal=causal,
                        softmax_scale=softmax_scale, deterministic=deterministic, stream=stream, library=library,
                        order=order, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                        dsink=dsink)


def run_backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                        max_seqlen_k: int, workspace, *, seqused_q=None, seqused_k=None, causal: bool = False,
                        softmax_scale: float | None = None, deterministic: bool = False, stream: int = 0,
                        library: KernelLibrary | None = None, order: str | None = None, window_size=(-1, -1),
                        softcap: float = 0.0, learnable_sink=None, dsink=None, aliases=()) -> None:
    """``backward_varlen``; its launches kept under ``aliases`` too (as ``run_forward_varlen``)."""
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    deterministic = checks.flag("deterministic", deterministic)
    mods = checks.backward_mods(causal, window_size, softcap, learnable_sink, dsink)
    stream = checks.stream_handle(stream)
    named = (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse), ("dq", dq), ("dk", dk),
             ("dv", dv), ("workspace", workspace), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
             ("seqused_q", seqused_q), ("seqused_k", seqused_k), ("sink", learnable_sink), ("dsink", dsink))
    arrays, waits = as_device_arrays({name: x for name, x in named if x is not None or name not in OPTIONAL}, stream)
    library = library or default_library()
    key = ("bwd_varlen", *arrays.items(), max_seqlen_q, max_seqlen_k, causal, mods, scale, deterministic, stream,
           order)
    if library.launch_again(key, waits, aliases):
        return
    sizes = served_sizes(library.manifest, "bwd", check_backward_varlen(arrays, max_seqlen_q, max_seqlen_k))
    for name in ("sink", "dsink"):
        if name in arrays:
            checks.check_sink(arrays[name], sizes["heads_q"], name)
    space = arrays["workspace"]
    checks.check_workspace(space)
    check_no_overlap(written(arrays, *WRITTEN_BACKWARD), read(arrays, *WRITTEN_BACKWARD))
    axes = library.manifest.own_head_dim_v(dict(kind="bwd", dtype=sizes["dtype"], head_dim=sizes["head_dim"],
                                                deterministic=deterministic, varlen=True,
                                                **(mods.axes() if mods.local else {"causal": causal})),
                                           sizes["columns_v"])
    check_built(library.manifest, axes, 1)
    device = device_of(arrays)
    row = library.manifest.find(**axes, arch=library.arch(device), q_tiles=1)
    rule = row["workspace"]
    packed = sizes.pop("packed")
    problem = {n: x for n, x in sizes.items() if n != "dtype"}
    values = _varlen_workspace_values(rule, problem, True)
    if values["heads_q"] * values["ws_rows"] > INT32_MAX:
        raise ShapeError(f"heads_q * (total_q + batch * {rule['constants']['query_tile']}) rows must be below 2**31 "
                         "(the workspace's int32 indices)")
    have = math.prod(space.shape) * space.itemsize
    walk = _walk_order(order, row, values, have >= _workspace_bytes(rule, values),
                       "backward_varlen_workspace_bytes(total_q, batch, heads_q, head_dim, causal=, deterministic=)",
                       policy.varlen_backward_order(sizes["batch"], causal, sizes["max_seqlen_k"], sizes["total_k"],
                                                    row["limits"]["lpt_max_batch"]))
    values = _varlen_workspace_values(rule, problem, walk == "lpt")
    tensors = ws.carve(rule, values, space.ptr, have)
    scale = default_scale(sizes["columns"]) if scale is None else scale
    tensors.update(_sequence_tensors(arrays, packed))
    turn_tiles = policy.deterministic_turn_tiles(causal, sizes["head_dim"], sizes["max_seqlen_k"]) if deterministic else 1
    values.update({"scale": scale, "scale_log2": scale * LOG2E, "turn_tiles": turn_tiles,
                   "first_write": int(policy.first_write_dq(deterministic, mods.keys_seen(sizes["max_seqlen_k"]))),
                   "use_seqused_q": int("seqused_q" in arrays), "use_seqused_k": int("seqused_k" in arrays),
                   "lpt": int(walk == "lpt")})
    checks.add_backward_values(mods, values, tensors, values["ws_tiles"], scale, LOG2E)
    library.launch(row, device, stream, values, tensors, key=key, waits=waits, aliases=aliases)
