"""The forward at head_dim 512 (Gemma 4's global layers): the head dim split over two
consumer warpgroups that share one 64-row query tile (docs/design.md, "Head dims").

Why a kernel of its own: O for 64 rows x 512 columns is 256 fp32 registers a thread in one
warpgroup, past the 255 a thread can hold, so no warpgroup can own a row's whole output.
Here warpgroup w owns head dims [256 w, 256 w + 256):
- S = Q K^T: each computes its half of the sum over the head dim (k = 256) and writes it
  to shared memory; after a barrier each adds the other's half. IEEE addition commutes, so
  both hold the same S bit for bit, take the same softmax steps and the same P;
- O += P V: each with its own 256 columns of V (n = 256, the largest wgmma), into its own
  128 registers a thread of O;
- the epilogue: each stages its half of O over Q's buffer, one TMA store (dense) or the
  rows written from shared memory (varlen) for the whole tile; warpgroup 0 writes LSE.
Shared memory: Q 64 KB, one stage each of K and V (64 keys: 64 KB each) and the two S
halves (16 KB each): 224 KB of the 227. With one stage the producer loads K and V of a
key tile in turn (K(j) once S(j+1) has read K's buffer, V(j) once P(j+1) V(j+1) has read
V's), so each load runs under the other GEMM and the softmax; with two (32-key tiles) the
consumers overlap S of the next key tile and the softmax with P V of this one, as the
forward does within a warpgroup (config.HEAD_SPLIT_TILES).

The producer, the masks, the key-tile bounds, the varlen walk and the heaviest-first sort
are the forward's (kernel.py); windows, sinks and two query tiles are not built here.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..fragments import acc_as_operand_a, acc_as_rows_cols, transpose_smem
from ..mask import TileMask
from ..packed_rows import PackedRows, store_rows
from ..primitives import WARPGROUP, stage, sum_halves, tiled_mma, wait_after, wgmma
from ..softmax import OnlineSoftmax, cap_scores, rescale_rows, scale_rows
from .config import FwdConfig
from .kernel import EPILOGUE_BARRIER, FlashFwdSm90

HALVES_WRITTEN = 2  # both warpgroups' S halves in shared memory
HALVES_READ = 3  # both have read the other's half: the buffer may take the next tile's
ORDER_BARRIER = 4  # .. 5, one per warpgroup: primitives.wait_after (two stages: the overlap)


class FlashFwdSm90HeadSplit(FlashFwdSm90):
    """One head-split forward variant (``FwdConfig.head_split``): host side and kernel."""

    @staticmethod
    def check(cfg: FwdConfig):
        assert cfg.head_split and cfg.tile_m == 64 and cfg.num_consumers == 2, "two warpgroups on 64 rows"
        assert cfg.q_tiles == 1 and not cfg.local, "one query tile, no window"
        assert cfg.head_dim % 128 == 0 and cfg.head_dim_v % 128 == 0, "halves of whole 64-column swizzle atoms"

    def _views(self, storage, layouts):
        """The forward's tiles and the S halves' buffer (warpgroup, fragment element,
        thread): (sQ, sK, sV, sO, sS)."""
        elements = self.cfg.tile_m * self.cfg.tile_n // WARPGROUP
        sS = storage.sS.get_tensor(cute.make_layout((2, elements, WARPGROUP),
                                                    stride=(elements * WARPGROUP, WARPGROUP, 1)))
        return (*FlashFwdSm90._views(self, storage, layouts), sS)

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
        [w d/2, (w + 1) d/2) of S's sum and of O; otherwise as the forward's."""
        cfg = self.cfg
        sQ, sK, sV, sO, sS = smem
        seqlen_q, seqlen_k = seqlens
        pipe_q, pipe_k, pipe_v = pipes
        half, half_v = cfg.head_dim // 2, cfg.head_dim_v // 2
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        local = tidx % WARPGROUP
        mma_qk = tiled_mma(self.dtype, "K", "K", (1, 1, 1), cfg.tile_n)  # (queries, keys), k = own head dims
        mma_pv = tiled_mma(self.dtype, "K", "MN", (1, 1, 1), half_v, a_in_registers=True)  # (queries, own dims)
        wg_qk, thr_qk = mma_qk.get_slice(0), mma_qk.get_slice(local)
        wg_pv, thr_pv = mma_pv.get_slice(0), mma_pv.get_slice(local)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(cute.local_tile(sQ, (cfg.tile_m, half), (0, wg, 0))))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(cute.local_tile(sK, (cfg.tile_n, half), (0, wg, None))))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(
            cute.local_tile(transpose_smem(sV), (half_v, cfg.tile_n), (wg, 0, None))))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        s_shape = thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((cfg.tile_m, half_v)), Float32)
        acc_o.fill(0.0)
        rows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax(scale_log2, rows)
        softmax.reset()
        row_scale = cute.make_rmem_tensor((rows,), Float32)
        m_block = m_blocks[0]
        n_blocks = self._key_tiles(m_block, seqlen_q, seqlen_k)
        first_masked = self._first_masked(m_block, seqlen_q, seqlen_k)
        # bound methods (see the forward's _key_loop)
        apply_mask, softmax_step = TileMask(cfg.tile_m, cfg.tile_n, cfg.causal, False).apply, softmax.step
        seqlens = (seqlen_q, seqlen_k)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        if const_expr(cfg.stages == 1):
            for i in cutlass.range(n_blocks, unroll=1):
                n_block = n_blocks - 1 - i
                acc_s = cute.make_rmem_tensor(s_shape, Float32)
                pipe_k.consumer_wait(state)
                wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=True)
                pipe_k.consumer_release(state)
                self._scores(acc_s, sS, wg, local, s_coords, m_block, n_block, first_masked, seqlens, opts, apply_mask)
                softmax_step(acc_s, row_scale)
                rescale_rows(acc_o, row_scale)
                tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
                pipe_v.consumer_wait(state)
                wgmma(mma_pv, acc_o, tOrP, tOrVt[None, None, None, state.index], True, wait=True)
                pipe_v.consumer_release(state)
                state.advance()
        elif n_blocks > 0:
            # two stages or more: S of key tile j and P V of tile j+1 in flight together, the
            # softmax of j under P V of j+1 (the forward's order within a warpgroup)
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            pipe_k.consumer_wait(state)
            wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=True)
            pipe_k.consumer_release(state)
            self._scores(acc_s, sS, wg, local, s_coords, m_block, n_blocks - 1, first_masked, seqlens, opts,
                         apply_mask)
            softmax_step(acc_s, row_scale)  # O is zero: nothing to rescale
            tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
            for i in cutlass.range(n_blocks - 1, unroll=1):
                v_state = state.clone()
                state.advance()
                acc_s = cute.make_rmem_tensor(s_shape, Float32)
                pipe_k.consumer_wait(state)
                wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=False)
                pipe_v.consumer_wait(v_state)
                wgmma(mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], True, wait=False)
                warpgroup.wait_group(1)  # S done, P V in flight
                pipe_k.consumer_release(state)
                self._scores(acc_s, sS, wg, local, s_coords, m_block, n_blocks - 2 - i, first_masked, seqlens, opts,
                             apply_mask)
                softmax_step(acc_s, row_scale)
                # P V of the tile before done before P of this one overwrites its registers
                wait_after([softmax.row_sum[r] for r in range(rows)], ORDER_BARRIER + wg, WARPGROUP)
                pipe_v.consumer_release(v_state)
                rescale_rows(acc_o, row_scale)
                tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
            pipe_v.consumer_wait(state)
            wgmma(mma_pv, acc_o, tOrP, tOrVt[None, None, None, state.index], True, wait=True)
            pipe_v.consumer_release(state)
        inv_sum = cute.make_rmem_tensor((rows,), Float32)
        lse = cute.make_rmem_tensor((rows,), Float32)
        softmax.finalize(inv_sum, lse)
        scale_rows(acc_o, inv_sum)
        self._write(tidx, wg, local, acc_o, lse, (mma_pv, thr_pv), sO, out, m_block, seqlen_q)

    @cute.jit
    def _scores(self, acc_s, sS, wg, local, s_coords, m_block, n_block, first_masked, seqlens, opts, apply_mask):
        """Key tile n_block's S: the halves summed (primitives.sum_halves), capped where softcap,
        masked where the tile needs it (from first_masked on: padding, the diagonal)."""
        sum_halves(acc_s, sS, wg, local, (HALVES_READ, HALVES_WRITTEN))
        if const_expr(self.cfg.softcap):
            cap_scores(acc_s, opts.softcap_scale)
        if n_block >= first_masked:
            apply_mask(acc_s, s_coords, m_block, n_block, seqlens[0], seqlens[1], None)

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
