"""The forward at head_dim 512 (Gemma 4's global layers): the head dim split over two
consumer warpgroups that share one 64-row query tile (docs/design.md, "Head dims").

Why a kernel of its own: O for 64 rows x 512 columns is 256 fp32 registers a thread in one
warpgroup, past the 255 a thread can hold, so no warpgroup can own a row's whole output.
Here warpgroup w owns O's head dims [256 w, 256 w + 256), and warpgroup 0 alone scores:
- S = Q K^T over the whole head dim (k = 512, Q and K from shared memory), the mask, cap
  and softmax, by warpgroup 0; each key tile it hands warpgroup 1 P (16-bit, staged in
  shared memory as a wgmma operand) and its rows' rescale factors;
- O += P V: each with its own 256 columns of V (n = 256, the largest wgmma), into its own
  128 registers a thread of O (warpgroup 0's P from registers, warpgroup 1's from shared
  memory);
- the epilogue: warpgroup 0 hands over 1/rowsum; each stages its half of O over Q's
  buffer, one TMA store (dense) or the rows written from shared memory (varlen) for the
  whole tile; warpgroup 0 writes LSE.
Shared memory: Q 64 KB, one stage each of K and V (64 keys: 64 KB each), P 8 KB and the
factors 2 KB: 204 KB. The producer loads K and V of a key tile in turn, so each load runs
under the other GEMM and the softmax. Measured against both warpgroups computing half of
S's sum each and both the softmax (S's halves added through shared memory): 1.12-1.27x
(docs/design.md, "Head dims").

The producer, the masks, the key-tile bounds, the varlen walk and the heaviest-first sort
are the forward's (kernel.py); windows, sinks and two query tiles are not built here.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..fragments import acc_as_operand_a, acc_as_rows_cols, transpose_smem
from ..mask import TileMask
from ..packed_rows import PackedRows, store_rows
from ..primitives import WARPGROUP, smem_layout, stage, tiled_mma, wgmma
from ..softmax import OnlineSoftmax, cap_scores, rescale_rows, scale_rows
from .config import FwdConfig
from .kernel import EPILOGUE_BARRIER, FlashFwdSm90

P_READY = 2  # P and the factors of a key tile (or the final 1/rowsum) in shared memory
P_FREE = 3  # warpgroup 1's P V of a key tile done: sP and the factors may be rewritten


class FlashFwdSm90HeadSplit(FlashFwdSm90):
    """One head-split forward variant (``FwdConfig.head_split``): host side and kernel."""

    @staticmethod
    def check(cfg: FwdConfig):
        assert cfg.head_split and cfg.tile_m == 64 and cfg.num_consumers == 2, "two warpgroups on 64 rows"
        assert cfg.q_tiles == 1 and not cfg.local, "one query tile, no window"
        assert cfg.head_dim % 128 == 0 and cfg.head_dim_v % 128 == 0, "halves of whole 64-column swizzle atoms"

    def _views(self, storage, layouts):
        """The forward's tiles, P's tile and the rows' factors (slot 0: a key tile's rescale,
        1: the final 1/rowsum; row of the thread; thread): (sQ, sK, sV, sO, (sP, sRows))."""
        cfg = self.cfg
        p_layout = smem_layout(self.dtype, cfg.tile_m, cfg.tile_n)
        sP = storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner)
        sRows = storage.sRows.get_tensor(cute.make_layout((2, 2, WARPGROUP), stride=(2 * WARPGROUP, WARPGROUP, 1)))
        return (*FlashFwdSm90._views(self, storage, layouts), (sP, sRows))

    @cute.jit
    def load(self, q, k, v, pipes, m_blocks, seqlen_q, seqlen_k, window=None):
        """Q, then K and V of each key tile in turn, from the last key tile down (one
        stage each: the forward's K-ahead order would wait for K(j-1)'s stage, which S(j)
        frees, before issuing V(j), which P(j) V(j) needs)."""
        (tma_q, gQ, sQ), (tma_k, gK, sK), (tma_v, gV, sV) = q, k, v
        pipe_q, pipe_k, pipe_v = pipes
        cfg = self.cfg
        whole = cute.make_layout(1)
        tiles_k = cute.local_tile(gK, (cfg.tile_n, cfg.head_dim), (None, 0))
        tiles_v = cute.local_tile(gV, (cfg.tile_n, cfg.head_dim_v), (None, 0))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, whole, cute.group_modes(sK, 0, 2), cute.group_modes(tiles_k, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, whole, cute.group_modes(sV, 0, 2), cute.group_modes(tiles_v, 0, 2))
        tile_q = cute.local_tile(gQ, (cfg.tile_m, cfg.head_dim), (m_blocks[0], 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, whole, cute.group_modes(sQ[None, None, 0], 0, 2),
                                         cute.group_modes(tile_q, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        n_blocks = self._key_tiles(m_blocks[0], seqlen_q, seqlen_k)
        for i in cutlass.range(n_blocks, unroll=1):
            n_block = n_blocks - 1 - i
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKg[None, n_block], tKs[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, tVg[None, n_block], tVs[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def attend(self, tidx, smem, pipes, m_blocks, seqlens, scale_log2: Float32, out, opts):
        """tidx: 0..255 over the two consumer warpgroups, warpgroup w owning head dims
        [w d/2, (w + 1) d/2) of O. Warpgroup 0 computes S over the whole head dim (k = d),
        the mask, cap and softmax, and per key tile hands warpgroup 1 P (16-bit, in sP: a
        wgmma operand from shared memory) and its rows' rescale factors (sRows, slot 0: the
        same element of the same thread, both accumulators having one row layout); each
        then rescales its half of O and adds P V over its own half of V's columns.
        Barriers: P_READY (warpgroup 0 arrives, 1 waits) once a tile and once for the
        final 1/rowsum (slot 1); P_FREE (1 arrives once its P V is done, 0 waits before the
        next P, and before the final write). K's pipeline has warpgroup 0 as its one
        consumer."""
        cfg = self.cfg
        sQ, sK, sV, sO, (sP, sRows) = smem
        seqlen_q, seqlen_k = seqlens
        pipe_q, pipe_k, pipe_v = pipes
        half_v = cfg.head_dim_v // 2
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        local = tidx % WARPGROUP
        mma_pv = tiled_mma(self.dtype, "K", "MN", (1, 1, 1), half_v, a_in_registers=True)  # P from registers
        mma_pv_s = tiled_mma(self.dtype, "K", "MN", (1, 1, 1), half_v)  # P from shared memory
        wg_pv, thr_pv = mma_pv.get_slice(0), mma_pv.get_slice(local)
        wg_pv_s = mma_pv_s.get_slice(0)
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(
            cute.local_tile(transpose_smem(sV), (half_v, cfg.tile_n), (wg, 0, None))))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((cfg.tile_m, half_v)), Float32)
        acc_o.fill(0.0)
        rows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
        row_scale = cute.make_rmem_tensor((rows,), Float32)
        inv_sum = cute.make_rmem_tensor((rows,), Float32)
        lse = cute.make_rmem_tensor((rows,), Float32)
        m_block = m_blocks[0]
        n_blocks = self._key_tiles(m_block, seqlen_q, seqlen_k)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        if wg == 0:
            mma_qk = tiled_mma(self.dtype, "K", "K", (1, 1, 1), cfg.tile_n)  # (queries, keys), k = the head dim
            wg_qk, thr_qk = mma_qk.get_slice(0), mma_qk.get_slice(local)
            tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(cute.local_tile(sQ, (cfg.tile_m, cfg.head_dim), (0, 0, 0))))
            tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(cute.local_tile(sK, (cfg.tile_n, cfg.head_dim),
                                                                           (0, 0, None))))
            tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
            s_shape = thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
            s_coords = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            softmax = OnlineSoftmax(scale_log2, rows)
            softmax.reset()
            first_masked = self._first_masked(m_block, seqlen_q, seqlen_k)
            apply_mask, softmax_step = TileMask(cfg.tile_m, cfg.tile_n, cfg.causal, False).apply, softmax.step
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_q.consumer_wait(q_state)
            for i in cutlass.range(n_blocks, unroll=1):
                n_block = n_blocks - 1 - i
                acc_s = cute.make_rmem_tensor(s_shape, Float32)
                pipe_k.consumer_wait(state)
                wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=True)
                pipe_k.consumer_release(state)
                if const_expr(cfg.softcap):
                    cap_scores(acc_s, opts.softcap_scale)
                if n_block >= first_masked:  # padding, the diagonal
                    apply_mask(acc_s, s_coords, m_block, n_block, seqlen_q, seqlen_k, None)
                softmax_step(acc_s, row_scale)
                # P and the factors for warpgroup 1, once its P V of the tile before has read them
                if i > 0:
                    cute.arch.barrier(barrier_id=P_FREE, number_of_threads=2 * WARPGROUP)
                stage(local, acc_s, self.dtype, mma_qk, sP)
                for r in cutlass.range_constexpr(rows):
                    sRows[0, r, local] = row_scale[r]
                cute.arch.fence_proxy("async.shared", space="cta")  # sP: read by warpgroup 1's wgmma (async proxy)
                cute.arch.barrier_arrive(barrier_id=P_READY, number_of_threads=2 * WARPGROUP)
                rescale_rows(acc_o, row_scale)
                tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))  # stage's conversion: ptxas keeps one
                pipe_v.consumer_wait(state)
                wgmma(mma_pv, acc_o, tOrP, tOrVt[None, None, None, state.index], True, wait=True)
                pipe_v.consumer_release(state)
                state.advance()
            softmax.finalize(inv_sum, lse)
            if n_blocks > 0:  # warpgroup 1 has read the last tile's factors
                cute.arch.barrier(barrier_id=P_FREE, number_of_threads=2 * WARPGROUP)
            for r in cutlass.range_constexpr(rows):
                sRows[1, r, local] = inv_sum[r]
            cute.arch.barrier_arrive(barrier_id=P_READY, number_of_threads=2 * WARPGROUP)
        else:
            tOrPs = wg_pv_s.make_fragment_A(wg_pv_s.partition_A(sP))
            for i in cutlass.range(n_blocks, unroll=1):
                cute.arch.barrier(barrier_id=P_READY, number_of_threads=2 * WARPGROUP)
                for r in cutlass.range_constexpr(rows):
                    row_scale[r] = sRows[0, r, local]
                rescale_rows(acc_o, row_scale)
                pipe_v.consumer_wait(state)
                wgmma(mma_pv_s, acc_o, tOrPs, tOrVt[None, None, None, state.index], True, wait=True)
                pipe_v.consumer_release(state)
                cute.arch.barrier_arrive(barrier_id=P_FREE, number_of_threads=2 * WARPGROUP)
                state.advance()
            cute.arch.barrier(barrier_id=P_READY, number_of_threads=2 * WARPGROUP)
            for r in cutlass.range_constexpr(rows):
                inv_sum[r] = sRows[1, r, local]
        scale_rows(acc_o, inv_sum)
        self._write(tidx, wg, local, acc_o, lse, (mma_pv, thr_pv), sO, out, m_block, seqlen_q)

    @cute.jit
    def _write(self, tidx, wg, local, acc_o, lse, mmas, sO, out, m_block, seqlen_q):
        """Each warpgroup's half of O staged over Q, then the whole tile written (dense: one
        TMA store by warp 0; varlen: the sequence's rows by every thread); LSE by
        warpgroup 0's quad leaders."""
        cfg = self.cfg
        mma_pv, thr_pv = mmas
        tma_o, gO, mLSE = out
        half_v = cfg.head_dim_v // 2
        sO_tile = sO[None, None, 0]
        stage(local, acc_o, self.dtype, mma_pv, cute.local_tile(sO_tile, (cfg.tile_m, half_v), (0, wg)))
        first_row = m_block * cfg.tile_m
        coords = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, half_v))))
        if const_expr(cfg.varlen):
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=2 * WARPGROUP)
            store_rows(tidx, 2 * WARPGROUP, sO_tile, PackedRows(gO.o_ptr, gO.o_ss, gO.o_sh, gO.columns, gO.offset,
                                                                seqlen_q, gO.head), first_row)
            if wg == 0 and local % 4 == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = first_row + coords[r, 0][0]
                    if row < seqlen_q:
                        gO.lse[gO.head * gO.total + gO.offset + row] = lse[r]
        else:
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=2 * WARPGROUP)
            if cute.arch.make_warp_uniform(tidx // 32) == 0:
                tile_o = cute.local_tile(gO, (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
                s_part, g_part = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO_tile, 0, 2),
                                                       cute.group_modes(tile_o, 0, 2))
                cute.copy(tma_o, s_part, g_part)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if wg == 0 and local % 4 == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = first_row + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE[row] = lse[r]
