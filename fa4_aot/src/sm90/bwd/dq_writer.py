"""The backward's dQ hand-off (sm_90a): consumer warpgroups stage each query tile's fp32
dQ share in shared memory, and the dQ writer warp adds it into the fp32 accumulator in
global memory, in a fixed order when deterministic: by a 2D TMA reduce-add into the
accumulator's rows, or (``dq_fragment_order``) each thread's fragment stored in register
order and the tile added by one 1D bulk reduce into a fragment-order accumulator
(pre_post.DqFragments). docs/design.md, "Backward: dQ hand-off and writer warp".

``DqBuffers``: each step stages ``dq_parts`` tiles (part p: warpgroup p, or at head_dim
256 warpgroup p // 2's head-dim chunk p % 2) in ``dq_slots`` buffers, taken in turn: b =
(step * dq_parts + p) % dq_slots (which is p + dq_parts * (step % dq_stages) where every
part has dq_stages buffers of its own), step counted over all the CTA's items when it is
persistent (``TileWalk.turn``). Each buffer has a FULL barrier (staged, for the writer)
and an EMPTY one (read by the writer's reduce, for the buffer's next use).
``DqWriter``: the writer warp's loop over an item's steps.
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


class DqBuffers:
    """The staging buffers' protocol, both sides: a consumer warpgroup ``stage``s a part
    (claiming its buffer once the writer has read it, then handing it over); the writer
    waits for a buffer's FULL, reduces it, and gives it back (EMPTY)."""

    def __init__(self, cfg):
        self.cfg = cfg


    @cute.jit
    def stage(self, part, step, acc_dq, dq_copy, thr_dq_copy, tdQ_smem):
        """Hand dQ part ``part`` of ``step`` to the writer warp in its staging buffer
        (``tdQ_smem``: this thread's view of every buffer)."""
        buffer = self.claim(part, step)
        if const_expr(self.cfg.dq_fragment_order):
            # register order, 16 bytes a store: (4 values, chunk) onto (4, chunk) of the buffer
            values = cute.make_tensor(acc_dq.iterator, cute.make_layout((4, cute.size(acc_dq) // 4)))
            cute.autovec_copy(values, tdQ_smem[None, None, buffer])
        else:
            cute.copy(dq_copy, thr_dq_copy.retile(acc_dq), tdQ_smem[None, None, None, buffer])
        self.hand(buffer)

    @cute.jit
    def claim(self, part, step):
        """The staging buffer of dQ part ``part`` of ``step``, once the writer's reduce of
        the buffer's previous tile has read it."""
        buffer = self.buffer(part, step)
        if const_expr(self.own_buffers()):
            if step >= self.cfg.dq_stages:
                cute.arch.barrier(barrier_id=self.empty_barrier() + buffer, number_of_threads=WARPGROUP + 32)
        else:
            if step * self.cfg.dq_parts + part >= self.cfg.dq_slots:
                cute.arch.barrier(barrier_id=self.empty_barrier() + buffer, number_of_threads=WARPGROUP + 32)
        return buffer

    def hand(self, buffer):
        """The staged buffer (written by this warpgroup) to the writer warp."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=self.full_barrier() + buffer, number_of_threads=WARPGROUP + 32)

    @cute.jit
    def give_back(self, count):
        """The writer: step ``count``'s buffers read, free for their next use."""
        for part in cutlass.range_constexpr(self.cfg.dq_parts):
            cute.arch.barrier_arrive(barrier_id=self.empty_barrier() + self.buffer(part, count),
                                     number_of_threads=WARPGROUP + 32)

    @cute.jit
    def drain(self, part, total):
        """Persistent: wait for the writer's reads of the last dq_stages steps' buffers of
        ``part`` (``total``: the CTA's steps), so that every EMPTY arrive has its wait."""
        for back in cutlass.range_constexpr(self.cfg.dq_stages):
            turn = total - self.cfg.dq_stages + back
            if turn >= 0:
                cute.arch.barrier(barrier_id=self.empty_barrier() + self.buffer(part, turn),
                                  number_of_threads=WARPGROUP + 32)

    def full_barrier(self):
        return dq_barriers(self.cfg.dq_slots, self.cfg.stagger)[0]

    def empty_barrier(self):
        return dq_barriers(self.cfg.dq_slots, self.cfg.stagger)[1]

    def own_buffers(self):
        """Every part has dq_stages buffers of its own (else the parts share them in turn):
        the writer then returns a step's buffers together, after all its reduces."""
        return self.cfg.dq_slots == self.cfg.dq_parts * self.cfg.dq_stages

    def buffer(self, part, step):
        """The staging buffer of dQ part ``part`` at ``step``: (step * dq_parts + part) %
        dq_slots, written without the modulo where every part has buffers of its own (at
        head_dim 192, one stage, it is the part itself; the general form there measured 24
        to 64 more instructions at compile)."""
        if const_expr(self.own_buffers()):
            return part + self.cfg.dq_parts * (step % self.cfg.dq_stages)
        return (step * self.cfg.dq_parts + part) % self.cfg.dq_slots


class DqWriter:
    """The dQ writer warp (warp DQ_WRITER_WARP of the producer warpgroup)."""

    def __init__(self, cfg, walk, buffers, tail):
        self.cfg = cfg
        self.walk = walk
        self.dq = buffers
        self.tail = tail

    def place(self, part, m_block):
        """Where part ``part`` of query tile m_block lies in the accumulator, in dq_tile units."""
        if const_expr(self.cfg.dq_kt_in_registers):
            return (2 * m_block + part, 0)  # query rows [32 part, 32 part + 32) of the tile
        return (m_block, part)  # head-dim columns [part c, (part + 1) c), c = dq_tile[1]

    @cute.jit
    def take_ticket(self, sem_ptr, prob, batch, heads_q, m_blocks, head_q, m_block, lane):
        """Not deterministic, lane 0: add this CTA to query tile m_block's count and return
        the word before the add (count 0: the first, who stores; FIRST_STORED: the first's
        store is complete). Relaxed: taken a step ahead, its latency hides behind the
        current step (an acquire would hold the step's reduce behind it)."""
        ticket = Int32(0)
        if lane == 0:
            ws_batch, ws_tiles, ws_m = self.walk.ws_tile(prob, batch, m_blocks, m_block)
            word = sem_ptr + semaphore_word(ws_batch, heads_q, head_q, ws_tiles, ws_m)
            ticket = cute.arch.atomic_add(word, Int32(1), sem="relaxed", scope="gpu")
        return ticket

    @cute.jit
    def run(self, tidx, sdQ, target, prob, scalars, work):
        """The writer's items (``work``: the scheduler's CtaWork), once the preprocess's
        semaphores, counters (and accumulator) are cleared; only then may the postprocess
        be placed (see kernel.FlashBwdSm90.kernel). Varlen, the CTA then counts itself
        ended (``count_ended``)."""
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.cfg.persistent):
            done = Int32(0)  # the CTA's steps before this item
            for index in cutlass.range(work.first, work.items, work.stride, unroll=1):
                item = self.walk.item(index, prob)
                self.add_item(tidx, sdQ, target, prob, scalars, item, done, None)
                done = done + item.steps
        else:
            self.add_item(tidx, sdQ, target, prob, scalars, work.item, 0, work.tail)
        if const_expr(self.cfg.varlen):
            self.count_ended(target.ended_ptr, tidx % 32)

    @cute.jit
    def count_ended(self, ended_ptr, lane):
        """Varlen, lane 0 once the CTA's dQ adds are complete and counted (``add_item``'s
        end): one more CTA of the grid ended (release, after the dq_done counts). Lying
        metadata can give sequences more key tiles than the grid walks, so a postprocess
        block waits for its head's count or for every CTA here to have ended
        (pre_post.PrePostSm90._wait_for_keys); honest, the two come together."""
        if lane == 0:
            cute.arch.red(ended_ptr.llvm_ptr, cutlass.Uint64(1), op="add", dtype="u64", sem="release", scope="gpu")

    @cute.jit
    def add_item(self, tidx, sdQ, target, prob, scalars, item, done, tail):
        """One item of the CTA (``done``: its steps before this one; persistent CTAs take
        the staging buffers in turn over all their steps; ``tail``: the split tail's
        piece, or None). Each staged dQ tile is added into the fp32 accumulator by a bulk
        reduce-add, off the consumers' critical path: they only wait for the buffer to be
        read. Deterministic: turns per run of ``turn_tiles`` query tiles, copies by key
        tile, SPT order (docs/design.md, "Backward: deterministic order"). ``first_write``
        (run-time): each tile's first share is stored, not added; without determinism by
        tickets (docs/design.md, "Backward: first write")."""
        sem_ptr, done_ptr = target.sem_ptr, target.done_ptr
        group, seqlen_q, heads_q = prob.group, prob.seqlen_q, prob.heads_q
        first_write = scalars.first_write
        n_block, head_kv, batch, m_first, span, steps = item
        lane = tidx % 32
        m_blocks = cute.ceil_div(seqlen_q, self.cfg.tile_m)
        n_blocks = cute.ceil_div(prob.seqlen_k, self.cfg.tile_n)
        # first_write off at run time: every ticket reads "not first, stored" (plain reduces
        # into the cleared accumulator)
        ticket_next = Int32(FIRST_STORED + 1)
        if const_expr(self.cfg.tickets):
            if first_write != 0 and steps > 0:
                ticket_next = self.take_ticket(sem_ptr, prob, batch, heads_q, m_blocks, head_kv * group,
                                               self.walk.m_block(0, m_first, span, m_blocks), lane)
        for step in cutlass.range(steps, unroll=1):
            head_q = head_kv * group + step // span
            m_block = self.walk.m_block(step, m_first, span, m_blocks)
            ws_batch, ws_tiles, ws_m = self.walk.ws_tile(prob, batch, m_blocks, m_block)  # where it is in the workspace
            word_at = semaphore_word(ws_batch, heads_q, head_q, ws_tiles, ws_m)  # its ticket word (tickets)
            first = cutlass.Boolean(False)
            ticket = Int32(0)
            if const_expr(self.cfg.tickets):
                ticket = cute.arch.shuffle_sync(ticket_next, 0)
                if first_write != 0 and step + 1 < steps:
                    ticket_next = self.take_ticket(sem_ptr, prob, batch, heads_q, m_blocks,
                                                   head_kv * group + (step + 1) // span,
                                                   self.walk.m_block(step + 1, m_first, span, m_blocks), lane)
                first = ticket == 0
            chain = 0
            if const_expr(self.cfg.deterministic):
                chain, sem, first, run_ends = self._take_turn(sem_ptr, prob, scalars, item, step, head_q, m_block,
                                                              m_blocks, n_blocks, first, lane)
            # The turn is taken before the staged tile is waited for: waiting for the tile
            # first put the turn's poll on every step's critical path (measured slower).
            count = self.walk.turn(done, step)  # of the CTA's steps: the buffers' turn
            for part in cutlass.range_constexpr(self.cfg.dq_parts):
                buffer = self.dq.buffer(part, count)
                cute.arch.barrier(barrier_id=self.dq.full_barrier() + buffer, number_of_threads=WARPGROUP + 32)
                if const_expr(self.cfg.tickets and part == 0):
                    self._wait_first_stored(ticket, sem_ptr, word_at, lane)
                self._add(sdQ, target, buffer, part, first, chain, ws_batch, head_q, ws_m, heads_q, ws_tiles, lane)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.dq.own_buffers()):
                    # shared buffers: a later part of this very step may be waiting for this one
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    if step * self.cfg.dq_parts + part + self.cfg.dq_slots < steps * self.cfg.dq_parts:  # a later use
                        cute.arch.barrier_arrive(barrier_id=self.dq.empty_barrier() + buffer,
                                                 number_of_threads=WARPGROUP + 32)
            if const_expr(self.dq.own_buffers()):
                self._give_back_step(step, steps, count)
            if const_expr(self.cfg.tickets):
                if first:
                    # the buffers are back with the consumers. Marked at once: marking it
                    # a step later (at the next tile's FULL, so the writer does not wait
                    # for the store) gained 0-3% less up to 4k keys: the CTA two steps
                    # behind then finds the mark missing more often and polls
                    # (docs/design.md, "Backward: first write").
                    self.mark_stored(sem_ptr + word_at, lane)
            if const_expr(self.cfg.deterministic):
                if run_ends:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.sync_warp()
                    if lane == 0:
                        # release: the reduces, complete (seen by this thread), before the turn
                        cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
        self._count_item_done(done_ptr, batch, heads_q, head_kv, group, lane, tail)

    @cute.jit
    def _count_item_done(self, done_ptr, batch, heads_q, head_kv, group, lane, tail):
        """This key tile's adds, once complete, counted in each query head it added into,
        for the postprocess (pre_post.py), which converts a head once all are counted."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()
        if const_expr(self.cfg.varlen):
            if batch >= 0:  # not a CTA past the last key tile (batch -1: scheduler.cta_work_varlen)
                self.tail.count_dq_done(done_ptr, batch, heads_q, head_kv, group, lane, tail)
        else:
            self.tail.count_dq_done(done_ptr, batch, heads_q, head_kv, group, lane, tail)

    @cute.jit
    def _take_turn(self, sem_ptr, prob, scalars, item, step, head_q, m_block, m_blocks, n_blocks, first, lane):
        """Deterministic: wait for this CTA's turn at the run of query tiles m_block is in
        (at the CTA's first tile of the run). Returns (accumulator copy, the run's
        semaphore, whether this turn stores the tile's first share, whether the CTA's
        turn at the run ends with this tile)."""
        cfg = self.cfg
        turn_tiles, n_block = scalars.turn_tiles, item.n_block
        run = m_block // turn_tiles
        chain = dq_chain(n_block, cfg.chains)
        ws_batch, ws_tiles, ws_run = self.walk.ws_tile(prob, item.batch, m_blocks, run)
        sem = sem_ptr + semaphore_word(ws_batch, prob.heads_q, head_q, ws_tiles, ws_run, cfg.chains, chain)
        if scalars.first_write != 0:
            # the first turn at this tile (in this copy) stores; this turn's release
            # waits for its completion, as for the adds
            first = n_block == first_dq_key_tile(m_block, chain, n_blocks, prob.seqlen_q, prob.seqlen_k,
                                                 cfg.tile_m, cfg.tile_n, cfg.causal, prob.window)
        # this CTA's last tile of the run: the run's last, or the head's
        run_ends = m_block % turn_tiles == turn_tiles - 1 or m_block == m_blocks - 1
        if const_expr(cfg.local):
            run_ends = run_ends or step % item.span == item.span - 1  # its window's last query tile
        if m_block % turn_tiles == 0 or step % item.span == 0:  # this CTA's first tile of the run
            turn = dq_turn(n_block, run, turn_tiles, m_blocks, n_blocks, prob.seqlen_q, prob.seqlen_k,
                           cfg.tile_m, cfg.tile_n, cfg.causal, cfg.chains, prob.window)
            if lane == 0:
                # a plain acquire load: polling CTAs do not queue on the L2 atomic unit
                if const_expr(cfg.varlen):
                    # until the count reaches the turn: sequences that lying metadata lets
                    # share a word count past each other's turns, which an exact match
                    # would wait for forever (the numbers are then wrong, never a hang)
                    while cute.arch.load(sem.llvm_ptr, Int32, sem="acquire", scope="gpu") < turn:
                        pass
                else:
                    while cute.arch.load(sem.llvm_ptr, Int32, sem="acquire", scope="gpu") != turn:
                        pass
            cute.arch.sync_warp()
        return chain, sem, first, run_ends

    @cute.jit
    def _wait_first_stored(self, ticket, sem_ptr, word_at, lane):
        """tickets: a CTA that is not a tile's first waits until the first's store is
        marked, unless its ticket already saw the mark."""
        if ticket != 0 and (ticket & FIRST_STORED) == 0:
            # the first's store was not marked when the ticket was taken
            if lane == 0:
                while (cute.arch.load((sem_ptr + word_at).llvm_ptr, Int32, sem="acquire", scope="gpu")
                       & FIRST_STORED) == 0:
                    pass
            cute.arch.sync_warp()

    @cute.jit
    def _add(self, sdQ, target, buffer, part, first, chain, batch, head_q, m_block, heads_q, m_blocks, lane):
        """Staged part ``part`` (in ``buffer``) into the accumulator: stored where ``first``,
        else added; by one 1D bulk copy in fragment order, else by a 2D TMA box. ``batch``,
        ``m_block``, ``m_blocks``: the tile's place in the workspace (TileWalk.ws_tile)."""
        cfg = self.cfg
        tma_dq, tma_dq_store, gdQacc, dqacc_ptr = target[:4]
        if const_expr(cfg.dq_fragment_order):
            part_elems = cfg.dq_tile[0] * cfg.dq_tile[1]
            at = frag_offset(batch, chain, head_q, m_block, heads_q, m_blocks, cfg.chains,
                             cfg.tile_m * cfg.head_dim) + part * part_elems
            if lane == 0:
                if first:
                    dst = cute.make_ptr(Float32, dqacc_ptr.toint() + at * 4, cute.AddressSpace.gmem, assumed_align=16)
                    cp_async_bulk_global_shared_cta(dst, sdQ[None, None, None, buffer].iterator, part_elems * 4)
                else:
                    cp_reduce_async_bulk_global_shared_cta(dqacc_ptr.toint() + at * 4,
                                                           sdQ[None, None, None, buffer].iterator,
                                                           part_elems * 4, type=CpReduceType.F32)
        else:
            tile = cute.local_tile(gdQacc[None, None, head_q, batch * cfg.chains + chain], cfg.dq_tile,
                                   self.place(part, m_block))
            staged = cute.group_modes(sdQ[None, None, buffer], 0, 2)
            if first:
                part_s, part_g = cpasync.tma_partition(
                    tma_dq_store, 0, cute.make_layout(1), staged, cute.group_modes(tile, 0, 2))
                cute.copy(tma_dq_store, part_s, part_g)
            else:
                part_s, part_g = cpasync.tma_partition(
                    tma_dq, 0, cute.make_layout(1), staged, cute.group_modes(tile, 0, 2))
                cute.copy(tma_dq, part_s, part_g)

    @cute.jit
    def _give_back_step(self, step, steps, count):
        """Own buffers: a step's staging buffers go back as soon as the reduces have read
        them, together after one wait, once its last tile's reduce is issued (two query
        tiles per step: two tiles, one buffer per warpgroup); a turn ends only once its
        run's reduces are complete (deterministic: measured faster than returning the
        buffers after completion, with two-tile runs; docs/design.md, "Backward: dQ
        hand-off and writer warp")."""
        tiles = self.cfg.step_tiles
        if step % tiles == tiles - 1 or step + 1 == steps:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            for back in cutlass.range_constexpr(tiles):
                # the step's tiles, back from this one (a lone last tile has one)
                if step % tiles >= back:
                    # waited for by a later step's staging, or (persistent: later items
                    # are not known here) by the consumers' drain after their last item
                    if const_expr(self.cfg.persistent):
                        self.dq.give_back(count - back)
                    else:
                        if step - back + self.cfg.dq_stages < steps:
                            self.dq.give_back(count - back)

    @cute.jit
    def mark_stored(self, word, lane):
        """tickets: mark a tile's first share stored, once the store is complete (seen
        by the lane that issued it; the warp's sync passes that on to lane 0, whose release
        add publishes it): the other CTAs add into the tile after this."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.atomic_add(word, Int32(FIRST_STORED), sem="release", scope="gpu")
