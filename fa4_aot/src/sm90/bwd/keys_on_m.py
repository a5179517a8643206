"""The backward's consumer warpgroups at head_dim 64, 96 and 128 (sm_90a), one query tile
per step (docs/design.md, "Backward: keys on M").

128 keys per CTA, the keys on the GEMMs' M side. Per query tile of 64 rows (80 at 128 not
causal), warpgroup w (its 64 keys):
    S^T = K_w Q^T, dP^T = V_w dO^T      (keys x queries; K_w, V_w from shared memory, or
                                         registers at 64)
    P^T, dS^T = P^T (dP^T - D)          (registers: the A operands of dV and dK)
    dV_w += P^T dO, dK_w += dS^T Q
    dS^T to shared memory; dQ = dS K over all keys, split along head dims (96, 128), or
    dQ^T = K^T dS^T split along queries with K^T in registers (64), or split along head
    dims with K^T in shared memory (128 with 80-row tiles: the GEMM's M is 64 per warpgroup)
The knobs (staggered warpgroups at 96, the overlapped S^T at 64): config.BwdConfig.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..fragments import acc_as_operand_a, acc_as_rows_cols, transpose_smem
from ..primitives import DTYPES, WARPGROUP, convert_into, stage, stage_and_store, tiled_mma, wgmma
from .barriers import DS_BARRIER, EPILOGUE_BARRIER, READY_BARRIER
from ..packed_rows import store_rows
from .scores import TileAt


class Operands(NamedTuple):
    """One item's GEMMs, register fragments and copies (``KeysOnM._operands``)."""

    wg: object  # this thread's warpgroup (0, 1), warp-uniform
    mma_dkv: object
    mma_dq: object
    thr_dq: object
    score_operands: object  # (mma, K, Q, V, dO): S^T = K Q^T, dP^T = V dO^T
    tVrdOt: object
    tKrQt: object
    tVrP: object
    tKrdS: object
    tQrdS: object
    tQrKt: object
    acc_dv: object
    acc_dk: object
    s_shape: object
    s_coords: object
    dq_copy: object
    thr_dq_copy: object
    ds_copy: object
    thr_ds: object
    lse2_col: object
    dsum_col: object
    tdQ_smem: object
    tdS_smem: object
    outputs: object  # this item's dK, dV staging and coordinates (bundles.Outputs)
    m_blocks: object


