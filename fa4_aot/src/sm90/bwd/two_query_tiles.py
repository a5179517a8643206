"""The backward's consumer warpgroups at head_dim 64 with two query tiles per step (not
causal; deterministic causal; causal ``.q2``), sm_90a (docs/design.md, "Backward: two
query tiles per step"); the producer's side is producer.Producer.load_two_tiles, the walk
over the pairs scheduler.TileWalk.pair.

A CTA's query tiles (64 rows; ``steps`` of them over the KV head's query heads, as for
the other head dims) are taken in pairs: step s holds tiles 2s and 2s + 1 of the CTA's
sequence, each loaded by its own TMA box into one half of a 128-row Q (dO) stage with its
64 statistics. 128 keys per CTA; warpgroup w (its 64 keys):
    S^T = K_w Q^T, dP^T = V_w dO^T      (64 keys x 128 queries; all operands in shared memory)
    P^T, dS^T = P^T (dP^T - D)          (registers: the A operands of dV and dK)
    dV_w += P^T dO, dK_w += dS^T Q      (k = 128 queries)
    dS^T to shared memory; dQ of tile 2s + w = dS[64 w:64 w + 64, :] K over all keys
and stages that whole tile for the writer warp in fragment order (which adds tile by
tile, one 1D bulk reduce each: dq_writer.py).
Within a step dS^T is written to shared memory before P^T is made 16-bit and dV's GEMM
issued, and fenced only after that issue, so the fence's wait overlaps dV (see
compute_wide).
With an odd number of tiles the last step's second half is loaded from past the end of
Q and dO (TMA fills zeros) with the first half's statistics: its S^T, P^T, dS^T stay
finite and add nothing to dV and dK (its Q and dO are zero), and its dQ is not staged.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..fragments import acc_as_operand_a, transpose_smem
from ..primitives import DTYPES, WARPGROUP, convert_into, tiled_mma, wgmma
from .barriers import DS_BARRIER
from .scores import TileAt


class TwoQueryTiles:
    """Consumer warpgroups of the head_dim 64 backward with two query tiles per step."""

    def __init__(self, cfg, walk, scores, dq, keys_on_m):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.walk = walk
        self.scores = scores
        self.dq = dq
        self.keys = keys_on_m  # its accumulators' setup and dK, dV epilogue

    @cute.jit
    def run(self, tidx, tiles, pipes, prob, scalars, outputs, walk_state):
        """The CTA's one item (``tidx``: the CTA's thread; ``walk_state``: the scheduler's
        CtaWork)."""
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.kv_stages)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        self.compute(tidx - WARPGROUP, tiles, pipes, prob, scalars, outputs, kv_state, state, walk_state.item,
                     walk_state.tail)

    @cute.jit
    def compute(self, tidx, tiles, pipes, prob, scalars, outputs, kv_state, state, item, tail):
        """One CTA (key tile; ``tail``: a piece's, scheduler.Tail, or None). tidx: 0..255
        over the consumer warpgroups. Per step, in issue order: S^T, dP^T (async) -> P^T,
        dS^T in registers -> dV += P^T dO (async) -> dS to shared memory, barrier -> dQ of
        this warpgroup's tile (async) -> dK += dS^T Q (async) -> once dQ is done, stage it
        for the writer while dK runs."""
        ops = self._operands(tidx, tiles, prob, outputs, item)
        sLSE2, sDsum = tiles.sLSE2, tiles.sDsum
        pipe_kv, pipe_q, pipe_do = pipes
        n_block, head_kv, _, m_first, span, steps = item
        group, scale_log2 = prob.group, scalars.scale_log2
        d, tm = self.cfg.head_dim, self.cfg.tile_m
        (m_blocks, wg, mma_sdp, mma_dkv, mma_dq, thr_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt, tQrdS, tQrKt,
         acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, tdQ_smem, tdS_smem, outputs) = ops
        pipe_kv.consumer_wait(kv_state)
        head_off, tile_off = Int32(0), Int32(0)
        for step in cutlass.range(cute.ceil_div(steps, 2), unroll=1):
            _, m_a, _, m_b, real = self.walk.pair(step, head_off, tile_off, m_first, span, m_blocks, steps, head_kv, group)
            head_off, tile_off = self.walk.next_pair(head_off, tile_off, span)
            ds_stage = step % self.cfg.ds_stages
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
            at = TileAt(n_block, m_a, m_b if const_expr(self.cfg.masked) else None)
            self.scores.probs(acc_s, s_coords, sLSE2[None, state.index], at, prob, scalars, by_query=True)
            warpgroup.wait_group(0)  # dP^T done
            self.scores.grads(acc_s, acc_dp, sDsum[None, state.index], s_coords=s_coords, by_query=True,
                              lse2=sLSE2[None, state.index], scale_log2=scale_log2)
            # dS^T to shared memory before P^T is made 16-bit and dV's GEMM issued (fewer
            # registers live: with the fp32 and 16-bit P^T and dP^T all live ptxas serialized
            # every wgmma, C7512), and its fence after that issue: fenced before, dV waited
            # for the stores (4% of the loop's samples). The stage written here
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
                self.dq.stage(0, 2 * step + wg, acc_dq, dq_copy, thr_dq_copy, tdQ_smem)
            warpgroup.wait_group(0)
            pipe_q.consumer_release(state)
            state.advance()
        self.keys.finish_dkv(tidx, acc_dk, acc_dv, mma_dkv, outputs, n_block, scalars.scale, sLSE2[None, 0], tail)
        kv_state.advance()
        return kv_state, state

    @cute.jit
    def _operands(self, tidx, tiles, prob, outputs, item):
        """The item's GEMMs, fragments, accumulators and copies (as ``compute`` unpacks them)."""
        sQ, sdO, sK, sV, sdS, sdQ, _, _ = tiles
        head_kv, batch, seqlen_q = item.head_kv, item.batch, prob.seqlen_q
        gdK, gdV = outputs.gdK, outputs.gdV
        d, tm, tn, rows = self.cfg.head_dim, self.cfg.tile_m, self.cfg.tile_n, self.cfg.step_rows
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
         _) = self.keys.step_tensors(tidx, mma_sdp, thr_sdp, thr_dkv, mma_dq)
        tdQ_smem = sdQ[None, tidx % WARPGROUP, None, None]  # fragment order: (4, chunk, buffer)
        tdS_smem = thr_ds.partition_D(transpose_smem(sdS))  # dS^T view: (keys, queries, stage)

        return (m_blocks, wg, mma_sdp, mma_dkv, mma_dq, thr_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt, tQrdS, tQrKt,
                acc_dv, acc_dk, s_shape, s_coords, dq_copy, thr_dq_copy, ds_copy, thr_ds, tdQ_smem, tdS_smem,
                outputs._replace(gdK=gdK, gdV=gdV))
