"""The backward's split last wave (sm_90a; variants.tail_split): the key tiles of the last
partial wave are each computed by ``pieces`` CTAs, one per range of query tiles
(bwd_order.tail_item, piece_tiles), whose dK, dV partial sums meet in fp32 in the
workspace. ``TailPieces`` is a mixin of ``bwd_sm90.FlashBwdSm90`` (its ``_store_dkv``).

A split tile t has TAIL_COUNTERS int32 words, cleared by the preprocess:
    0 ticket: pieces done computing, in the order they got here
    1 stored: set once the first piece's partials are stored
    2 summed: pieces whose partials are in the sums
    3 dq: pieces whose dQ adds are complete (the last one counts the tile in dq_done)
and 2 * n * 256 floats of partial sums, (dK | dV, fragment value i, consumer thread): a
thread's n accumulator values, coalesced across threads. The first piece to finish stores
its partials (no clearing), the others add theirs (fp32 atomics, in L2) once the store is
seen; the piece that completes the sum reads it back into its accumulators and writes dK
and dV as an unsplit CTA does. Every wait is for a piece that got its ticket earlier and
so is resident: no cycle, whatever runs.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ....variants import TAIL_COUNTERS
from .barriers import EPILOGUE_BARRIER
from ..primitives import WARPGROUP

TICKET, STORED, SUMMED, DQ_DONE = range(TAIL_COUNTERS)


class TailPieces:
    """Consumer side (``_finish_dkv``) and the dQ writer's count (``_count_dq_done``)."""

    @cute.jit
    def _finish_dkv(self, tidx, acc_dk, acc_dv, mma_dkv, sdK, sdV, tma_dk, gdK, tma_dv, gdV, n_block, scale,
                    s_word, tail):
        """dK and dV of this CTA's key tile (``_store_dkv``); a piece (``tail``: (split tile
        or -1, counters, partials, pieces), None where the variant does not split) adds its
        partials to the tile's sums, and only the one that completes them writes.
        ``s_word``: two fp32 words of shared memory free after the loop (for broadcasts)."""
        last = cutlass.Boolean(True)
        if const_expr(tail is not None):
            t, counters, partial, pieces = tail
            if t >= 0:
                last = self._sum_pieces(tidx, acc_dk, acc_dv, counters + t * TAIL_COUNTERS,
                                        partial + t * 2 * cute.size(acc_dk) * 2 * WARPGROUP, pieces, s_word)
        if last:
            self._store_dkv(tidx, acc_dk, acc_dv, mma_dkv, sdK, sdV, tma_dk, gdK, tma_dv, gdV, n_block, scale)

    @cute.jit
    def _sum_pieces(self, tidx, acc_dk, acc_dv, words, sums, pieces, s_word):
        """Add this piece's accumulators (0..255: tidx) into the tile's sums; True for the
        piece that completes them, its accumulators then holding the sums."""
        threads = 2 * WARPGROUP
        n = cute.size(acc_dk)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)  # s_word is free
        if tidx == 0:
            cute.arch.griddepcontrol_wait()  # the counters, cleared by the preprocess
            ticket = cute.arch.atomic_add((words + TICKET).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
            if ticket != 0:
                while cute.arch.load((words + STORED).llvm_ptr, Int32, sem="acquire", scope="gpu") == 0:
                    pass
            s_word[0] = Float32(ticket)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
        first = s_word[0] == Float32(0.0)
        if first:
            for i in cutlass.range_constexpr(n):
                cute.arch.store((sums + i * threads + tidx).llvm_ptr, acc_dk[i])
                cute.arch.store((sums + (n + i) * threads + tidx).llvm_ptr, acc_dv[i])
        else:
            for i in cutlass.range_constexpr(n):
                cute.arch.atomic_add((sums + i * threads + tidx).llvm_ptr, acc_dk[i], sem="relaxed", scope="gpu")
                cute.arch.atomic_add((sums + (n + i) * threads + tidx).llvm_ptr, acc_dv[i], sem="relaxed",
                                     scope="gpu")
        # every thread's stores or adds, then one release for the CTA (after the barrier)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
        if tidx == 0:
            if first:
                cute.arch.atomic_add((words + STORED).llvm_ptr, Int32(1), sem="release", scope="gpu")
            summed = cute.arch.atomic_add((words + SUMMED).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
            s_word[1] = Float32(summed)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
        last = s_word[1] == Float32(pieces - 1)
        if last:
            for i in cutlass.range_constexpr(n):
                acc_dk[i] = cute.arch.load((sums + i * threads + tidx).llvm_ptr, Float32, sem="relaxed", scope="gpu")
                acc_dv[i] = cute.arch.load((sums + (n + i) * threads + tidx).llvm_ptr, Float32, sem="relaxed",
                                           scope="gpu")
        return last

    @cute.jit
    def _count_dq_done(self, done_ptr, batch, heads_q, head_kv, group, lane, tail):
        """Lane 0 of the dQ writer, its adds complete: count the key tile in each query head
        of its group (release), for the postprocess; a piece only once every piece of its
        tile has (the last to get here, acquiring the others' counts)."""
        if lane == 0:
            count = cutlass.Boolean(True)
            if const_expr(tail is not None):
                t, counters, _, pieces = tail
                if t >= 0:
                    done = cute.arch.atomic_add((counters + t * TAIL_COUNTERS + DQ_DONE).llvm_ptr, Int32(1),
                                                sem="acq_rel", scope="gpu")
                    count = done == pieces - 1
            if count:
                for g in cutlass.range(group, unroll=1):
                    cute.arch.atomic_add(done_ptr + batch * heads_q + head_kv * group + g, Int32(1),
                                         sem="release", scope="gpu")