class KeysOnM:
    """Consumer warpgroups of the head_dim 64, 96 and 128 backward."""

    def __init__(self, cfg, walk, scores, dq, tail):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.walk = walk
        self.scores = scores
        self.dq = dq
        self.tail = tail

    @cute.jit
    def run(self, tidx, tiles, pipes, prob, scalars, outputs, walk_state):
        """The consumers' items (``tidx``: the CTA's thread): one, or (persistent) the CTA's
        in launch order, taking the dS and dQ buffers in turn over all their steps, then
        the writer's last reads."""
        cfg, work = self.cfg, walk_state
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.kv_stages)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        consumer = tidx - WARPGROUP
        if const_expr(cfg.persistent):
            done = Int32(0)
            for index in cutlass.range(work.first, work.items, work.stride, unroll=1):
                item = self.walk.item(index, prob)
                kv_state, state = self.compute(consumer, tiles, pipes, prob, scalars, outputs, kv_state, state,
                                               item, done, None)
                done = done + item.steps
            self.dq.drain((tidx - WARPGROUP) // WARPGROUP, done)
        else:
            self.compute(consumer, tiles, pipes, prob, scalars, outputs, kv_state, state, work.item, 0, work.tail)

    @cute.jit
    def compute(self, tidx, tiles, pipes, prob, scalars, outputs, kv_state, state, item, done, tail):
        """One item (key tile) of the CTA. tidx: 0..255 over the consumer warpgroups;
        ``done``: the CTA's steps before this item (the dS and dQ buffers are taken in
        turn over all of them); ``tail``: a piece's (scheduler.Tail), or None. Returns the
        advanced pipeline states. Per query tile, in issue order:
        S^T, dP^T (async) -> P^T, dS^T in registers -> dV += P^T dO (async) -> dS to shared
        memory, barrier -> dQ = dS K (async) -> dK += dS^T Q (async) -> once dQ is done,
        stage it for the writer warp while dK runs. At head_dim 64 (overlap_scores) the
        next tile's S^T is issued behind dK (``_overlapped_step``); at 96 the warpgroups
        are staggered (config: stagger)."""
        ops = self._operands(tidx, tiles, pipes, prob, outputs, kv_state, item)
        other = 1 - ops.wg
        if const_expr(self.cfg.overlap_scores):
            steps = item.steps
            s_tile = cute.make_rmem_tensor(ops.s_shape, Float32)
            dp_tile = cute.make_rmem_tensor(ops.s_shape, Float32)
            scores = (s_tile, dp_tile)
            do_ready = cutlass.Boolean(False)  # dO's stage seen full ahead of its wait
            if steps > 0:
                self._issue_s_gemm(s_tile, ops.score_operands, pipes.q, state)
                warpgroup.wait_group(0)  # none in flight into the loop (see _overlapped_step)
            # the last step issues no next scores: the loop runs steps - 1 times, no branch
            # around a wgmma inside it
            for overlapped in cutlass.range(steps - 1, unroll=1):
                do_ready = self._overlapped_step(overlapped, done, True, do_ready, scores, ops, tiles, pipes, state, item,
                                                 prob, scalars)
                state.advance()
            if steps > 0:
                self._overlapped_step(steps - 1, done, False, do_ready, scores, ops, tiles, pipes, state, item, prob,
                                      scalars)
                state.advance()  # to the next item's first stage (persistent)
        self._loop(ops, other, tiles, pipes, state, item, prob, scalars, done)
        if const_expr(self.cfg.stagger):
            self._last_dq(ops, other, item.steps, done)
        self.finish_dkv(tidx, ops.acc_dk, ops.acc_dv, ops.mma_dkv, ops.outputs, item.n_block, scalars.scale,
                        tiles.sLSE2[None, 0], tail)
        if const_expr(self.cfg.persistent):
            # the stores have read this item's K and V stage (warp 0 waited): the producer
            # may refill it
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=2 * WARPGROUP)
            pipes.kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state, state

    @cute.jit
    def _operands(self, tidx, tiles, pipes, prob, outputs, kv_state, item):
        """The item's GEMMs, fragments, accumulators and copies; K and V waited for (and,
        at head_dim 64, read into registers, with K^T)."""
        sQ, sdO, sK, sV, sdS, sdQ, _, _ = tiles
        tma_dk, gdK, sdK, tma_dv, gdV, sdV = outputs
        pipe_kv = pipes.kv
        head_kv, batch = item.head_kv, item.batch
        d, tm, tn = self.cfg.head_dim, self.cfg.tile_m, self.cfg.tile_n
        if const_expr(self.cfg.varlen):
            # dK and dV rows of the sequence (packed_rows.PackedRows), written row by row
            gdK, gdV = (rows.at(prob.k_offset, prob.seqlen_k, head_kv) for rows in (gdK, gdV))
        else:
            gdK, gdV = gdK[None, None, head_kv, batch], gdV[None, None, head_kv, batch]
        if const_expr(self.cfg.persistent):
            # this item's K and V stage; dK and dV are staged over it at the end
            sK, sV = sK[None, None, kv_state.index], sV[None, None, kv_state.index]
            sdK, sdV = sK, sV
        m_blocks = cute.ceil_div(prob.seqlen_q, tm)
        mma_sdp = tiled_mma(self.dtype, "K", "K", (2, 1, 1), tm)  # (keys, queries), k = d
        mma_dkv = tiled_mma(self.dtype, "K", "MN", (2, 1, 1), d, a_in_registers=True)  # (keys, d), k = queries
        mma_dq = self.mma_dq()
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wg_first = wg * WARPGROUP
        wg_sdp, wg_dkv = (m.get_slice(wg_first) for m in (mma_sdp, mma_dkv))
        thr_sdp, thr_dkv = (m.get_slice(tidx) for m in (mma_sdp, mma_dkv))
        wg_dq, thr_dq = mma_dq.get_slice(0), mma_dq.get_slice(tidx % WARPGROUP)
        score_operands = self._score_operands(mma_sdp, wg_sdp, sK, sQ, sV, sdO)
        if const_expr(self.cfg.kv_in_registers):
            mma_rs = tiled_mma(self.dtype, "K", "K", (2, 1, 1), tm, a_in_registers=True)
            wg_rs = mma_rs.get_slice(wg_first)
            load_a = cute.make_tiled_copy_A(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
                mma_rs)
            thr_load_a = load_a.get_slice(tidx)
            tSrK_r = wg_rs.make_fragment_A(wg_rs.partition_shape_A((tn, d)))
            tPrV_r = wg_rs.make_fragment_A(wg_rs.partition_shape_A((tn, d)))
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ)))
        tVrP = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((tn, tm)))
        tKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((tn, tm)))
        if const_expr(self.cfg.dq_kt_in_registers):
            # dQ^T: K^T (all head dims, all keys; registers, loaded below) x dS^T (this
            # warpgroup's query rows of dS, keys contiguous: the B operand, K-major)
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(sdS, (tm // 2, tn), (wg, 0, None))))
            tQrKt = wg_dq.make_fragment_A(wg_dq.partition_shape_A((d, tn)))
        elif const_expr(self.cfg.dq_transposed):
            # dQ^T: K^T (this warpgroup's head-dim half, all keys; shared memory, d
            # contiguous: the A operand, MN-major) x dS^T (all queries of dS, K-major)
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            tQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(
                cute.local_tile(transpose_smem(sK), (self.cfg.dq_cols, tn), (wg, 0))))
        else:
            # dQ: dS (queries, all keys) x K^T (this warpgroup's head-dim half, all keys)
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(
                cute.local_tile(transpose_smem(sK), (self.cfg.dq_cols, tn), (wg, 0))))
        (acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, lse2_col,
         dsum_col) = self.step_tensors(tidx, mma_sdp, thr_sdp, thr_dkv, mma_dq)
        if const_expr(self.cfg.dq_fragment_order):
            tdQ_smem = sdQ[None, tidx % WARPGROUP, None, None]  # (4, chunk, buffer)
        else:
            tdQ_smem = thr_dq_copy.partition_D(transpose_smem(sdQ) if self.cfg.dq_transposed else sdQ)  # (..., buffer)
        tdS_smem = thr_ds.partition_D(transpose_smem(sdS))  # dS^T view: (keys, queries, stage)

        pipe_kv.consumer_wait(kv_state)
        if const_expr(self.cfg.kv_in_registers):
            cute.copy(load_a, thr_load_a.partition_S(sK), thr_load_a.retile(tSrK_r))
            cute.copy(load_a, thr_load_a.partition_S(sV), thr_load_a.retile(tPrV_r))
            _, _, tSrQ, _, tPrdO = score_operands
            score_operands = (mma_rs, tSrK_r, tSrQ, tPrV_r, tPrdO)
        if const_expr(self.cfg.dq_kt_in_registers):
            load_kt = cute.make_tiled_copy_A(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
                mma_dq)
            thr_load_kt = load_kt.get_slice(tidx % WARPGROUP)
            cute.copy(load_kt, thr_load_kt.partition_S(transpose_smem(sK)), thr_load_kt.retile(tQrKt))
        outputs = outputs._replace(gdK=gdK, sdK=sdK, gdV=gdV, sdV=sdV)
        return Operands(wg, mma_dkv, mma_dq, thr_dq, score_operands, tVrdOt, tKrQt, tVrP, tKrdS, tQrdS, tQrKt,
                        acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, lse2_col,
                        dsum_col, tdQ_smem, tdS_smem, outputs, m_blocks)

    @cute.jit
    def _loop(self, ops, other, tiles, pipes, state, item, prob, scalars, done):
        """The steps of an item (no loop at all where overlap_scores), staggered or not."""
        steps, m_first, span, n_block = item.steps, item.m_first, item.span, item.n_block
        m_blocks, scale_log2 = ops.m_blocks, scalars.scale_log2
        pipe_q, pipe_do, sLSE2, sDsum = pipes.q, pipes.do, tiles.sLSE2, tiles.sDsum
        (wg, mma_dkv, mma_dq, thr_dq, score_operands, tVrdOt, tKrQt, tVrP, tKrdS, tQrdS, tQrKt, acc_dv, acc_dk,
         s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, lse2_col, dsum_col, tdQ_smem, tdS_smem, _,
         _) = ops
        # staggered: the first tile has no dQ of a tile before it (phase 0); no branch
        # around a wgmma inside the loop.
        for phase in cutlass.range_constexpr(0 if self.cfg.overlap_scores else (2 if self.cfg.stagger else 1)):
            count = steps
            if const_expr(self.cfg.stagger):
                count = cutlass.min(steps, 1) if phase == 0 else steps - 1
            late_dq = self.cfg.stagger and phase == 1  # this tile issues the previous tile's dQ
            for i in cutlass.range(count, unroll=1):
                step = i + phase
                m_block = self.walk.m_block(step, m_first, span, m_blocks)
                ds_stage = self.walk.turn(done, step) % self.cfg.ds_stages
                acc_s = cute.make_rmem_tensor(s_shape, Float32)
                acc_dp = cute.make_rmem_tensor(s_shape, Float32)
                self._issue_scores(acc_s, acc_dp, score_operands, pipe_q, pipe_do, state,
                                   s_coords, sLSE2, sDsum, lse2_col, dsum_col)
                acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_acc_shape()), Float32)
                if const_expr(late_dq):
                    self._ready_wait(other, step - 1)
                    previous = self.walk.turn(done, step - 1) % self.cfg.ds_stages
                    self._dq_gemm(mma_dq, acc_dq, tQrdS[None, None, None, previous], tQrKt)
                    warpgroup.wait_group(2)
                else:
                    warpgroup.wait_group(1)
                # 80 query columns (stats_by_query): LSE2 and D read from shared memory where
                # used; held in registers (40 of them) they made ptxas serialize every
                # wgmma (C7512)
                by_query = self.cfg.stats_by_query
                self.scores.probs(acc_s, s_coords, sLSE2[None, state.index] if by_query else lse2_col,
                                  TileAt(n_block, m_block), prob, scalars, by_query=by_query)
                ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
                if const_expr(by_query):
                    # dS^T first, in shared memory before dV's GEMM is issued (the fence
                    # keeps the GEMM after it), and only then P^T in 16 bits: ptxas otherwise
                    # issues dV's GEMM as early as P^T allows, with the fp32 P^T, dP^T and the
                    # 16-bit P^T all live (228 registers with dV and dK), and serializes
                    # every wgmma (C7512)
                    warpgroup.wait_group(0)  # dP^T done
                    self.scores.grads(acc_s, acc_dp, sDsum[None, state.index], s_coords=s_coords, by_query=True,
                                      lse2=sLSE2[None, state.index], scale_log2=scale_log2)
                    convert_into(acc_dp, ds)
                    tKrdS.store(acc_as_operand_a(ds).load())
                    cute.copy(ds_copy, thr_ds.retile(ds), tdS_smem[None, None, None, ds_stage])
                    cute.arch.fence_proxy("async.shared", space="cta")
                    convert_into(acc_as_operand_a(acc_s), tVrP)
                    wgmma(mma_dkv, acc_dv, tVrP, tVrdOt[None, None, None, state.index], True, wait=False)
                else:
                    tVrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
                    warpgroup.wait_group(1 if late_dq else 0)  # dP^T done
                    self.scores.grads(acc_s, acc_dp, dsum_col, lse2=lse2_col, scale_log2=scale_log2)
                    wgmma(mma_dkv, acc_dv, tVrP, tVrdOt[None, None, None, state.index], True, wait=False)
                    ds.store(acc_dp.load().to(self.dtype))
                    tKrdS.store(acc_as_operand_a(ds).load())
                if const_expr(late_dq):
                    warpgroup.wait_group(1)  # the previous tile's dQ done; dV in flight
                    self.dq.stage(wg, self.walk.turn(done, step - 1), acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
                if const_expr(not by_query):
                    # dS^T in registers is the A operand of dK's GEMM; dS through shared memory
                    # is dQ's. The stage written here was last read by the dQ GEMMs two tiles
                    # ago, which both warpgroups waited for before they last said READY
                    # (staggered) or before the previous tile's barrier.
                    cute.copy(ds_copy, thr_ds.retile(ds), tdS_smem[None, None, None, ds_stage])
                    cute.arch.fence_proxy("async.shared", space="cta")
                if const_expr(self.cfg.stagger):
                    cute.arch.barrier(barrier_id=DS_BARRIER + wg, number_of_threads=WARPGROUP)
                    cute.arch.barrier_arrive(barrier_id=READY_BARRIER + 2 * wg + step % 2,
                                             number_of_threads=2 * WARPGROUP)
                    wgmma(mma_dkv, acc_dk, tKrdS, tKrQt[None, None, None, state.index], True, wait=False)
                    warpgroup.wait_group(1)  # dV done
                    pipe_do.consumer_release(state)
                else:
                    cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=2 * WARPGROUP)
                    self._dq_gemm(mma_dq, acc_dq, tQrdS[None, None, None, ds_stage], tQrKt)
                    wgmma(mma_dkv, acc_dk, tKrdS, tKrQt[None, None, None, state.index], True, wait=False)
                    warpgroup.wait_group(1)  # dV and dQ done; dK in flight
                    pipe_do.consumer_release(state)
                    self.dq.stage(wg, self.walk.turn(done, step), acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state)
                state.advance()

    @cute.jit
    def _last_dq(self, ops, other, steps, done):
        """Staggered: the last tile's dQ, which no later tile issues."""
        wg, mma_dq, thr_dq, tQrdS, tQrKt = ops.wg, ops.mma_dq, ops.thr_dq, ops.tQrdS, ops.tQrKt
        dq_copy, thr_dq_copy, tdQ_smem = ops.dq_copy, ops.thr_dq_copy, ops.tdQ_smem
        if steps > 0:  # the last tile's dQ
            self._ready_wait(other, steps - 1)
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_acc_shape()), Float32)
            last = self.walk.turn(done, steps - 1) % self.cfg.ds_stages
            self._dq_gemm(mma_dq, acc_dq, tQrdS[None, None, None, last], tQrKt)
            warpgroup.wait_group(0)
            self.dq.stage(wg, self.walk.turn(done, steps - 1), acc_dq, dq_copy, thr_dq_copy, tdQ_smem)

    @cute.jit
    def _overlapped_step(self, step, done, issue_next: cutlass.Constexpr[bool], do_ready, scores, ops, tiles, pipes,
                         state, item, prob, scalars):
        """One query tile (overlap_scores) whose S^T the step before issued: dP^T issued,
        then as ``compute``; the next tile's S^T is issued right behind this tile's dK GEMM,
        once the registers of P^T and the dQ accumulator are free, so the tensor pipe has
        it queued while dK runs and the step's bookkeeping is done. (Issuing dP^T there
        too, or before staging dQ, runs out of registers: ptxas serializes every wgmma,
        C7512.)

        The pipeline waits take a token from a try-wait issued well before (``do_ready``
        from the step before, the next Q's right after dP^T), so an mbarrier's latency is
        not paid where the wait stands. Returns the next step's dO token."""
        acc_s, acc_dp = scores
        pipe_q, pipe_do, sLSE2, sDsum = pipes.q, pipes.do, tiles.sLSE2, tiles.sDsum
        n_block, m_first, span, m_blocks = item.n_block, item.m_first, item.span, ops.m_blocks
        scale_log2 = scalars.scale_log2
        (wg, mma_dkv, mma_dq, thr_dq, score_operands, tVrdOt, tKrQt, tVrP, tKrdS, tQrdS, tQrKt, acc_dv, acc_dk,
         _, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, lse2_col, dsum_col, tdQ_smem, tdS_smem, _, _) = ops
        m_block = self.walk.m_block(step, m_first, span, m_blocks)
        ds_stage = self.walk.turn(done, step) % self.cfg.ds_stages
        mma, _, _, tPrV, tPrdO = score_operands
        following = state.clone()
        following.advance()
        pipe_do.consumer_wait(state, do_ready)
        wgmma(mma, acc_dp, tPrV, tPrdO[None, None, None, state.index], False, wait=False)
        q_ready = cutlass.Boolean(False)
        if const_expr(issue_next):
            q_ready = pipe_q.consumer_try_wait(following)
        # LSE2 read while dP^T runs, so the exponentials do not wait for shared memory; D
        # only after them (both early spilled more and measured slower causal)
        for j in cutlass.range_constexpr(cute.size(lse2_col)):
            lse2_col[j] = sLSE2[s_coords[0, j][1], state.index]
        warpgroup.wait_group(1)  # S^T done
        self.scores.probs(acc_s, s_coords, lse2_col, TileAt(n_block, m_block), prob, scalars)
        for j in cutlass.range_constexpr(cute.size(dsum_col)):
            dsum_col[j] = sDsum[s_coords[0, j][1], state.index]
        tVrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
        warpgroup.wait_group(0)  # dP^T done
        self.scores.grads(acc_s, acc_dp, dsum_col, lse2=lse2_col, scale_log2=scale_log2)
        wgmma(mma_dkv, acc_dv, tVrP, tVrdOt[None, None, None, state.index], True, wait=False)
        ds = cute.make_rmem_tensor_like(acc_dp, self.dtype)
        ds.store(acc_dp.load().to(self.dtype))
        tKrdS.store(acc_as_operand_a(ds).load())
        cute.copy(ds_copy, thr_ds.retile(ds), tdS_smem[None, None, None, ds_stage])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=DS_BARRIER, number_of_threads=2 * WARPGROUP)
        acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(self.dq_acc_shape()), Float32)
        self._dq_gemm(mma_dq, acc_dq, tQrdS[None, None, None, ds_stage], tQrKt)
        wgmma(mma_dkv, acc_dk, tKrdS, tKrQt[None, None, None, state.index], True, wait=False)
        warpgroup.wait_group(1)  # dV and dQ done; dK in flight
        pipe_do.consumer_release(state)
        self.dq.stage(wg, self.walk.turn(done, step), acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
        next_do_ready = cutlass.Boolean(False)
        if const_expr(issue_next):
            # behind dK, once P^T and the dQ accumulator are spent (registers)
            self._issue_s_gemm(acc_s, score_operands, pipe_q, following, q_ready)
            next_do_ready = pipe_do.consumer_try_wait(following)
        # dK (and the next S^T) done: a wgmma left in flight across the loop's back edge
        # makes ptxas serialize every wgmma of the kernel (C7514, measured at compile)
        warpgroup.wait_group(0)
        pipe_q.consumer_release(state)
        return next_do_ready

    @cute.jit
    def _issue_s_gemm(self, acc_s, operands, pipe_q, state, ready=None):
        """S^T of one query tile issued as its Q lands (``ready``: a try-wait's token)."""
        mma, tSrK, tSrQ, _, _ = operands
        pipe_q.consumer_wait(state, ready)
        wgmma(mma, acc_s, tSrK, tSrQ[None, None, None, state.index], False, wait=False)

    def mma_dq(self):
        """The dQ GEMM of one warpgroup: (queries, dq_cols), or transposed (d, half the
        queries) with K^T in registers, or (dq_cols, queries) with K^T in shared memory;
        k = keys."""
        if self.cfg.dq_kt_in_registers:
            return tiled_mma(self.dtype, "K", "K", (1, 1, 1), self.cfg.tile_m // 2, a_in_registers=True)
        if self.cfg.dq_transposed:
            return tiled_mma(self.dtype, "MN", "K", (1, 1, 1), self.cfg.tile_m)
        return tiled_mma(self.dtype, "K", "MN", (1, 1, 1), self.cfg.dq_cols)

    def dq_acc_shape(self):
        """The dQ GEMM's output tile: (queries, head-dim half), or transposed (d, half
        the queries) or (head-dim half, queries)."""
        if self.cfg.dq_kt_in_registers:
            return (self.cfg.head_dim, self.cfg.tile_m // 2)
        if self.cfg.dq_transposed:
            return (self.cfg.dq_cols, self.cfg.tile_m)
        return (self.cfg.tile_m, self.cfg.dq_cols)

    def _dq_gemm(self, mma_dq, acc_dq, frag_ds, frag_kt):
        """Issue dQ = dS K (dS from shared memory, K^T half too), or dQ^T = K^T dS^T (K^T
        in registers); not waited for."""
        if const_expr(self.cfg.dq_transposed):
            wgmma(mma_dq, acc_dq, frag_kt, frag_ds, False, wait=False)
        else:
            wgmma(mma_dq, acc_dq, frag_ds, frag_kt, False, wait=False)

    def _ready_wait(self, wg, step):
        """Wait until warpgroup ``wg`` has said READY for ``step`` (staggered)."""
        cute.arch.barrier(barrier_id=READY_BARRIER + 2 * wg + step % 2, number_of_threads=2 * WARPGROUP)

    def step_tensors(self, tidx, mma_sdp, thr_sdp, thr_dkv, mma_dq):
        """What both compute paths set up alike: the zeroed dV and dK accumulators, the
        S^T / dP^T fragment shape and coordinates (keys, queries), the fp32 dQ staging copy,
        the copy of dS^T (and P^T) fragments to their key-contiguous shared tiles (a
        transposing stmatrix: one instruction per four 8x8 blocks), and the registers for
        the LSE2 and D values of this thread's query columns."""
        tn, tm = self.cfg.tile_n, self.cfg.tile_m
        acc_dv = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, self.cfg.head_dim)), Float32)
        acc_dk = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, self.cfg.head_dim)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        s_shape = thr_sdp.partition_shape_C((tn, tm))
        s_coords = acc_as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((tn, tm))))
        # transposed, a thread's adjacent accumulator columns are staged in different rows
        dq_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                      num_bits_per_copy=32 if self.cfg.dq_transposed else 64)
        dq_copy = cute.make_tiled_copy_C(dq_atom, mma_dq)
        ds_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        ds_copy = cute.make_tiled_copy_C(ds_atom, mma_sdp)
        ncols = cute.size(s_coords, mode=[1])
        return (acc_dv, acc_dk, s_shape, s_coords, dq_copy, dq_copy.get_slice(tidx % WARPGROUP),
                ds_copy, ds_copy.get_slice(tidx), cute.make_rmem_tensor((ncols,), Float32),
                cute.make_rmem_tensor((ncols,), Float32))

    def _score_operands(self, mma_sdp, wg_sdp, sK, sQ, sV, sdO):
        """The wgmma of S^T = K Q^T and dP^T = V dO^T and this warpgroup's operands of both,
        all in shared memory (Q, dO staged)."""
        return (mma_sdp, wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
                wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)), wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)))

    @cute.jit
    def _issue_scores(self, acc_s, acc_dp, operands, pipe_q, pipe_do, state,
                      s_coords, sLSE2, sDsum, lse2_col, dsum_col):
        """S^T and dP^T of one query tile issued as they land (two wgmma groups), and the
        LSE2 and D values of this thread's query columns read from shared memory while
        they run. ``operands``: from _score_operands (or K and V in registers)."""
        mma, tSrK, tSrQ, tPrV, tPrdO = operands
        pipe_q.consumer_wait(state)
        wgmma(mma, acc_s, tSrK, tSrQ[None, None, None, state.index], False, wait=False)
        pipe_do.consumer_wait(state)
        wgmma(mma, acc_dp, tPrV, tPrdO[None, None, None, state.index], False, wait=False)
        if const_expr(not self.cfg.stats_by_query):
            for j in cutlass.range_constexpr(cute.size(lse2_col)):
                lse2_col[j] = sLSE2[s_coords[0, j][1], state.index]
                dsum_col[j] = sDsum[s_coords[0, j][1], state.index]

    @cute.jit
    def finish_dkv(self, tidx, acc_dk, acc_dv, mma_dkv, outputs, n_block, scale, s_word, tail):
        """dK and dV of the item's key tile (``store_dkv``), unless it is a piece of a split
        tile that does not complete the tile's sums (split_last_wave.py)."""
        last = self.tail.add_piece(tidx, acc_dk, acc_dv, s_word, tail)
        if last:
            self.store_dkv(tidx, acc_dk, acc_dv, mma_dkv, outputs, n_block, scale)

    @cute.jit
    def store_dkv(self, tidx, acc_dk, acc_dv, mma_dkv, outputs, n_block, scale):
        """dK (times the softmax scale) and dV by TMA, staged over the spent Q and dO buffers
        once both warpgroups are past their last GEMM; varlen, the staged rows that belong to
        the sequence written by every thread (packed_rows.store_rows)."""
        tma_dk, gdK, sdK, tma_dv, gdV, sdV = outputs
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=2 * WARPGROUP)
        for i in cutlass.range_constexpr(cute.size(acc_dk)):
            acc_dk[i] = acc_dk[i] * scale
        if const_expr(self.cfg.varlen):
            stage(tidx, acc_dk, self.dtype, mma_dkv, sdK)
            stage(tidx, acc_dv, self.dtype, mma_dkv, sdV)
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=2 * WARPGROUP)
            for s_tile, rows in ((sdK, gdK), (sdV, gdV)):
                store_rows(tidx, 2 * WARPGROUP, s_tile, rows, n_block * self.cfg.tile_n)
        else:
            tile = (self.cfg.tile_n, self.cfg.head_dim)
            stage_and_store(tidx, acc_dk, self.dtype, mma_dkv, sdK, tma_dk, cute.local_tile(gdK, tile, (n_block, 0)),
                            EPILOGUE_BARRIER, 2 * WARPGROUP)
            stage_and_store(tidx, acc_dv, self.dtype, mma_dkv, sdV, tma_dv, cute.local_tile(gdV, tile, (n_block, 0)),
                            EPILOGUE_BARRIER, 2 * WARPGROUP)
