"""The public entry points: attention from raw pointers or any framework's arrays.

The mechanics only: check the arrays, pick the manifest row (by fa4_aot.policy's
thresholds), lay the workspace out by the row's rule (fa4_aot.launch.workspace), and launch with
the run-time values policy gives. Nothing here re-derives what a kernel was built with.
"""

from __future__ import annotations

import math

from . import policy
from .decode import (forward_kvcache_workspace_bytes, heads_adjacent, pair_sizes, prepare_checked, span_row,
                     splits_for)
from .launch import checks
from .launch import workspace as ws
from .launch.arrays import as_device_arrays
from .launch.calls import (
    LOG2E, backward_rows, check_built, default_library, kernel_head_dim, launch_tensors, repeat_key, served,
)
from .launch.checks import (
    GRID_YZ_MAX, check_backward, check_forward, check_no_overlap, default_scale, device_of, read, written,
)
from .errors import UnsupportedVariantError
from .launch.loader import KernelLibrary

WRITTEN_BACKWARD = ("dq", "dk", "dv", "workspace", "dsink")


def forward_row(manifest, axes: dict, keys_seen: int, q_tiles: int | None = None) -> dict:
    """The forward's manifest row for ``axes`` (kind, arch, dtype, head_dim, causal[, local,
    softcap]): with ``q_tiles`` query tiles per CTA, or when None two where
    policy.forward_two_tiles (of the keys a row sees: ScoreMods.keys_seen) and they are
    built, else one."""
    return _row(manifest, axes, q_tiles, policy.forward_two_tiles(keys_seen))


def _row(manifest, axes: dict, q_tiles: int | None, two_tiles: bool) -> dict:
    """The row of ``axes`` with ``q_tiles``, or when None 2 where ``two_tiles`` and built, else 1."""
    if q_tiles is None:
        q_tiles = 2 if two_tiles and manifest.built(**axes, q_tiles=2) else 1
    return manifest.find(**axes, q_tiles=int(q_tiles))


def backward_row(manifest, axes: dict, seqlen_k: int, q_tiles: int | None = None) -> dict:
    """The backward's manifest row for ``axes`` (kind, arch, dtype, head_dim, causal,
    deterministic): with ``q_tiles`` query tiles per step, or when None two where
    policy.backward_two_tiles (by the one-tile row's persistent keys) and they are built,
    else one."""
    two = False
    if q_tiles is None and manifest.built(**axes, q_tiles=2) and manifest.built(**axes, q_tiles=1):
        one = manifest.find(**axes, q_tiles=1)
        two = policy.backward_two_tiles(seqlen_k, one["limits"]["persistent_max_keys"])
    return _row(manifest, axes, q_tiles, two)


