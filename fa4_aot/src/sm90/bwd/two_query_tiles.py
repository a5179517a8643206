"""The backward's head_dim 64 loop (not causal, and deterministic causal) with two query
tiles per step (sm_90a):
``load_wide`` and ``compute_wide``, a mixin of ``bwd_sm90.FlashBwdSm90`` (its knobs,
pipelines, ``_m_block``, ``_finish_dkv`` and the dQ hand-off of ``bwd_dq_handoff``).

A CTA's query tiles (64 rows; ``steps`` of them over the KV head's query heads, as for
the other head dims) are taken in pairs: step s holds tiles 2s and 2s + 1 of the CTA's
sequence, each loaded by its own TMA box into one half of a 128-row Q (dO) stage with its
64 statistics. 128 keys per CTA; warpgroup w (its 64 keys):
    S^T = K_w Q^T, dP^T = V_w dO^T      (64 keys x 128 queries; all operands in shared memory)
    P^T, dS^T = P^T (dP^T - D)          (registers: the A operands of dV and dK)
    dV_w += P^T dO, dK_w += dS^T Q      (k = 128 queries)
    dS^T to shared memory; dQ of tile 2s + w = dS[64 w:64 w + 64, :] K over all keys
and stages that whole tile for the writer warp in fragment order (which adds tile by
tile, one 1D bulk reduce each: bwd_dq_handoff).
Within a step dS^T is written to shared memory before P^T is made 16-bit and dV's GEMM
issued, and fenced only after that issue, so the fence's wait overlaps dV (see
compute_wide).
With an odd number of tiles the last step's second half is loaded from past the end of
Q and dO (TMA fills zeros) with the first half's statistics: its S^T, P^T, dS^T stay
finite and add nothing to dV and dK (its Q and dO are zero), and its dQ is not staged.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .barriers import DS_BARRIER
from ..fragments import acc_as_operand_a, transpose_smem
from ..primitives import WARPGROUP, convert_into, tiled_mma, wgmma


class WideCompute:
    """Producer and consumer roles of the head_dim 64 backward (``wide``)."""

    @cute.jit
    def _pair(self, step, head_off, tile_off, m_first, span, m_blocks, steps, head_kv, group):
        """(query head, query tile) of each half of ``step`` and whether the second half
        is a real tile (1, else 0); a missing second half reads as the first's head and
        the tile past the end (m_blocks). ``head_off``, ``tile_off``: where the step's
        first tile (2 step) lies in the CTA's sequence, as (2 step) // span and % span,
        carried from step to step by ``_next_pair`` (no division in the loop)."""
        real = Int32(cutlass.select_(2 * step + 1 < steps, 1, 0))
        wraps = tile_off + 1 >= span  # the second tile starts the next head's span
        head_b = head_off + Int32(cutlass.select_(wraps & (real == 1), 1, 0))
        off_b = tile_off + 1 - Int32(cutlass.select_(wraps, span, 0))
        m_a = self._m_block_at(tile_off, m_first, m_blocks)
        m_b = Int32(cutlass.select_(real == 1, self._m_block_at(off_b, m_first, m_blocks), m_blocks))
        return head_kv * group + head_off, m_a, head_kv * group + head_b, m_b, real

    @cute.jit
    def _next_pair(self, head_off, tile_off, span):
        """``_pair``'s position two tiles on (span >= 1: at most two wraps)."""
        tile_off = tile_off + 2
        for _ in cutlass.range_constexpr(2):
            wraps = tile_off >= span
            head_off = head_off + Int32(cutlass.select_(wraps, 1, 0))
            tile_off = tile_off - Int32(cutlass.select_(wraps, span, 0))
        return head_off, tile_off

    @cute.jit
    def load_wide(self, sources, stats, kv_state, state, n_block, head_kv, batch, m_first, span, steps):
        """Warp 0: K and V, then per step the dO and Q tiles of both halves (each with its
        64 statistics) onto one mbarrier stage; the first step's statistics only after
        the wait for the preprocess (as ``load``)."""
        tma_q, gQ, sQ, tma_do, gdO, sdO, _, _, _, _, _, _, _, pipe_q, pipe_do = sources
        lse2_ptr, sLSE2, dsum_ptr, sDsum, m_blocks, heads_q, group = stats
        whole = cute.make_layout(1)
        tm, d = self.tile_m, self.head_dim
        self._load_kv(sources, kv_state, n_block, head_kv, batch)
        head_off, tile_off = Int32(0), Int32(0)
        for step in cutlass.range(cute.ceil_div(steps, 2), unroll=1):
            head_a, m_a, head_b, m_b, real = self._pair(step, head_off, tile_off, m_first, span, m_blocks, steps,
                                                        head_kv, group)
            head_off, tile_off = self._next_pair(head_off, tile_off, span)
            # statistics of the missing half: the first half's (finite; see module doc)
            m_b_stats = Int32(cutlass.select_(real == 1, m_b, m_a))
            halves = ((head_a, m_a, m_a), (head_b, m_b, m_b_stats))
            loads = ((tma_do, gdO, sdO, pipe_do, dsum_ptr, sDsum), (tma_q, gQ, sQ, pipe_q, lse2_ptr, sLSE2))
            for atom, g_all, s_all, pipe, stats_ptr, s_stats in loads:
                pipe.producer_acquire(state)
                for h in cutlass.range_constexpr(2):
                    head_q, m_load, m_stats = halves[h]
                    q_tile = cute.local_tile(g_all[None, None, head_q, batch], (tm, d), (m_load, 0))
                    s_half = cute.local_tile(s_all[None, None, state.index], (tm, d), (h, 0))
                    part_s, part_g = cpasync.tma_partition(
                        atom, 0, whole, cute.group_modes(s_half, 0, 2), cute.group_modes(q_tile, 0, 2))
                    cute.copy(atom, part_g, part_s, tma_bar_ptr=pipe.producer_get_barrier(state))
                    if step > 0:
                        at = self._stats_at(batch, heads_q, head_q, m_blocks, m_stats)
                        self._load_stats(s_stats, stats_ptr + at, pipe, state, h)
            if step == 0:
                cute.arch.griddepcontrol_wait()
                for _, _, _, pipe, stats_ptr, s_stats in loads:
                    for h in cutlass.range_constexpr(2):
                        head_q, _, m_stats = halves[h]
                        at = self._stats_at(batch, heads_q, head_q, m_blocks, m_stats)
                        self._load_stats(s_stats, stats_ptr + at, pipe, state, h)
            state.advance()
        return kv_state, state

    @cute.jit
    def compute_wide(self, tidx, sQ, sdO, sK, sV, sdS, sdK, sdV, sdQ, pipe_kv, pipe_q, pipe_do, group, seqlen_q,
                     seqlen_k, heads_q, sLSE2, sDsum, scale, scale_log2, tma_dk, gdK, tma_dv, gdV, kv_state, state,
                     n_block, head_kv, batch, m_first, span, steps, tail):
        """One CTA (key tile; ``tail``: a piece's, bwd_tail, or None). tidx: 0..255 over
        the consumer warpgroups. Per step, in issue order: S^T, dP^T (async) -> P^T, dS^T in registers -> dV += P^T dO (async) -> dS
        to shared memory, barrier -> dQ of this warpgroup's tile (async) -> dK += dS^T Q
        (async) -> once dQ is done, stage it for the writer while dK runs."""
        d, tm, tn, rows = self.head_dim, self.tile_m, self.tile_n, self.step_rows
        gdK, gdV = gdK[None, None, head_kv, batch], gdV[None, None, head_kv, batch]
        m_blocks = cute.ceil_div(seqlen_q, tm)
        mma_sdp = tiled_mma(self.dtype, "K", "K", (2, 1, 1), rows)  # (keys, queries), k = d
        mma_dkv = tiled_mma(self.dtype, "K", "MN", (2, 1, 1), d, a_in_registers=True)  # (keys, d), k = queries
        mma_dq = tiled_mma(self.dtype, "K", "MN", (1, 1, 1), d)  # (queries, d), k = keys
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wg_first = wg * WARPGROUP
        wg_sdp, wg_dkv = (m.get_slice(wg_first) for m in (mma_sdp, mma_dkv))
        thr_sdp, thr_dkv = (m.get_slice(tidx) for m in (mma_sdp, mma_dkv))
        wg_dq, thr_dq = mma_dq.get_slice(0), mma_dq.get_slice(tidx % WARPGROUP)
        tSrK, tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV, tPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ)))
        # dQ of this warpgroup's tile: its 64 query rows of dS (keys contiguous), K^T
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(cute.local_tile(sdS, (tm, tn), (wg, 0, None))))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))
        (acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, _,
         _) = self._step_tensors(tidx, mma_sdp, thr_sdp, thr_dkv, mma_dq)
        tdQ_smem = sdQ[None, tidx % WARPGROUP, None, None]  # fragment order: (4, chunk, buffer)
        tdS_smem = thr_ds.partition_D(transpose_smem(sdS))  # dS^T view: (keys, queries, stage)

        pipe_kv.consumer_wait(kv_state)
        head_off, tile_off = Int32(0), Int32(0)
        for step in cutlass.range(cute.ceil_div(steps, 2), unroll=1):
            _, m_a, _, m_b, real = self._pair(step, head_off, tile_off, m_first, span, m_blocks, steps, head_kv, group)
            head_off, tile_off = self._next_pair(head_off, tile_off, span)
            ds_stage = step % self.ds_stages
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            acc_dp = cute.make_rmem_tensor(s_shape, Float32)
            pipe_q.consumer_wait(state)
            wgmma(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, state.index], False, wait=False)
            pipe_do.consumer_wait(state)
            wgmma(mma_sdp, acc_dp, tPrV, tPrdO[None, None, None, state.index], False, wait=False)
            warpgroup.wait_group(1)  # S^T done
            # each column's LSE2 and D read from shared memory where used (128 columns' values
            # held at once do not fit beside the accumulators); not causal, m_a only names
            # the step (the mask is the last key tile's padding); causal, each half masked
            # by its own tile (the halves of a GQA group's pair may be two heads' tiles)
            self._probs(acc_s, s_coords, sLSE2[None, state.index], n_block, m_a, seqlen_q, seqlen_k, scale_log2,
                        by_query=True, m_upper=m_b if const_expr(self.causal) else None)
            warpgroup.wait_group(0)  # dP^T done
            self._grads(acc_s, acc_dp, sDsum[None, state.index], s_coords=s_coords, by_query=True)
            # dS^T to shared memory before P^T is made 16-bit and dV's GEMM issued (fewer
            # registers live: with the fp32 and 16-bit P^T and dP^T all live ptxas serialized
            # every wgmma, C7512), and its fence after that issue: fenced before, dV waited
            # for the stores (4% of the loop's samples, session 20). The stage written here
            # was last read by the dQ GEMMs two steps ago, which both warpgroups waited for
            # before the previous step's barrier.
            ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
            convert_into(acc_dp, ds)
            cute.copy(ds_copy, thr_ds.retile(ds), tdS_smem[None, None, None, ds_stage])
            p16 = cute.make_rmem_tensor_like(acc_s, self.dtype)
            convert_into(acc_s, p16)
            # P^T and dS^T each read by its GEMM as an A fragment in place (a view)
            wgmma(mma_dkv, acc_dv, acc_as_operand_a(p16), tVrdOt[None, None, None, state.index], True, wait=False)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=2 * WARPGROUP)
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
            wgmma(mma_dq, acc_dq, tQrdS[None, None, None, ds_stage], tQrKt, False, wait=False)
            wgmma(mma_dkv, acc_dk, acc_as_operand_a(ds), tKrQt[None, None, None, state.index], True, wait=False)
            warpgroup.wait_group(1)  # dV and dQ done; dK in flight
            pipe_do.consumer_release(state)
            if wg < 1 + real:  # warpgroup 1's tile only if there is one
                # the hand-off counts tiles: this one is 2 step + wg, one part each
                self._stage_dq(0, 2 * step + wg, acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
            warpgroup.wait_group(0)
            pipe_q.consumer_release(state)
            state.advance()
        self._finish_dkv(tidx, acc_dk, acc_dv, mma_dkv, sdK, sdV, tma_dk, gdK, tma_dv, gdV, n_block, scale,
                         sLSE2[None, 0], tail)
        kv_state.advance()
        return kv_state, state
