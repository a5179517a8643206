"""The backward's consumer warpgroups at head_dim 192 and 256 (sm_90a; docs/design.md,
"Backward: head dim on M").

n consumer warpgroups (three at 192, two at 256), each owning d/n head dims (64 or 128)
and tn/n keys (96 or 80 keys per CTA). Per query tile of 64 rows, warpgroup w:
    S = Q K_w^T, dP = dO V_w^T          (queries x its tn/n keys; SS-wgmma)
    P, dS = P (dP - D)                  (to shared memory, (keys, queries), every warpgroup's keys)
    dV_w^T += dO_w^T P, dK_w^T += Q_w^T dS    (its head dims x all keys)
    dQ_w^T = K_w^T dS^T                 (its head dims x 64 queries, in 64-row chunks)
With v narrower than q (192/128: ``head_dim_v``), dP's k is v's head dim and only the
first head_dim_v / (d/n) warpgroups own dV rows (the third at 192/128 computes none).
The head dim is the M side of the last three GEMMs (which is what lets a CTA take 80 or 96
keys: wgmma's M is a multiple of 64 per warpgroup, its N only of 8). Against 64 keys with
the keys on M (the layout of the other head dims), a step moves fewer shared-memory bytes
per FLOP (K and V are read by every warpgroup, but Q and dO are amortized over more keys)
and the dQ reduces carry fewer bytes per FLOP (20% at 256, 33% at 192).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..fragments import acc_as_rows_cols, transpose_smem
from ..primitives import DTYPES, WARPGROUP, tiled_mma, wgmma
from .barriers import DS_BARRIER, EPILOGUE_BARRIER
from ..packed_rows import store_rows
from .scores import TileAt


class HeadOnM:
    """Consumer warpgroups of the head_dim 192 and 256 backward."""

    def __init__(self, cfg, walk, scores, dq):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.walk = walk
        self.scores = scores
        self.dq = dq

    @cute.jit
    def run(self, tidx, tiles, sP, pipes, prob, scalars, outputs, walk_state):
        """The CTA's one item (``tidx``: the CTA's thread); dK and dV are staged over the
        spent K and V (tiles of the same shape)."""
        item = walk_state.item
        consumer = tidx - WARPGROUP
        if const_expr(self.cfg.varlen):
            # dK and dV rows of the sequence (packed_rows.PackedRows), written row by row
            gdK = outputs.gdK.at(prob.k_offset, prob.seqlen_k, item.head_kv)
            gdV = outputs.gdV.at(prob.k_offset, prob.seqlen_k, item.head_kv)
        else:
            gdK = outputs.gdK[None, None, item.head_kv, item.batch]
            gdV = outputs.gdV[None, None, item.head_kv, item.batch]
        self.compute(consumer, tiles, sP, pipes, prob, scalars, outputs._replace(gdK=gdK, gdV=gdV), item)

    @cute.jit
    def compute(self, tidx, tiles, sP, pipes, prob, scalars, outputs, item):
        """tidx: over the consumer warpgroups (0..128 n). sQ, sdO: (queries, d, stages); sK,
        sV: (keys, d); sP, sdS: (keys, queries); sdQ: (queries, 64 head dims, dq_slots) fp32.
        Per query tile: S, dP (async) -> P, dS -> shared, barrier -> dV, dK, dQ chunk 0
        (async) -> release dO once dV is done, Q once dK is -> stage dQ chunk 0 -> the
        warpgroup's other chunks (one at 256, none at 192), each staged."""
        sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDsum = tiles
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, m_first, span, steps = item.n_block, item.m_first, item.span, item.steps
        seqlen_q, scale_log2 = prob.seqlen_q, scalars.scale_log2
        tm = self.cfg.tile_m
        (m_blocks, wg, chunks, chunk, mma_sdp, mma_dkv, mma_dq, thr_dq, tSrQ, tSrK, tPrdO, tPrV, tVrdOt, tKrQt, tVrP, tKrdS,
         tQrKt, tQrdS, acc_dv, acc_dk, s_shape, s_coords, nrows, lse2_row, dsum_row, pds_copy, thr_pds, tP_smem,
         tdS_smem, dq_copy, thr_dq_copy, tdQ_smem) = self._operands(tidx, tiles, sP, seqlen_q)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        for step in cutlass.range(steps, unroll=1):
            m_block = self.walk.m_block(step, m_first, span, m_blocks)
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            acc_dp = cute.make_rmem_tensor(s_shape, Float32)
            pipe_q.consumer_wait(state)
            wgmma(mma_sdp, acc_s, tSrQ[None, None, None, state.index], tSrK, False, wait=False)
            pipe_do.consumer_wait(state)
            wgmma(mma_sdp, acc_dp, tPrdO[None, None, None, state.index], tPrV, False, wait=False)
            for r in cutlass.range_constexpr(nrows):
                lse2_row[r] = sLSE2[s_coords[r, 0][0], state.index]
                dsum_row[r] = sDsum[s_coords[r, 0][0], state.index]
            warpgroup.wait_group(1)
            self.scores.probs(acc_s, s_coords, lse2_row, TileAt(n_block, m_block), prob, scalars, True)
            p16 = cute.make_rmem_tensor_like(acc_s, self.dtype)
            p16.store(acc_s.load().to(self.dtype))
            warpgroup.wait_group(0)
            self.scores.grads(acc_s, acc_dp, dsum_row, True, lse2=lse2_row, scale_log2=scale_log2)
            ds16 = cute.make_rmem_tensor_like(acc_dp, self.dtype)
            ds16.store(acc_dp.load().to(self.dtype))
            self._share_p_ds(pds_copy, thr_pds, p16, ds16, tP_smem, tdS_smem)
            # dV, then dK, then the dQ chunks: Q and dO have one buffer each, so the next
            # tile's loads start only once the GEMMs reading them are done; releasing dO
            # after dV and Q after dK, before any dQ GEMM, measured +15% over dQ chunk 0
            # issued first (docs/design.md, "Backward: head dim on M").
            if self._owns_dv(wg):  # the others' wait_group(2) below waits for nothing
                wgmma(mma_dkv, acc_dv, tVrdOt[None, None, None, state.index], tVrP, True, wait=False)
            wgmma(mma_dkv, acc_dk, tKrQt[None, None, None, state.index], tKrdS, True, wait=False)
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((chunk, tm)), Float32)
            wgmma(mma_dq, acc_dq, tQrKt[0], tQrdS, False, wait=False)
            warpgroup.wait_group(2)  # dV done: the producer may load the next dO
            pipe_do.consumer_release(state)
            warpgroup.wait_group(1)  # dK done: the producer may load the next Q
            pipe_q.consumer_release(state)
            for c in cutlass.range_constexpr(chunks):
                if const_expr(c > 0):
                    acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((chunk, tm)), Float32)
                    wgmma(mma_dq, acc_dq, tQrKt[c], tQrdS, False, wait=False)
                warpgroup.wait_group(0)
                self.dq.stage(wg * chunks + c, step, acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
            state.advance()
        self._store_dkv_transposed(tidx, acc_dk, acc_dv, mma_dkv, sK, sV, outputs, n_block, scalars.scale)


    def _dv_owners(self) -> int:
        """The warpgroups that own dV rows (head dims of v): all but where v is narrower."""
        return self.cfg.head_dim_v // (self.cfg.head_dim // self.cfg.num_consumers)

    def _every_wg_owns_dv(self) -> bool:
        return self._dv_owners() == self.cfg.num_consumers

    def _dv_row_block(self, wg):
        """Warpgroup ``wg``'s block of dV rows, clamped into v's head dims (the address of
        a block the warpgroups past them never use)."""
        return wg if self._every_wg_owns_dv() else cutlass.min(wg, self._dv_owners() - 1)

    def _owns_dv(self, wg):
        """Whether warpgroup ``wg`` owns dV rows: True (a Python constant, no branch) where
        every one does, else a run-time test."""
        return True if self._every_wg_owns_dv() else wg < self._dv_owners()

    @cute.jit
    def _operands(self, tidx, tiles, sP, seqlen_q):
        """The item's GEMMs, fragments, accumulators and copies (as ``compute`` unpacks them)."""
        sQ, sdO, sK, sV, sdS, sdQ, _, _ = tiles
        d, tm, tn, nc = self.cfg.head_dim, self.cfg.tile_m, self.cfg.tile_n, self.cfg.num_consumers
        own, chunk = d // nc, self.cfg.dq_chunk  # own: the head dims of one warpgroup
        chunks = own // chunk
        m_blocks = cute.ceil_div(seqlen_q, tm)
        mma_sdp = tiled_mma(self.dtype, "K", "K", (1, nc, 1), tn // nc)  # (queries, keys), k = d
        mma_dkv = tiled_mma(self.dtype, "MN", "K", (1, 1, 1), tn)  # (d, keys) of one warpgroup, k = queries
        mma_dq = tiled_mma(self.dtype, "MN", "MN", (1, 1, 1), tm)  # (d chunk, queries), k = keys
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        local = tidx % WARPGROUP
        wg_sdp, thr_sdp = mma_sdp.get_slice(wg * WARPGROUP), mma_sdp.get_slice(tidx)
        wg_dkv, thr_dkv = mma_dkv.get_slice(0), mma_dkv.get_slice(local)
        wg_dq, thr_dq = mma_dq.get_slice(0), mma_dq.get_slice(local)
        # S and dP: A = Q, dO (queries, d; staged), B = this warpgroup's keys of K, V
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV^T, dK^T: A = dO^T, Q^T (this warpgroup's head dims, queries), B = P, dS
        # (keys, queries)
        mine = (own, tm)
        wg_v = self._dv_row_block(wg)
        tVrdOt = wg_dkv.make_fragment_A(wg_dkv.partition_A(cute.local_tile(transpose_smem(sdO), mine, (wg_v, 0, None))))
        tKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(cute.local_tile(transpose_smem(sQ), mine, (wg, 0, None))))
        tVrP = wg_dkv.make_fragment_B(wg_dkv.partition_B(sP))
        tKrdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(sdS))
        # dQ^T chunk c: A = K^T (head dims [(chunks w + c) 64, ...), keys), B = dS^T (queries, keys)
        sKt = transpose_smem(sK)
        tQrKt = [wg_dq.make_fragment_A(wg_dq.partition_A(cute.local_tile(sKt, (chunk, tn), (wg * chunks + c, 0))))
                 for c in range(chunks)]
        tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sdS)))

        acc_dv = cute.make_rmem_tensor(thr_dkv.partition_shape_C((own, tn)), Float32)
        acc_dk = cute.make_rmem_tensor(thr_dkv.partition_shape_C((own, tn)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        s_shape = thr_sdp.partition_shape_C((tm, tn))
        s_coords = acc_as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((tm, tn))))  # (query, key)
        nrows = cute.size(s_coords, mode=[0])
        lse2_row = cute.make_rmem_tensor((nrows,), Float32)
        dsum_row = cute.make_rmem_tensor((nrows,), Float32)
        # P and dS to shared memory as (keys, queries) tiles (queries contiguous, in the
        # 128-byte swizzle: rows of 80 keys would take the 32-byte one, whose 16-key atoms
        # a warpgroup's 40 keys do not divide), by transposing stmatrix, two 8x8 blocks at
        # a time (a warp's 16 x 40 fragment is ten, 16 x 32 eight)
        pds_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=2), self.dtype),
            mma_sdp)
        thr_pds = pds_copy.get_slice(tidx)
        tP_smem, tdS_smem = thr_pds.partition_D(transpose_smem(sP)), thr_pds.partition_D(transpose_smem(sdS))
        # dQ^T (d, queries) staged as (queries, d): a thread's adjacent accumulator
        # columns are different query rows, so 32 bits at a time
        dq_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=32), mma_dq)
        thr_dq_copy = dq_copy.get_slice(local)
        tdQ_smem = thr_dq_copy.partition_D(transpose_smem(sdQ))  # (..., buffer)

        return (m_blocks, wg, chunks, chunk, mma_sdp, mma_dkv, mma_dq, thr_dq, tSrQ, tSrK, tPrdO, tPrV, tVrdOt, tKrQt, tVrP, tKrdS,
                tQrKt, tQrdS, acc_dv, acc_dk, s_shape, s_coords, nrows, lse2_row, dsum_row, pds_copy, thr_pds, tP_smem,
                tdS_smem, dq_copy, thr_dq_copy, tdQ_smem)

    def _share_p_ds(self, pds_copy, thr_pds, p16, ds16, tP_smem, tdS_smem):
        """P and dS (16-bit fragments) to their single shared buffers, between the consumer
        warpgroups' barriers: the first orders the write after every warpgroup's GEMMs of
        the previous step (waited for at its end), the second the GEMMs after the write."""
        threads = self.cfg.num_consumers * WARPGROUP
        cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=threads)
        cute.copy(pds_copy, thr_pds.retile(p16), tP_smem)
        cute.copy(pds_copy, thr_pds.retile(ds16), tdS_smem)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=threads)

    @cute.jit
    def _store_dkv_transposed(self, tidx, acc_dk, acc_dv, mma_dkv, sK, sV, outputs, n_block, scale):
        """dK (times the softmax scale) and dV, each warpgroup's (head dims, keys) fragment
        written transposed (stmatrix) into the spent K and V tiles, then one TMA store each."""
        tma_dk, gdK, _, tma_dv, gdV, _ = outputs
        # K and V no longer read
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_consumers * WARPGROUP)
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            acc_dk[i] = acc_dk[i] * scale
        store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            mma_dkv)
        thr = store.get_slice(tidx % WARPGROUP)
        mine = (self.cfg.head_dim // self.cfg.num_consumers, self.cfg.tile_n)
        staged_dk = cute.make_rmem_tensor_like(acc_dk, self.dtype)
        staged_dk.store(acc_dk.load().to(self.dtype))
        cute.copy(store, thr.retile(staged_dk), thr.partition_D(cute.local_tile(transpose_smem(sK), mine, (wg, 0))))
        staged_dv = cute.make_rmem_tensor_like(acc_dv, self.dtype)
        staged_dv.store(acc_dv.load().to(self.dtype))
        if self._owns_dv(wg):  # v's head dims: the first warpgroups' rows
            cute.copy(store, thr.retile(staged_dv),
                      thr.partition_D(cute.local_tile(transpose_smem(sV), mine, (self._dv_row_block(wg), 0))))
        if const_expr(self.cfg.varlen):
            # the sequence's rows of the staged tiles, by every consumer thread
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_consumers * WARPGROUP)
            for s_tile, rows in ((sK, gdK), (sV, gdV)):
                store_rows(tidx, self.cfg.num_consumers * WARPGROUP, s_tile, rows, n_block * self.cfg.tile_n)
        else:
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=self.cfg.num_consumers * WARPGROUP)
            if cute.arch.make_warp_uniform(tidx // 32) == 0:
                for atom, s_tile, g, width in ((tma_dk, sK, gdK, self.cfg.head_dim),
                                               (tma_dv, sV, gdV, self.cfg.head_dim_v)):
                    s_part, g_part = cpasync.tma_partition(
                        atom, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
                        cute.group_modes(cute.local_tile(g, (self.cfg.tile_n, width), (n_block, 0)), 0, 2))
                    cute.copy(atom, s_part, g_part)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