def forward(q, k, v, out, lse, *, softmax_scale: float | None = None, causal: bool = False,
            window_size=(-1, -1), softcap: float = 0.0, learnable_sink=None, workspace=None,
            q_tiles: int | None = None, stream: int = 0, library: KernelLibrary | None = None) -> None:
    """out = softmax(q k^T * scale [+ causal mask]) v, and lse = logsumexp of the scaled scores.

    q: (batch, seqlen_q, heads_q, head_dim); k: (batch, seqlen_k, heads_kv, head_dim); v:
    (batch, seqlen_k, heads_kv, head_dim_v), out: (batch, seqlen_q, heads_q, head_dim_v)
    (head_dim_v: v's, head_dim's or another, e.g. 128 beside 192), bf16 or fp16, last dim
    contiguous, other strides and pointers 16-byte aligned; heads_q a multiple of
    heads_kv. lse: float32, contiguous (batch, heads_q, seqlen_q).
    Each is a DeviceArray or an object with __dlpack__ / __cuda_array_interface__.
    Causal masking is aligned to the bottom-right corner (query i sees keys
    j <= i + seqlen_k - seqlen_q); a query row that sees no key gets out = 0, lse = -inf.
    ``q_tiles``: query tiles per CTA, 1 or 2; None picks by the keys a row sees
    (policy.forward_two_tiles).
    ``window_size`` (left, right): query i sees only keys j with i + seqlen_k - seqlen_q -
    left <= j <= i + seqlen_k - seqlen_q + right (-1 or None: unbounded; causal makes right
    0). ``softcap`` > 0: the scaled scores s become softcap * tanh(s / softcap).
    ``learnable_sink``: float32 (heads_q,), a logit per query head that joins each row's
    softmax denominator and adds no value (a row that sees no key: out 0, lse the sink).
    These take the local kernels.
    Decode shapes (a few query tokens per KV head against many keys, policy.dense_decode)
    take the decode kernel (GQA-packed, the whole k and v as each sequence's cache), split
    over the keys where it fills the GPU better: then only with a ``workspace``
    (``forward_workspace_bytes``: contiguous device memory, 256-byte aligned, any
    contents), without one the prefill kernel. Giving ``q_tiles`` asks for the prefill
    kernel. Either way the result is bitwise the same for the same call on the same GPU.
    ``stream`` is a raw CUstream handle (0: the legacy default
    stream; 2: the per-thread one); a DLPack array is asked for on it, and it waits for the
    stream a __cuda_array_interface__ array names. Asynchronous: nothing is allocated and
    nothing waits for the GPU. Every bad argument raises a fa4_aot.Fa4AotError before
    anything is launched, and before the driver is asked where no driver is needed.
    """
    arrays = tuple(a for a in (q, k, v, out, lse, learnable_sink, workspace) if a is not None)
    repeat = repeat_key("fwd", arrays, (softmax_scale, causal, window_size, softcap, q_tiles,
                                        learnable_sink is None, workspace is None), stream)
    if repeat is not None and (library or default_library()).launch_again(repeat):
        return
    run_forward(q, k, v, out, lse, softmax_scale, causal, q_tiles, stream, library,
                ((repeat, arrays),) if repeat else (), window_size, softcap, learnable_sink, workspace)


def run_forward(q, k, v, out, lse, softmax_scale, causal, q_tiles, stream, library, aliases=(),
                window_size=(-1, -1), softcap=0.0, learnable_sink=None, workspace=None) -> None:
    """``forward``; its launches kept under ``aliases`` too ((key, pinned) pairs: keys an
    adapter computes from its own arrays, for its repeated calls, as fa4_aot.torch's, or
    the raw API's; KernelLibrary.launch)."""
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    mods = checks.score_mods(causal, window_size, softcap, learnable_sink is not None)
    q_tiles, stream = checks.q_tiles(q_tiles), checks.stream_handle(stream)
    given = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    if mods.sink:
        given["sink"] = learnable_sink
    if workspace is not None:
        given["workspace"] = workspace
    arrays, waits = as_device_arrays(given, stream)
    library = library or default_library()
    # The arrays (pointers, shapes, strides, dtypes) and options determine every check and
    # every parameter: a call made before with the same ones is launched again as packed.
    key = ("fwd", *arrays.values(), mods, scale, q_tiles, stream)
    if library.launch_again(key, waits, aliases):
        return
    problem = served(library.manifest, "fwd", check_forward(arrays["q"], arrays["k"], arrays["v"], arrays["out"],
                                                            arrays["lse"]))
    if mods.sink:
        checks.check_sink(arrays["sink"], problem.heads_q)
    if "workspace" in arrays:
        checks.check_workspace(arrays["workspace"])
    check_no_overlap(written(arrays, "out", "lse", "workspace"), read(arrays, "out", "lse", "workspace"))
    axes = library.manifest.own_head_dim_v(dict(kind="fwd", dtype=problem.dtype, head_dim=problem.head_dim,
                                                **mods.axes()), problem.columns_v)
    check_built(library.manifest, axes, q_tiles)  # q_tiles=2 at head_dim 192, 256: not built, and says why
    device = device_of(arrays)
    arch = library.arch(device)
    splits = 0 if q_tiles is not None else decode_splits(library, problem, mods, arch, device,
                                                         heads_adjacent(arrays["k"], arrays["v"]))
    if splits and (splits == 1 or "workspace" in arrays):  # a decode shape: the decode kernel
        cache = {"q": arrays["q"], "k_cache": arrays["k"], "v_cache": arrays["v"], "out": arrays["out"],
                 "lse": arrays["lse"], **{n: arrays[n] for n in ("sink", "workspace") if n in arrays}}
        prepare_checked(cache, mods, scale, splits, stream, library).issue(key, waits, aliases)
        return
    row = forward_row(library.manifest, {**axes, "arch": arch}, mods.keys_seen(problem.seqlen_k), q_tiles)
    scale = default_scale(problem.columns) if scale is None else scale
    values = {**problem.sizes, "scale_log2": scale * LOG2E}
    tensors = launch_tensors(arrays)
    mods.add_launch_values(values, tensors, scale, LOG2E)
    library.launch(row, device, stream, values, tensors, key=key, waits=waits, aliases=aliases)


