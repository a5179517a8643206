"""Heaviest-first (longest-processing-time) order of packed sequences: one CTA sorts the
sequences by their estimated cost, heaviest first, and writes the permutation that the
varlen kernels' walk (``seqlen.packed_tile`` with ``order``) takes the sequences in.

A sequence's cost is the key tiles its query tiles visit plus one per query tile (the
prologue and epilogue), causal-aware (bottom-right aligned, as the masks): the CTAs of the
heaviest sequence start first, the short ones fill the last wave. Sorted by a bitonic sort
of 64-bit keys (cost, then the caller's index: ties keep the caller's order) in shared
memory, up to ``MAX_BATCH`` sequences; past that the kernel writes the caller's order
(the run time does not launch it then: fa4_aot.policy.LPT_MAX_BATCH).

Lengths are clamped as ``seqlen.sequence`` clamps them, so lying metadata gives a
permutation of [0, batch) all the same (docs/design.md, "Variable length").
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ...policy import LPT_MAX_BATCH
from .seqlen import sequence

MAX_BATCH = LPT_MAX_BATCH  # a power of two: the sort's width
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
                  causal: cutlass.Constexpr[bool]):
    """Int64 cost of sequence ``batch``: its query tiles plus the key tiles they visit
    (causal: query tile i of tq sees min(tk, i + 1 + tk - tq) key tiles, tile-rounded)."""
    len_q = sequence(batch, lengths.cu_q, lengths.used_q, lengths.use_used_q, lengths.total_q).length
    len_k = sequence(batch, lengths.cu_k, lengths.used_k, lengths.use_used_k, lengths.total_k).length
    tq = Int64(cute.ceil_div(len_q, tile_m))
    tk = Int64(cute.ceil_div(len_k, tile_n))
    visits = tq * tk
    if cutlass.const_expr(causal):
        visits = cutlass.select_(tq <= tk, tq * (tk - tq) + tq * (tq + 1) // 2, tk * (tk + 1) // 2)
    return cutlass.min(visits + tq, Int64(COST_MAX))


@cute.jit
def heaviest_first(lengths: Lengths, batches, order: cute.Tensor, keys: cute.Tensor, tile_m: cutlass.Constexpr[int],
                   tile_n: cutlass.Constexpr[int], causal: cutlass.Constexpr[bool]):
    """order[r] (r < batches): the sequence of rank r, heaviest first. ``keys``: (MAX_BATCH,)
    Int64 in shared memory; the CTA's THREADS threads take part."""
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
                key = (sequence_cost(i, lengths, tile_m, tile_n, causal) << INDEX_BITS) | Int64(MAX_BATCH - 1 - i)
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
