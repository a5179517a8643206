"""Heaviest-first (longest-processing-time) order of packed sequences: one CTA sorts the
sequences by their estimated cost, heaviest first, and writes the permutation that the
varlen kernels' walk (``seqlen.packed_tile`` with ``order``) takes the sequences in.

A sequence's cost is the (query tile, key tile) pairs its CTAs visit plus one per CTA (its
prologue and epilogue), causal-aware (bottom-right aligned, as the masks): the forward's
CTAs are its query tiles, the backward's (``keys_outer``) its key tiles. The CTAs of the
heaviest sequence start first, the short ones fill the last wave. Sorted by a bitonic sort
of 64-bit keys (cost, then the caller's index: ties keep the caller's order) in shared
memory, up to ``MAX_BATCH`` sequences; past that the kernel writes the caller's order
(the run time, which reads the bound from the manifest row's ``limits``, does not launch
it then).

Lengths are clamped as ``seqlen.sequence`` clamps them, so lying metadata gives a
permutation of [0, batch) all the same (docs/design.md, "Variable length").
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .seqlen import sequence

MAX_BATCH = 8192  # a power of two: the sort's width (its keys fill 64 KB of shared memory)
INDEX_BITS = MAX_BATCH.bit_length() - 1
THREADS = 1024
SMEM_BYTES = MAX_BATCH * 8 + 128  # the keys, + alignment slack
COST_MAX = (1 << (62 - INDEX_BITS)) - 1  # a key stays a positive Int64
assert MAX_BATCH == 1 << INDEX_BITS and MAX_BATCH % THREADS == 0


class Lengths(NamedTuple):
    """Where the sequences' lengths are: (cu_seqlens, seqused, use_seqused, total) of the
    queries and of the keys."""

    cu_q: object
    used_q: object
    use_used_q: object
    total_q: object
    cu_k: object
    used_k: object
    use_used_k: object
    total_k: object


@cute.jit
def sequence_cost(batch, lengths: Lengths, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                  causal: cutlass.Constexpr[bool], keys_outer: cutlass.Constexpr[bool] = False):
    """Int64 cost of sequence ``batch``: the tile pairs its CTAs visit plus its CTAs. The
    forward's CTAs are query tiles (causal: query tile i of tq sees min(tk, i + 1 + tk - tq)
    key tiles, tile-rounded); ``keys_outer`` (the backward) key tiles, key tile n visiting
    query tiles from max(n tile_n - (len_k - len_q), 0) // tile_m on (bwd_order.first_query_tile)."""
    len_q = sequence(batch, lengths.cu_q, lengths.used_q, lengths.use_used_q, lengths.total_q).length
    len_k = sequence(batch, lengths.cu_k, lengths.used_k, lengths.use_used_k, lengths.total_k).length
    tq = Int64(cute.ceil_div(len_q, tile_m))
    tk = Int64(cute.ceil_div(len_k, tile_n))
    visits, ctas = tq * tk, tq
    if cutlass.const_expr(keys_outer):
        ctas = tk
        if cutlass.const_expr(causal):
            visits = cutlass.max(visits - _skipped_query_tiles(Int64(len_q), Int64(len_k), tk, tile_m, tile_n),
                                 Int64(0))
    elif cutlass.const_expr(causal):
        visits = cutlass.select_(tq <= tk, tq * (tk - tq) + tq * (tq + 1) // 2, tk * (tk + 1) // 2)
    return cutlass.min(visits + ctas, Int64(COST_MAX))


@cute.jit
def _skipped_query_tiles(len_q, len_k, tk, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int]):
    """Causal, key tiles outer: the query tiles the key tiles skip, the sum over n of
    max(n tile_n - shift, 0) // tile_m (shift = len_k - len_q), summed without the floors
    (at most one tile too many per key tile). The first ``full`` key tiles (n tile_n <= shift)
    skip none; the others, from ``first`` rows past the diagonal, tile_n rows more each."""
    shift = len_k - len_q
    full = cutlass.select_(shift >= 0, cutlass.min(shift // tile_n + 1, tk), Int64(0))
    rest = tk - full
    first = full * tile_n - shift
    return (rest * first + tile_n * (rest * (rest - 1) // 2)) // tile_m


@cute.jit
def lpt_order(lengths: Lengths, batches, order: cute.Tensor, keys: cute.Tensor, tile_m: cutlass.Constexpr[int],
              tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool],
              keys_outer: cutlass.Constexpr[bool] = False):
    """order[r] (r < batches): the sequence of rank r, heaviest first (costs: ``sequence_cost``).
    ``keys``: (MAX_BATCH,) Int64 in shared memory; the CTA's THREADS threads take part."""
    tidx, _, _ = cute.arch.thread_idx()
    if batches > MAX_BATCH:
        for r in cutlass.range(tidx, batches, THREADS, unroll=1):
            order[r] = r
    else:
        width = Int32(2)
        while width < batches:
            width = width * 2
        for i in cutlass.range(tidx, width, THREADS, unroll=1):
            key = Int64(-1)  # padding sorts last
            if i < batches:
                cost = sequence_cost(i, lengths, tile_m, tile_n, causal, keys_outer)
                key = (cost << INDEX_BITS) | Int64(MAX_BATCH - 1 - i)
            keys[i] = key
        cute.arch.sync_threads()
        # bitonic sort, descending: blocks of `size` alternate direction until the last
        size = Int32(2)
        while size <= width:
            stride = size // 2
            while stride > 0:
                for i in cutlass.range(tidx, width, THREADS, unroll=1):
                    partner = i ^ stride
                    if partner > i:
                        a, b = keys[i], keys[partner]
                        high, low = cutlass.max(a, b), cutlass.min(a, b)
                        descending = (i & size) == 0
                        keys[i] = cutlass.select_(descending, high, low)
                        keys[partner] = cutlass.select_(descending, low, high)
                cute.arch.sync_threads()
                stride = stride // 2
            size = size * 2
        for r in cutlass.range(tidx, batches, THREADS, unroll=1):
            order[r] = Int32(MAX_BATCH - 1) - Int32(keys[r] & Int64(MAX_BATCH - 1))


@cute.jit
def sort_sequences(p, tile_m: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int],
                   causal: cutlass.Constexpr[bool], keys_outer: cutlass.Constexpr[bool] = False):
    """The body of a varlen sort kernel (one CTA of THREADS threads, SMEM_BYTES of dynamic
    shared memory): ``p``, the sort's declared arguments (interfaces.lpt_params: the
    sequences' metadata in, p.order's (b,) int32 out, heaviest first)."""
    batches = p.batch
    cu = lambda ptr: cute.make_tensor(ptr, cute.make_layout(batches + 1))  # noqa: E731
    used = lambda ptr: cute.make_tensor(ptr, cute.make_layout(batches))  # noqa: E731
    lengths = Lengths(cu(p.cu_seqlens_q), used(p.seqused_q), p.use_seqused_q, p.total_q,
                      cu(p.cu_seqlens_k), used(p.seqused_k), p.use_seqused_k, p.total_k)
    keys = cutlass.utils.SmemAllocator().allocate_tensor(Int64, cute.make_layout(MAX_BATCH), byte_alignment=16)
    lpt_order(lengths, batches, cute.make_tensor(p.order, cute.make_layout(batches)), keys, tile_m, tile_n,
              causal, keys_outer)


def workspace_rule() -> dict:
    """The varlen forward's workspace (fa4_aot.launch.workspace's rule form): the order, batch
    int32, in 256-byte units."""
    return {"align": 4, "constants": {}, "regions": [
        {"name": "order", "itemsize": 4, "count": [["mul", ["ceil_div", "batch", 64], 64]]}]}