def decode_row(library: KernelLibrary, problem, mods, arch: str | None, sm_count: int | None) -> dict | None:
    """The decode kernel's row (of ``arch``, or where None of the first architecture built)
    that serves a dense forward ``problem`` (checks.ForwardProblem) with ``mods``, where it
    is a decode shape (policy.dense_decode, on a GPU of ``sm_count`` SMs; None: on some
    GPU) that the kernel takes; else None: the prefill kernel."""
    keys = problem.seqlen_k
    if mods.local and mods.left >= 0 and mods.right >= 0:  # what a tile's windows cover
        keys = min(keys, mods.left + mods.right + problem.seqlen_q)
    if not policy.dense_decode(problem.batch, problem.seqlen_q, problem.heads_q, problem.heads_kv, keys, sm_count):
        return None
    try:
        problem = served(library.manifest, "decode", problem)
    except UnsupportedVariantError:  # no decode kernel as wide (head_dim 512): the prefill kernel's
        return None
    axes = dict(kind="decode", dtype=problem.dtype, head_dim=problem.head_dim, **mods.axes())
    archs = [arch] if arch else library.manifest.archs
    built = [a for a in archs if library.manifest.built(**axes, arch=a, q_tiles=1)]
    if not built:
        return None
    row = span_row(library.manifest, axes, built[0], problem.sizes, mods, sm_count)
    if problem.seqlen_q > row["limits"]["max_seqlen_q"] or max(problem.batch, problem.heads_kv) > GRID_YZ_MAX:
        return None
    return row


def decode_splits(library: KernelLibrary, problem, mods, arch: str | None, device: int | None, adjacent: bool = True,
                  sm_count: int | None = None) -> int:
    """The decode kernel's splits for a dense forward ``problem`` of a decode shape on GPU
    ``device`` (decode_row; or of ``sm_count`` SMs, any architecture built), else 0: the
    prefill kernel. ``adjacent``: whether k's and v's heads are (decode.heads_adjacent),
    so that the call may read them in pairs (decode.pair_sizes), as prepare_checked does."""
    sm_count = library.sm_count(device) if sm_count is None else sm_count
    row = decode_row(library, problem, mods, arch, sm_count)
    if row is None:
        return 0
    sizes = {**served(library.manifest, "decode", problem).sizes, "max_seqlen_k": problem.seqlen_k}
    paired = pair_sizes(library.manifest, sizes, mods) if adjacent else None
    if paired is not None:
        sizes = paired
        axes = dict(kind="decode", dtype=row["variant"]["dtype"], head_dim=paired["head_dim"], **mods.axes())
        row = span_row(library.manifest, axes, row["variant"]["arch"], sizes, mods, sm_count)
    return splits_for(sizes, row, sm_count, mods)


def forward_workspace_bytes(batch: int, seqlen_q: int, heads_q: int, heads_kv: int, head_dim: int, seqlen_k: int,
                            *, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                            learnable_sink: bool = False, dtype: str = "bf16", sm_count: int | None = None,
                            head_dim_v: int | None = None, library: KernelLibrary | None = None) -> int:
    """Bytes of device memory ``forward`` takes as its ``workspace`` for this problem: 0
    but for decode shapes that the decode kernel splits over the keys (their partial
    results), on a GPU of ``sm_count`` multiprocessors, or where None on any GPU (no GPU
    is asked). ``learnable_sink``: whether the call gives sinks; ``head_dim_v``: v's head
    dim where it is not q's."""
    checks.check_sizes(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       seqlen_k=seqlen_k, **({} if head_dim_v is None else {"head_dim_v": head_dim_v}))
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if sm_count is not None:
        checks.check_sizes(sm_count=sm_count)
    library = library or default_library()
    mods = checks.score_mods(checks.flag("causal", causal), window_size, softcap, bool(learnable_sink))
    problem = checks.ForwardProblem(batch, seqlen_q, seqlen_k, heads_q, heads_kv, max(head_dim, head_dim_v), dtype,
                                    head_dim, head_dim_v)
    row = decode_row(library, problem, mods, None, sm_count)
    if row is None:
        return 0
    # the more of the two the call may take: its heads read one by one, or in pairs (decode.pair_sizes)
    splits = None if sm_count is None else max(decode_splits(library, problem, mods, None, None, adjacent, sm_count)
                                               for adjacent in (False, True))
    if splits == 1:
        return 0
    return forward_kvcache_workspace_bytes(batch, seqlen_q, heads_q, heads_kv, head_dim, seqlen_k,
                                           num_splits=splits, head_dim_v=head_dim_v, library=library)


