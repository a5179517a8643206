"""The backward's consumer role at head_dim 192 (sm_90a): ``compute_wide``, a
mixin of ``bwd_sm90.FlashBwdSm90`` (its knobs, shared-memory tensors, pipelines and step
helpers: ``_score_operands``, ``_step_tensors``, ``_issue_scores``, ``_probs``,
``_grads``, ``_share_p_ds``, ``_store_dkv``; the dQ hand-off of ``bwd_dq_handoff``).

64 keys per CTA, both warpgroups on every key: S^T and dP^T split by query columns, dV,
dK and dQ split along head_dim, so P and dS go through shared memory.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from .layout import transpose_smem
from .sm90_common import WARPGROUP, tiled_mma, wgmma


class WideCompute:
    """Consumer warpgroups of the wide (head_dim > 128) backward."""

    @cute.jit
    def compute_wide(self, tidx, sQ, sdO, sK, sV, sdS, sdK, sdV, sdQ, pipe_kv, pipe_q, pipe_do, n_block, head_kv,
                     batch, group, m_first, span, steps, seqlen_q, seqlen_k, heads_q, sLSE2, sDsum,
                     scale, scale_log2, tma_dk, gdK, tma_dv, gdV, sP):
        """head_dim 192: 64 keys per CTA, warpgroup w takes queries [32w, 32w + 32) of S^T
        and dP^T, and head dims [w d/2, (w+1) d/2) of dV, dK and dQ. dV and dK need every
        query of P^T and dS^T, so both go through shared memory (sP, sdS: (queries, keys)):
        S^T, dP^T (async) -> P^T, dS^T -> shared, barrier -> dV, dQ, dK (async) -> stage dQ
        -> hand it to the writer warp."""
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        m_blocks = cute.ceil_div(seqlen_q, tm)
        half = d // 2
        mma_sdp = tiled_mma(self.dtype, "K", "K", (1, 2, 1), tm // 2)  # (keys, queries), k = d
        mma_dkv = tiled_mma(self.dtype, "MN", "MN", (1, 2, 1), half)  # (keys, d), k = queries
        mma_dq = tiled_mma(self.dtype, "K", "MN", (1, 1, 1), half)  # (queries, half of d), k = keys
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wg_sdp, wg_dkv = (m.get_slice(wg * WARPGROUP) for m in (mma_sdp, mma_dkv))
        thr_sdp, thr_dkv = (m.get_slice(tidx) for m in (mma_sdp, mma_dkv))
        wg_dq, thr_dq = mma_dq.get_slice(0), mma_dq.get_slice(tidx % WARPGROUP)
        score_operands = self._score_operands(mma_sdp, wg_sdp, sK, sQ, sV, sdO)
        tVrPt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sP)))
        tKrdSt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sdS)))
        tVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO)))
        tKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ)))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        sKt = transpose_smem(sK)  # (d, keys)
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(sKt, (half, tn), (wg, 0))))
        (acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, pds_copy, thr_pds, lse2_col,
         dsum_col) = self._step_tensors(tidx, mma_sdp, thr_sdp, thr_dkv, mma_dq)
        tdQ_smem = thr_dq_copy.partition_D(sdQ)  # (..., buffer)
        tP_smem = thr_pds.partition_D(transpose_smem(sP))  # P^T view: (keys, queries)
        tdS_smem = thr_pds.partition_D(transpose_smem(sdS))

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for step in cutlass.range(steps, unroll=1):
            head_q = head_kv * group + step // span
            m_block = self._m_block(step, m_first, span, m_blocks)
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            acc_dp = cute.make_rmem_tensor(s_shape, Float32)
            self._issue_scores(acc_s, acc_dp, score_operands, pipe_q, pipe_do, state,
                               s_coords, sLSE2, sDsum, lse2_col, dsum_col)
            warpgroup.wait_group(1)
            self._probs(acc_s, s_coords, lse2_col, n_block, m_block, seqlen_q, seqlen_k, scale_log2)
            p16 = cute.make_rmem_tensor_like(acc_s, self.dtype)
            p16.store(acc_s.load().to(self.dtype))
            warpgroup.wait_group(0)
            self._grads(acc_s, acc_dp, dsum_col)
            ds16 = cute.make_rmem_tensor_like(acc_dp, self.dtype)
            ds16.store(acc_dp.load().to(self.dtype))
            self._share_p_ds(pds_copy, thr_pds, p16, ds16, tP_smem, tdS_smem)
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, half)), Float32)
            wgmma(mma_dkv, acc_dv, tVrPt, tVrdOt[None, None, None, state.index], True, wait=False)
            wgmma(mma_dq, acc_dq, tQrdS, tQrKt, False, wait=False)
            wgmma(mma_dkv, acc_dk, tKrdSt, tKrQt[None, None, None, state.index], True, wait=False)
            warpgroup.wait_group(2)  # dV done: the producer may load the next dO
            pipe_do.consumer_release(state)
            warpgroup.wait_group(1)  # dQ done; dK in flight
            buffer = self._claim_dq(wg, step)  # one stage: buffer wg
            cute.copy(dq_copy, thr_dq_copy.retile(acc_dq), tdQ_smem[None, None, None, buffer])
            warpgroup.wait_group(0)  # dK done: the producer may load the next Q
            pipe_q.consumer_release(state)
            self._hand_dq(buffer)
            state.advance()
        self._store_dkv(tidx, acc_dk, acc_dv, mma_dkv, sdK, sdV, tma_dk, gdK, tma_dv, gdV, n_block, scale)
