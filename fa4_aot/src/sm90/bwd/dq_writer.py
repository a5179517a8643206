"""The backward's dQ hand-off (sm_90a): consumer warpgroups stage each query tile's fp32
dQ share in shared memory, and the dQ writer warp adds it into the fp32 accumulator in
global memory, in a fixed order when deterministic: by a 2D TMA reduce-add into the
accumulator's rows, or (``dq_fragment_order``) each thread's fragment stored in register
order and the tile added by one 1D bulk reduce into a fragment-order accumulator
(bwd_rows_sm90.DqFragments).

``DqHandoff`` is a mixin of ``bwd_sm90.FlashBwdSm90``: it reads that class's knobs
(tile_m, tile_n, dq_tile, dq_parts, dq_slots, dq_stages, dq_transposed,
chains, causal, deterministic) and its ``_m_block``. Each step stages ``dq_parts`` tiles
(part p: warpgroup p, or at head_dim 256 warpgroup p // 2's head-dim chunk p % 2) in
``dq_slots`` buffers, taken in turn: b = (step * dq_parts + p) % dq_slots (which is p +
dq_parts * (step % dq_stages) where every part has dq_stages buffers of its own), step
counted over all the CTA's items when it is persistent (``_turn``). Each
buffer has a FULL barrier (staged, for the writer) and an EMPTY one (read by the writer's
reduce, for the buffer's next use).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.experimental.primitives import (CpReduceType, cp_async_bulk_global_shared_cta,
                                             cp_reduce_async_bulk_global_shared_cta)

from .barriers import dq_barriers
from ...common.bwd_order import dq_chain, dq_turn, first_dq_key_tile, semaphore_word
from .pre_post import frag_offset
from ..primitives import WARPGROUP

DQ_WRITER_WARP = 1  # of the producer warpgroup
# Not deterministic (tickets): a query tile's semaphore word counts the CTAs that took
# its ticket (low bits) and gets this bit once the first one's store of the tile is complete.
FIRST_STORED = 1 << 24


class DqHandoff:
    """Consumer side (``_stage_dq``, ``_claim_dq``, ``_hand_dq``) and writer warp
    (``dq_writer``) of the dQ staging buffers."""

    @cute.jit
    def _stage_dq(self, part, step, acc_dq, dq_copy, thr_dq_copy, tdQ_smem):
        """Hand dQ part ``part`` of ``step`` to the writer warp in its staging buffer
        (``tdQ_smem``: this thread's view of every buffer)."""
        buffer = self._claim_dq(part, step)
        if const_expr(self.dq_fragment_order):
            # register order, 16 bytes a store: (4 values, chunk) onto (4, chunk) of the buffer
            values = cute.make_tensor(acc_dq.iterator, cute.make_layout((4, cute.size(acc_dq) // 4)))
            cute.autovec_copy(values, tdQ_smem[None, None, buffer])
        else:
            cute.copy(dq_copy, thr_dq_copy.retile(acc_dq), tdQ_smem[None, None, None, buffer])
        self._hand_dq(buffer)

    @cute.jit
    def _claim_dq(self, part, step):
        """The staging buffer of dQ part ``part`` of ``step``, once the writer's reduce of
        the buffer's previous tile has read it."""
        buffer = self._dq_buffer(part, step)
        if const_expr(self._dq_own_buffers()):
            if step >= self.dq_stages:
                cute.arch.barrier(barrier_id=self._dq_empty_barrier() + buffer, number_of_threads=WARPGROUP + 32)
        else:
            if step * self.dq_parts + part >= self.dq_slots:
                cute.arch.barrier(barrier_id=self._dq_empty_barrier() + buffer, number_of_threads=WARPGROUP + 32)
        return buffer

    def _hand_dq(self, buffer):
        """The staged buffer (written by this warpgroup) to the writer warp."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=self._dq_full_barrier() + buffer, number_of_threads=WARPGROUP + 32)

    @cute.jit
    def _turn(self, done, step):
        """The CTA's count of ``step`` over all its items (persistent; else the item's
        own step), by which the double-buffered dS and the dQ staging buffers are taken
        in turn."""
        if const_expr(self.persistent):
            return done + step
        return step

    @cute.jit
    def _return_dq(self, count):
        """The writer: step ``count``'s buffers read, free for their next use."""
        for part in cutlass.range_constexpr(self.dq_parts):
            cute.arch.barrier_arrive(barrier_id=self._dq_empty_barrier() + self._dq_buffer(part, count),
                                     number_of_threads=WARPGROUP + 32)

    @cute.jit
    def _drain_dq(self, part, total):
        """Persistent: wait for the writer's reads of the last dq_stages steps' buffers of
        ``part`` (``total``: the CTA's steps), so that every EMPTY arrive has its wait."""
        for back in cutlass.range_constexpr(self.dq_stages):
            turn = total - self.dq_stages + back
            if turn >= 0:
                cute.arch.barrier(barrier_id=self._dq_empty_barrier() + self._dq_buffer(part, turn),
                                  number_of_threads=WARPGROUP + 32)

    def _dq_full_barrier(self):
        return dq_barriers(self.dq_slots, self.stagger)[0]

    def _dq_empty_barrier(self):
        return dq_barriers(self.dq_slots, self.stagger)[1]

    def _dq_own_buffers(self):
        """Every part has dq_stages buffers of its own (else the parts share them in turn):
        the writer then returns a step's buffers together, after all its reduces."""
        return self.dq_slots == self.dq_parts * self.dq_stages

    def _dq_buffer(self, part, step):
        """The staging buffer of dQ part ``part`` at ``step``: (step * dq_parts + part) %
        dq_slots, written without the modulo where every part has buffers of its own (at
        head_dim 192, one stage, it is the part itself; the general form there measured 24
        to 64 more instructions at compile, session 12)."""
        if const_expr(self._dq_own_buffers()):
            return part + self.dq_parts * (step % self.dq_stages)
        return (step * self.dq_parts + part) % self.dq_slots

    def _dq_at(self, part, m_block):
        """Where part ``part`` of query tile m_block lies in the accumulator, in dq_tile units."""
        if const_expr(self.dq_kt_in_registers):
            return (2 * m_block + part, 0)  # query rows [32 part, 32 part + 32) of the tile
        return (m_block, part)  # head-dim columns [part c, (part + 1) c), c = dq_tile[1]

    @cute.jit
    def _take_ticket(self, sem_ptr, batch, heads_q, m_blocks, head_q, m_block, lane):
        """Not deterministic, lane 0: add this CTA to query tile m_block's count and return
        the word before the add (count 0: the first, who stores; FIRST_STORED: the first's
        store is complete). Relaxed: taken a step ahead, its latency hides behind the
        current step (an acquire would hold the step's reduce behind it)."""
        ticket = Int32(0)
        if lane == 0:
            word = sem_ptr + semaphore_word(batch, heads_q, head_q, m_blocks, m_block)
            ticket = cute.arch.atomic_add(word, Int32(1), sem="relaxed", scope="gpu")
        return ticket

    @cute.jit
    def dq_writer(self, tidx, sdQ, tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr, group, seqlen_q,
                  seqlen_k, heads_q, turn_tiles, first_write, n_block, head_kv, batch, m_first, span, steps, done,
                  tail):
        """One item of the CTA (``done``: its steps before this one; persistent CTAs take
        the staging buffers in turn over all their steps; ``tail``: bwd_tail's, or None).
        Add each staged dQ tile into the fp32 accumulator by a bulk reduce-add, off the
        consumers' critical path: they only wait for the buffer to be read.

        Deterministic: the key tiles touching a run of ``turn_tiles`` consecutive query
        tiles add into it in a fixed order, one turn per CTA per run, counted by a
        per-(batch, head, run, copy) semaphore. Non-causal: key tile n adds into
        accumulator copy n % chains, in ascending n within the copy (the postprocess sums
        the copies in order), so each turn passes through half the CTAs. Causal: shortest
        processing time first: the CTAs are launched highest key tile first, and a run's
        turns go from the highest key tile touching it downward, so a CTA only ever waits
        for CTAs launched before it. A turn is held over the run's reduces and ends once
        they are complete, so its latency (the reduces' completion, the release, the next
        CTA's poll) is paid once per run; holding it longer delays the CTAs behind. Each
        query tile's order of key tiles is the same for every ``turn_tiles``, and so are
        the results' bits.

        ``first_write`` (a run-time flag; see fa4_aot.api): the accumulator is not cleared
        beforehand, and each tile's first share is stored. Deterministic, that is the
        first turn at the tile in its copy (bwd_order.first_dq_key_tile). Not
        deterministic (``tickets``), each CTA takes a ticket of the query tile
        (an atomic add on its semaphore word) one step ahead; the first CTA of a tile
        stores its share (a bulk store, not a reduce), waits for the store to complete
        and marks the word FIRST_STORED (release); the others add theirs once the mark is
        there: seen in their ticket, or polled (acquire). A CTA only waits for a ticket
        taken before its own, and a ticket's holder stores and marks without waiting for
        any other CTA, so the waits cannot form a cycle, whichever CTAs are resident.
        """
        lane = tidx % 32
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        # first_write off at run time: every ticket reads "not first, stored" (plain reduces
        # into the cleared accumulator)
        ticket_next = Int32(FIRST_STORED + 1)
        if const_expr(self.tickets):
            if first_write != 0 and steps > 0:
                ticket_next = self._take_ticket(sem_ptr, batch, heads_q, m_blocks, head_kv * group,
                                                self._m_block(0, m_first, span, m_blocks), lane)
        for step in cutlass.range(steps, unroll=1):
            head_q = head_kv * group + step // span
            m_block = self._m_block(step, m_first, span, m_blocks)
            word_at = semaphore_word(batch, heads_q, head_q, m_blocks, m_block)  # its ticket word (tickets)
            first = cutlass.Boolean(False)
            ticket = Int32(0)
            if const_expr(self.tickets):
                ticket = cute.arch.shuffle_sync(ticket_next, 0)
                if first_write != 0 and step + 1 < steps:
                    ticket_next = self._take_ticket(sem_ptr, batch, heads_q, m_blocks,
                                                    head_kv * group + (step + 1) // span,
                                                    self._m_block(step + 1, m_first, span, m_blocks), lane)
                first = ticket == 0
            chain = 0
            if const_expr(self.deterministic):
                run = m_block // turn_tiles
                chain = dq_chain(n_block, self.chains)
                sem = sem_ptr + semaphore_word(batch, heads_q, head_q, m_blocks, run, self.chains, chain)
                if first_write != 0:
                    # the first turn at this tile (in this copy) stores; this turn's release
                    # waits for its completion, as for the adds
                    first = n_block == first_dq_key_tile(m_block, chain, n_blocks, seqlen_q, seqlen_k,
                                                         self.tile_m, self.tile_n, self.causal)
                # this CTA's last tile of the run: the run's last, or the head's
                run_ends = m_block % turn_tiles == turn_tiles - 1 or m_block == m_blocks - 1
                if m_block % turn_tiles == 0 or step % span == 0:  # this CTA's first tile of the run
                    turn = dq_turn(n_block, run, turn_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k,
                                   self.tile_m, self.tile_n, self.causal, self.chains)
                    if lane == 0:
                        # a plain acquire load: polling CTAs do not queue on the L2 atomic unit
                        while cute.arch.load(sem.llvm_ptr, Int32, sem="acquire", scope="gpu") != turn:
                            pass
                    cute.arch.sync_warp()
            # The turn is taken before the staged tile is waited for: waiting for the tile
            # first put the turn's poll on every step's critical path (measured slower).
            count = self._turn(done, step)  # of the CTA's steps: the buffers' turn
            for part in cutlass.range_constexpr(self.dq_parts):
                buffer = self._dq_buffer(part, count)
                cute.arch.barrier(barrier_id=self._dq_full_barrier() + buffer, number_of_threads=WARPGROUP + 32)
                if const_expr(self.tickets and part == 0):
                    if ticket != 0 and (ticket & FIRST_STORED) == 0:
                        # the first's store was not marked when the ticket was taken
                        if lane == 0:
                            while (cute.arch.load((sem_ptr + word_at).llvm_ptr, Int32, sem="acquire", scope="gpu")
                                   & FIRST_STORED) == 0:
                                pass
                        cute.arch.sync_warp()
                if const_expr(self.dq_fragment_order):
                    part_elems = self.dq_tile[0] * self.dq_tile[1]
                    at = frag_offset(batch, chain, head_q, m_block, heads_q, m_blocks, self.chains,
                                     self.tile_m * self.head_dim) + part * part_elems
                    if lane == 0:
                        if first:
                            dst = cute.make_ptr(Float32, dqacc_ptr.toint() + at * 4, cute.AddressSpace.gmem,
                                                assumed_align=16)
                            cp_async_bulk_global_shared_cta(dst, sdQ[None, None, None, buffer].iterator,
                                                            part_elems * 4)
                        else:
                            cp_reduce_async_bulk_global_shared_cta(dqacc_ptr.toint() + at * 4,
                                                                   sdQ[None, None, None, buffer].iterator,
                                                                   part_elems * 4, type=CpReduceType.F32)
                else:
                    tile = cute.local_tile(gdQacc[None, None, head_q, batch * self.chains + chain], self.dq_tile,
                                           self._dq_at(part, m_block))
                    staged = cute.group_modes(sdQ[None, None, buffer], 0, 2)
                    if first:
                        part_s, part_g = cpasync.tma_partition(
                            tma_dq_store, 0, cute.make_layout(1), staged, cute.group_modes(tile, 0, 2))
                        cute.copy(tma_dq_store, part_s, part_g)
                    else:
                        part_s, part_g = cpasync.tma_partition(
                            tma_dq, 0, cute.make_layout(1), staged, cute.group_modes(tile, 0, 2))
                        cute.copy(tma_dq, part_s, part_g)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self._dq_own_buffers()):
                    # shared buffers: a later part of this very step may be waiting for this one
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    if step * self.dq_parts + part + self.dq_slots < steps * self.dq_parts:  # a later use waits
                        cute.arch.barrier_arrive(barrier_id=self._dq_empty_barrier() + buffer,
                                                 number_of_threads=WARPGROUP + 32)
            if const_expr(self._dq_own_buffers()):
                # The staging buffers go back as soon as the reduces have read them, a step's
                # together after one wait, once its last tile's reduce is issued (the wide
                # kernel hands over two tiles a step, one buffer per warpgroup); a turn
                # ends only once its run's reduces are complete (deterministic: measured
                # faster than returning the buffers after completion, with two-tile runs;
                # docs/perf-notes.md).
                tiles = self.step_tiles
                if step % tiles == tiles - 1 or step + 1 == steps:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    for back in cutlass.range_constexpr(tiles):
                        # the step's tiles, back from this one (a lone last tile has one)
                        if step % tiles >= back:
                            # waited for by a later step's staging, or (persistent: later
                            # items are not known here) by the consumers' drain after their
                            # last item
                            if const_expr(self.persistent):
                                self._return_dq(count - back)
                            else:
                                if step - back + self.dq_stages < steps:
                                    self._return_dq(count - back)
            if const_expr(self.tickets):
                if first:
                    # the buffers are back with the consumers. Marked at once: marking it
                    # a step later (at the next tile's FULL, so the writer does not wait
                    # for the store) gained 0-3% less up to 4k keys: the CTA two steps
                    # behind then finds the mark missing more often and polls
                    # (docs/perf-notes.md, session 14).
                    self._mark_stored(sem_ptr + word_at, lane)
            if const_expr(self.deterministic):
                if run_ends:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.sync_warp()
                    if lane == 0:
                        # release: the reduces, complete (seen by this thread), before the turn
                        cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
        # this key tile's adds are complete: count it in each query head it added into, for
        # the postprocess (bwd_rows_sm90), which converts a head once all are counted
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()
        self._count_dq_done(done_ptr, batch, heads_q, head_kv, group, lane, tail)

    @cute.jit
    def _mark_stored(self, word, lane):
        """tickets: mark a tile's first share stored, once the store is complete (seen
        by the lane that issued it; the warp's sync passes that on to lane 0, whose release
        add publishes it): the other CTAs add into the tile after this."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.atomic_add(word, Int32(FIRST_STORED), sem="release", scope="gpu")