def backward_workspace_bytes(batch: int, seqlen_q: int, heads_q: int, head_dim: int, *, causal: bool = False,
                             deterministic: bool = False, seqlen_k: int | None = None,
                             heads_kv: int | None = None, dtype: str | None = None, local: bool = False,
                             head_dim_v: int | None = None, library: KernelLibrary | None = None) -> int:
    """Bytes of device memory ``backward`` needs as its ``workspace`` for this problem
    (called with the same ``causal`` and ``deterministic``: the deterministic non-causal
    backward keeps more than one copy of its fp32 dQ accumulator). With ``seqlen_k`` and
    ``heads_kv`` too, the split last wave's partial sums are sized for the problem's key
    tiles (none with GQA); without, for the most the kernels split. Read from the
    manifest's workspace rules (no GPU needed): the most that any built backward of this
    head_dim, causal, deterministic (and ``dtype``, "bf16" or "fp16", where given) needs,
    so enough for whichever the backward picks. ``local``: for a backward with a window or
    sinks (the local kernels: causal or not, they share one layout); ``head_dim_v``: v's
    head dim where it is not q's."""
    checks.check_sizes(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, head_dim=head_dim,
                       **{n: x for n, x in (("seqlen_k", seqlen_k), ("heads_kv", heads_kv)) if x is not None})
    library = library or default_library()
    head_dim = kernel_head_dim(library.manifest, "bwd", head_dim, head_dim_v)
    rows = backward_rows(library.manifest, head_dim, causal, deterministic, dtype, varlen=False, local=local)
    sizes = {"batch": batch, "seqlen_q": seqlen_q, "heads_q": heads_q, "head_dim": head_dim}
    if seqlen_k is not None:
        sizes["seqlen_k"] = seqlen_k
    if heads_kv is not None:
        sizes["heads_kv"] = heads_kv
    return max(ws.total_bytes(r["workspace"], ws.regions(r["workspace"], _workspace_names(r, sizes))) for r in rows)


def _workspace_names(row: dict, sizes: dict) -> dict:
    """The workspace rule's names for a problem: its split tiles bounded by the problem's
    key tiles where seqlen_k and heads_kv are known, else by the rule's most."""
    rule = row["workspace"]
    most = rule["constants"]["tail_max_tiles"]
    tiles = policy.partial_tiles(sizes, row["config"], most) if "seqlen_k" in sizes and "heads_kv" in sizes else most
    return ws.names(rule, {**sizes, "partial_tiles": tiles})


def backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, *, softmax_scale: float | None = None,
             causal: bool = False, deterministic: bool = False, window_size=(-1, -1), softcap: float = 0.0,
             learnable_sink=None, dsink=None, q_tiles: int | None = None, stream: int = 0,
             library: KernelLibrary | None = None) -> None:
    """Gradients dq, dk, dv of ``forward``'s out for the upstream gradient dout.

    q, k, v, out, lse: as given to and produced by ``forward`` (same causal, same scale).
    dout, dq: shaped like q; dk, dv: shaped like k; same dtype and layout rules as forward.
    workspace: contiguous device memory of ``backward_workspace_bytes(..., causal=causal,
    deterministic=deterministic)`` bytes, 256-byte aligned, any contents (the kernels
    clear or overwrite what they read). ``deterministic``: dq is summed in a fixed
    order, so repeated runs are bitwise identical (dk, dv always are). GQA/MQA: dk and
    dv of a shared KV head sum every query head of its group. ``q_tiles``: query tiles
    per step where the variant has both kernels (head_dim 64 causal, not deterministic),
    None picks by seqlen_k (backward_row). ``stream``: as for ``forward``. Asynchronous,
    allocation-free; bad arguments raise as in ``forward``. ``window_size``, ``softcap``,
    ``learnable_sink``: the forward's (a softcap's backward is not built: refused);
    ``dsink``: float32 (heads_q,), where given the sinks' gradient, the sum over every
    row of -exp(sink - lse) rowsum(dout * out), in a fixed order (the same bits every run).
    """
    arrays = (q, k, v, out, dout, lse, dq, dk, dv, workspace, learnable_sink, dsink)
    repeat = repeat_key("bwd", tuple(a for a in arrays if a is not None),
                        (softmax_scale, causal, deterministic, q_tiles, window_size, softcap,
                         learnable_sink is None, dsink is None), stream)
    if repeat is not None and (library or default_library()).launch_again(repeat):
        return
    run_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, softmax_scale, causal, deterministic, q_tiles,
                 stream, library, ((repeat, arrays),) if repeat else (), window_size, softcap, learnable_sink, dsink)


