"""The backward's dQ hand-off (sm_90a): consumer warpgroups stage each query tile's fp32
dQ share in shared memory, and the dQ writer warp adds it into the fp32 accumulator in
global memory by TMA reduce-add, in a fixed order when deterministic.

``DqHandoff`` is a mixin of ``bwd_sm90.FlashBwdSm90``: it reads that class's knobs
(tile_m, tile_n, dq_tile, dq_transposed, dq_buffers, dq_stages, chains, causal,
deterministic) and its ``_m_block``. Staging buffers: b = w + dq_buffers * (step %
dq_stages) for warpgroup w, each with a FULL barrier (staged, for the writer) and an
EMPTY one (read by the writer's reduce, for the warpgroup's next use).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .bwd_barriers import DQ_EMPTY_BARRIER, DQ_FULL_BARRIER
from .bwd_order import dq_chain, dq_turn
from .sm90_common import WARPGROUP

DQ_WRITER_WARP = 1  # of the producer warpgroup


class DqHandoff:
    """Consumer side (``_stage_dq``, ``_claim_dq``, ``_hand_dq``) and writer warp
    (``dq_writer``) of the dQ staging buffers."""

    @cute.jit
    def _stage_dq(self, wg, step, acc_dq, dq_copy, thr_dq_copy, tdQ_smem):
        """Hand this warpgroup's dQ half to the writer warp in this step's staging buffer."""
        buffer = self._claim_dq(wg, step)
        cute.copy(dq_copy, thr_dq_copy.retile(acc_dq), tdQ_smem)
        self._hand_dq(buffer)

    @cute.jit
    def _claim_dq(self, wg, step):
        """This step's staging buffer of warpgroup ``wg``, once the writer's reduce from
        dq_stages steps ago has read it."""
        buffer = self._dq_buffer(wg, step)
        if step >= self.dq_stages:
            cute.arch.barrier(barrier_id=DQ_EMPTY_BARRIER + buffer, number_of_threads=WARPGROUP + 32)
        return buffer

    def _hand_dq(self, buffer):
        """The staged buffer (written by this warpgroup) to the writer warp."""
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier_arrive(barrier_id=DQ_FULL_BARRIER + buffer, number_of_threads=WARPGROUP + 32)

    def _dq_buffer(self, wg, step):
        """The staging buffer of warpgroup ``wg`` at ``step``."""
        return wg + self.dq_buffers * (step % self.dq_stages)

    @cute.jit
    def dq_writer(self, tidx, sdQ, tma_dq, gdQacc, sem_ptr, n_block, head_kv, batch, group,
                  m_first, span, steps, seqlen_q, seqlen_k, heads_q, turn_tiles):
        """Add each staged dQ tile into the fp32 accumulator by TMA reduce-add, off the
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
        """
        lane = tidx % 32
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        cute.arch.griddepcontrol_wait()  # the zeroed accumulator and semaphores
        for step in cutlass.range(steps, unroll=1):
            head_q = head_kv * group + step // span
            m_block = self._m_block(step, m_first, span, m_blocks)
            chain = 0
            if const_expr(self.deterministic):
                run = m_block // turn_tiles
                chain = dq_chain(n_block, self.chains)
                sem = sem_ptr + ((batch * heads_q + head_q) * m_blocks + run) * self.chains + chain
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
            for w in cutlass.range_constexpr(self.dq_buffers):
                buffer = self._dq_buffer(w, step)
                cute.arch.barrier(barrier_id=DQ_FULL_BARRIER + buffer, number_of_threads=WARPGROUP + 32)
                at = (2 * m_block + w, 0) if const_expr(self.dq_transposed) else (m_block, w)
                tile = cute.local_tile(gdQacc[None, None, head_q, batch * self.chains + chain], self.dq_tile, at)
                part_s, part_g = cpasync.tma_partition(
                    tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ[None, None, buffer], 0, 2),
                    cute.group_modes(tile, 0, 2))
                cute.copy(tma_dq, part_s, part_g)
                cute.arch.cp_async_bulk_commit_group()
            # The staging buffers go back as soon as the reduces have read them; a turn ends
            # only once its run's reduces are complete (deterministic: measured faster than
            # returning the buffers after completion, with two-tile runs; docs/perf-notes.md).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if step + self.dq_stages < steps:  # waited for only by a later step's staging
                for w in cutlass.range_constexpr(self.dq_buffers):
                    cute.arch.barrier_arrive(
                        barrier_id=DQ_EMPTY_BARRIER + self._dq_buffer(w, step), number_of_threads=WARPGROUP + 32)
            if const_expr(self.deterministic):
                if run_ends:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.sync_warp()
                    if lane == 0:
                        cute.arch.fence_acq_rel_gpu()
                        cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
        cute.arch.cp_async_bulk_wait_group(0, read=False)