def run_backward(q, k, v, out, dout, lse, dq, dk, dv, workspace, softmax_scale, causal, deterministic, q_tiles,
                 stream, library, aliases=(), window_size=(-1, -1), softcap=0.0, learnable_sink=None,
                 dsink=None) -> None:
    """``backward``; its launches kept under ``aliases`` too (as ``run_forward``)."""
    scale, causal = checks.softmax_scale(softmax_scale), checks.flag("causal", causal)
    deterministic = checks.flag("deterministic", deterministic)
    mods = checks.backward_mods(causal, window_size, softcap, learnable_sink, dsink)
    q_tiles, stream = checks.q_tiles(q_tiles), checks.stream_handle(stream)
    given = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
             "workspace": workspace}
    given.update({n: a for n, a in (("sink", learnable_sink), ("dsink", dsink)) if a is not None})
    arrays, waits = as_device_arrays(given, stream)
    library = library or default_library()
    key = ("bwd", *arrays.values(), causal, mods, scale, deterministic, q_tiles, stream)
    if library.launch_again(key, waits, aliases):  # as in forward
        return
    problem = served(library.manifest, "bwd",
                     check_backward(**{n: a for n, a in arrays.items() if n not in ("workspace", "sink", "dsink")}))
    for name in ("sink", "dsink"):
        if name in arrays:
            checks.check_sink(arrays[name], problem.heads_q, name)
    space = arrays["workspace"]
    checks.check_workspace(space)
    check_no_overlap(written(arrays, *WRITTEN_BACKWARD), read(arrays, *WRITTEN_BACKWARD))
    axes = library.manifest.own_head_dim_v(dict(kind="bwd", dtype=problem.dtype, head_dim=problem.head_dim,
                                                deterministic=deterministic,
                                                **(mods.axes() if mods.local else {"causal": causal})),
                                           problem.columns_v)
    check_built(library.manifest, axes, q_tiles)
    device = device_of(arrays)
    row = backward_row(library.manifest, {**axes, "arch": library.arch(device)}, problem.seqlen_k, q_tiles)
    config, rule = row["config"], row["workspace"]
    sizes = problem.sizes
    names = _workspace_names(row, sizes)
    tensors = ws.carve(rule, names, space.ptr, math.prod(space.shape) * space.itemsize)
    tensors.update(launch_tensors(arrays))
    scale = default_scale(problem.columns) if scale is None else scale
    turn_tiles = policy.deterministic_turn_tiles(causal, problem.head_dim, problem.seqlen_k) if deterministic else 1
    first_write = policy.first_write_dq(deterministic, mods.keys_seen(problem.seqlen_k))
    tail_tiles, tail_pieces = policy.backward_tail_split(sizes, config, rule["constants"]["tail_max_tiles"],
                                                         library.sm_count(device))
    values = {**sizes, "scale": scale, "scale_log2": scale * LOG2E, "turn_tiles": turn_tiles,
              "first_write": int(first_write), "tail_tiles": tail_tiles, "tail_pieces": tail_pieces}
    checks.add_backward_values(mods, values, tensors, names["batch"] * names["m_blocks"], scale, LOG2E)
    library.launch(row, device, stream, values, tensors, key=key, waits=waits, aliases=aliases)
