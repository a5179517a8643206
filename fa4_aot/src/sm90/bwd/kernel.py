"""FlashAttention backward for Hopper (sm_90a): three kernels launched in order.

1. ``preprocess`` (pre_post.py): D = rowsum(dO * O) in fp32, LSE moved to the exp2
   domain, the dQ semaphores cleared, and the fp32 dQ accumulator unless ``first_write``.
2. ``kernel`` (this file): one CTA per (key tile, KV head, batch) item, or a persistent or
   split-tail walk over them (scheduler.py). K and V stay in shared memory while the
   steps visit the query tiles of every query head of the KV head's group. Roles:
   - warp 0, the producer (producer.py): K and V, then per step dO and Q with their D
     and LSE2 values, on TMA pipelines;
   - consumer warpgroups: S^T = K Q^T, dP^T = V dO^T, P^T = exp2(S^T scale log2(e) -
     LSE2), dS^T = P^T (dP^T - D) (scores.py), dV += P^T dO, dK += dS^T Q, dQ = dS K,
     in one of three loop shapes picked by the config: keys on M (keys_on_m.py: head
     dims 64, 96, 128), two query tiles per step (two_query_tiles.py: head dim 64),
     head dim on M (head_on_m.py: 192, 256); dK and dV written once by TMA, or, for a
     piece of a split tile, summed with the other pieces first (split_last_wave.py);
   - warp 1, the dQ writer (dq_writer.py): each staged dQ share added into the fp32
     accumulator by a bulk reduce, in a fixed order when deterministic.
3. ``postprocess`` (pre_post.py): dQ = accumulator * scale in the input dtype.
4. local, where the call has sinks: ``sink_grad`` (pre_post.py), the sinks' gradient from
   the preprocess's partial sums.

Kernels 2 and 3 are launched with programmatic stream serialization (the manifest's
``programmatic``): each may start once every block of the one before has; the main
kernel waits (griddepcontrol.wait) before it reads what the preprocess writes, and a
postprocess block waits only for its head's key tiles (``dq_done`` counts). GQA/MQA: a
CTA loops over the query heads of its KV head, so dK and dV of a shared head sum every
query head's contribution in registers, in a fixed order.

Every knob is the config's (config.BwdConfig); how each loop works and why:
docs/design.md, "Backward (sm90)".
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from ...common import lpt, symbols
from ..primitives import DTYPES, WARPGROUP, sdhb, smem_buffer, smem_layout, tma_pipeline
from ...common.params import Tma
from ...interfaces import BWD_INPUTS, BWD_MAIN, BWD_LPT, BWD_POSTPROCESS, BWD_PREPROCESS, BWD_SINK
from .bundles import DqTarget, Inputs, Outputs, Pipes, Scalars, Start, Stats, Tiles
from .config import PRODUCER_REGS, BwdConfig
from .dq_writer import DQ_WRITER_WARP, DqBuffers, DqWriter
from .head_on_m import HeadOnM
from .keys_on_m import KeysOnM
from .pre_post import DqFragments, PrePostSm90
from ..packed_rows import PackedRows
from .producer import Producer
from .scheduler import Sequences, TileWalk, varlen_grid_x
from .scores import ScoreMath
from .split_last_wave import SplitLastWave
from .two_query_tiles import TwoQueryTiles


class FlashBwdSm90:
    """One backward variant (its ``config.BwdConfig``): the host side (layouts, TMA atoms,
    shared storage, the three launches) and the main kernel, which hands each warp role
    its bundles."""

    def __str__(self):
        return symbols.BACKWARD_SM90  # the cubin's kernel names (common/symbols.py)

    def __init__(self, cfg: BwdConfig):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.walk = TileWalk(cfg)
        self.dq = DqBuffers(cfg)
        tail = SplitLastWave()
        self.producer = Producer(cfg, self.walk)
        self.dq_writer = DqWriter(cfg, self.walk, self.dq, tail)
        scores = ScoreMath(cfg)
        keys_on_m = KeysOnM(cfg, self.walk, scores, self.dq, tail)
        if cfg.head_on_m:
            self.consumer = HeadOnM(cfg, self.walk, scores, self.dq)
        elif cfg.two_query_tiles:
            self.consumer = TwoQueryTiles(cfg, self.walk, scores, self.dq, keys_on_m)
        else:
            self.consumer = keys_on_m
        fragments = None
        if cfg.dq_fragment_order:
            fragments = DqFragments(keys_on_m.mma_dq, keys_on_m.dq_acc_shape(), cfg.dq_transposed, cfg.dq_parts)
        self.pre_post = PrePostSm90(cfg, fragments)
        self.tma_boxes = {}
        self.smem_bytes = None

    def _storage(self, s_q, s_do, s_kv, s_v, s_ds, s_dq):
        def buf(layout, dtype=self.dtype):
            return smem_buffer(layout, dtype)

        stages, p_in_smem = self.cfg.stages, self.cfg.head_on_m
        stats = cute.struct.Align[cute.struct.MemRange[Float32, self.cfg.step_rows * stages], 128]

        @cute.struct
        class Storage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.cfg.kv_stages]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sLSE2: stats  # (tile_m, stages), with Q's stages
            sDsum: stats  # (tile_m, stages), with dO's stages
            sK: buf(s_kv)  # (tile_n, d[, kv_stages])
            sV: buf(s_v)  # (tile_n, d_v[, kv_stages])
            sQ: buf(s_q)  # also dK's staging tile (persistent: over K)
            sdO: buf(s_do)  # (step_rows, d_v, stages); also dV's staging tile (persistent: over V)
            sdS: buf(s_ds)  # (tile_m, tile_n, ds_stages); head_on_m: (tile_n, tile_m)
            if p_in_smem:
                sP: buf(s_ds)  # (tile_m, tile_n)
            sdQ: buf(s_dq, Float32)  # (*dq_tile, dq_slots) fp32 staging

        return Storage

    @cute.jit
    def __call__(self, x: BWD_INPUTS.tuple_type):
        """The launches of one backward (interfaces.BWD_INPUTS): the preprocess, the main
        kernel, the postprocess; varlen, first the heaviest-first sort (one CTA; the run
        time leaves it out where lpt is 0). Varlen, the pre- and postprocess take one block per
        (query tile of a sequence, head), the main kernel one CTA per (key tile of a
        sequence, KV head), the sequences' tiles back to back (grids of ceil(total / tile)
        + b, which bound every sequence's tiles while the sequences do not overlap); every
        main-kernel CTA counts itself in ``ctas_done`` as it ends, so a postprocess block
        waiting for key tiles that lying metadata left past the grid stops once the grid
        has ended."""
        cfg = self.cfg
        q, k, v, do, dq_acc = [sdhb(t) for t in (x.q, x.k, x.v, x.dout, x.dq_accum)]
        dk, dv = (None, None) if const_expr(cfg.varlen) else (sdhb(x.dk), sdhb(x.dv))
        if const_expr(cfg.varlen):
            pre_post_grid = (cute.ceil_div(x.total_q, cfg.tile_m) + x.batch, x.heads_q, 1)
            self.order_varlen(BWD_LPT.bind(cfg, x)).launch(
                grid=[1, 1, 1], block=[lpt.THREADS, 1, 1], smem=lpt.SMEM_BYTES
            )
            self.pre_post.preprocess_varlen(BWD_PREPROCESS.bind(cfg, x)).launch(
                grid=pre_post_grid, block=[self.pre_post.threads, 1, 1])
        else:
            pre_post_grid = (cute.ceil_div(x.seqlen_q, cfg.tile_m), x.heads_q, q.shape[3])
            self.pre_post.preprocess(BWD_PREPROCESS.bind(cfg, x)).launch(grid=pre_post_grid, block=[self.pre_post.threads, 1, 1])

        tma, layouts = self._main_atoms(q, k, v, do, dk, dv, dq_acc)
        params = BWD_MAIN.bind(cfg, x, tma)
        if const_expr(cfg.varlen):
            grid = (varlen_grid_x(k.shape[0], x.batch, cfg.tile_n), k.shape[2], 1)
            self.kernel_varlen(params, *layouts).launch(
                grid=grid, block=[cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1)
            self.pre_post.postprocess_varlen(BWD_POSTPROCESS.bind(cfg, x)).launch(
                grid=pre_post_grid, block=[self.pre_post.threads, 1, 1], smem=self.pre_post.post_smem_bytes)
        else:
            grid = (cute.ceil_div(k.shape[0], cfg.tile_n), k.shape[2], k.shape[3])
            self.kernel(params, *layouts).launch(
                grid=grid, block=[cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1)
            self.pre_post.postprocess(BWD_POSTPROCESS.bind(cfg, x)).launch(
                grid=pre_post_grid, block=[self.pre_post.threads, 1, 1], smem=self.pre_post.post_smem_bytes)
        if const_expr(cfg.local):
            # where use_sink (the run time leaves it out otherwise): the sinks' gradient
            self.pre_post.sink_grad(BWD_SINK.bind(cfg, x)).launch(grid=[x.heads_q, 1, 1], block=[32, 1, 1])

    @cute.kernel
    def order_varlen(self, p: BWD_LPT.tuple_type):
        """The sequences sorted by cost, heaviest first (common/lpt.py: the
        (key tile, query tile) pairs of their key tiles, causal-aware), for kernel_varlen's
        walk. Launched before the preprocess, not programmatically: the main kernel reads
        the order before its griddepcontrol.wait, as it reads the metadata."""
        lpt.sort_sequences(p, self.cfg.tile_m, self.cfg.tile_n, self.cfg.causal, keys_outer=True)

    def _main_atoms(self, q, k, v, do, dk, dv, dq_acc):
        """The main kernel's TMA atoms and coordinate tensors as {name: Tma} (q, do, k, v;
        dk, dv but varlen; the dQ accumulator's reduce and store but in fragment order), and
        its shared layouts (q, do, kv, v, ds, dq); sets the storage, shared bytes and the boxes for
        the manifest's tensor maps. Tensors (s, d, h, b)."""
        cfg = self.cfg
        d, d_v = cfg.head_dim, cfg.head_dim_v
        s_q_tile, s_do_tile = (smem_layout(self.dtype, cfg.step_rows, w, cfg.stages, cfg.col_parts) for w in (d, d_v))
        # one query tile: the TMA box (wide: each stage holds two, loaded apart)
        s_q_one, s_do_one = (smem_layout(self.dtype, cfg.tile_m, w, col_parts=cfg.col_parts) for w in (d, d_v))
        s_kv, s_v = (smem_layout(self.dtype, cfg.tile_n, w, col_parts=cfg.col_parts) for w in (d, d_v))
        s_kv_all, s_v_all = s_kv, s_v
        if const_expr(cfg.persistent):
            s_kv_all, s_v_all = (smem_layout(self.dtype, cfg.tile_n, w, cfg.kv_stages, cfg.col_parts) for w in (d, d_v))
        if const_expr(self.cfg.head_on_m):
            s_ds = smem_layout(self.dtype, self.cfg.tile_n, self.cfg.tile_m)  # (keys, queries)
        else:
            s_ds = smem_layout(self.dtype, self.cfg.step_rows, self.cfg.tile_n, self.cfg.ds_stages)  # (queries, keys, stage)
        s_dq = smem_layout(Float32, *self.cfg.dq_tile, self.cfg.dq_slots)
        s_dq_one = cute.select(s_dq, mode=[0, 1])
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        m, n = cfg.tile_m, cfg.tile_n
        loads = (("q", q, s_q_one, (m, d)), ("dout", do, s_do_one, (m, d_v)), ("k", k, s_kv, (n, d)),
                 ("v", v, s_v, (n, d_v)))
        tma = {name: Tma(*cpasync.make_tiled_tma_atom(load, t, box, tile)) for name, t, box, tile in loads}
        boxes = {name: box for name, _, box, _ in loads}
        if const_expr(dk is not None):  # varlen: dK and dV written row by row (packed_rows.py)
            for name, t, box, tile in (("dk", dk, s_kv, (n, d)), ("dv", dv, s_v, (n, d_v))):
                tma[name] = Tma(*cpasync.make_tiled_tma_atom(store, t, box, tile))
                boxes[name] = box
        # fragment order: 1D bulk reduces (and stores) at dq_accum's address instead
        if const_expr(not self.cfg.dq_fragment_order):
            tma["dq_accum"] = Tma(*cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), dq_acc, s_dq_one, self.cfg.dq_tile))
            boxes["dq_accum"] = s_dq_one
            # a tile's first dQ share is stored (first_write); same tensor map (the
            # operation is the instruction's, not the map's): the manifest encodes it
            # from dq_accum's recipe, and compile checks that the two atoms agree
            tma["dq_accum_store"] = Tma(*cpasync.make_tiled_tma_atom(store, dq_acc, s_dq_one, self.cfg.dq_tile))
            self.dq_store_box = (str(tma["dq_accum_store"].atom.type), str(s_dq_one.inner))
        self.tma_boxes = {name: (str(tma[name].atom.type), str(box.inner)) for name, box in boxes.items()}
        self.q_bytes = cute.size_in_bytes(self.dtype, s_q_one)
        self.do_bytes = cute.size_in_bytes(self.dtype, s_do_one)
        self.kv_bytes = cute.size_in_bytes(self.dtype, s_kv) + cute.size_in_bytes(self.dtype, s_v)
        self.storage = self._storage(s_q_tile, s_do_tile, s_kv_all, s_v_all, s_ds, s_dq)
        self.smem_bytes = self.storage.size_in_bytes() + 1024
        return tma, (s_q_tile, s_do_tile, s_kv_all, s_v_all, s_ds, s_dq)

    # ------------------------------------------------------------------ main kernel
    @cute.kernel
    def kernel(self, p: BWD_MAIN.tuple_type, sq_layout: cute.ComposedLayout, sdo_layout: cute.ComposedLayout,
               skv_layout: cute.ComposedLayout, sv_layout: cute.ComposedLayout, sds_layout: cute.ComposedLayout,
               sdq_layout: cute.ComposedLayout):
        """One CTA of the dense main kernel (interfaces.BWD_MAIN): TMA coordinates (s, d, h, b);
        the dQ accumulator reduced into by TMA, or in fragment order by address; the
        statistics (b, h_q, s_q padded to tile_m); the semaphores, per-head counts and the
        split last wave's counters and partial sums (split_last_wave.py)."""
        (tma_q, gQ), (tma_do, gdO), (tma_k, gK), (tma_v, gV), (tma_dk, gdK), (tma_dv, gdV) = (
            p.q, p.dout, p.k, p.v, p.dk, p.dv)
        tma_dq, gdQacc = (None, None) if p.dq_accum is None else p.dq_accum  # None in fragment order
        tma_dq_store, dqacc_ptr = p.dq_accum_store, p.dq_accum_ptr
        lse2_ptr, dsum_ptr, sem_ptr, done_ptr = p.lse2, p.dsum, p.dq_semaphore, p.dq_done
        scale, scale_log2, turn_tiles, first_write = p.scale, p.scale_log2, p.turn_tiles, p.first_write
        tail_ptr, partial_ptr, tail_tiles, tail_pieces = p.tail_counters, p.dkv_partial, p.tail_tiles, p.tail_pieces
        # Launched programmatically after the preprocess (manifest: "programmatic"): the
        # CTAs may start while the preprocess's last ones run. Until griddepcontrol.wait
        # returns, only its inputs, written before the preprocess started, are read (K, V,
        # the first Q and dO tiles: ``load``); the statistics, the accumulator and the
        # semaphores wait (``load``, ``dq_writer``). The consumers touch global memory only
        # for dK and dV, which the preprocess does not. The postprocess may be placed once
        # every CTA here has signalled it (or ended), which the dQ writer does after its
        # wait: so the preprocess has cleared the dq_done counters by then, whatever a
        # previous call left there, and the postprocess blocks wait on this call's counts.
        warp, tidx, start = self._start((tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv), tma_dq, tma_dq_store,
                                        (sq_layout, sdo_layout, skv_layout, sv_layout, sds_layout, sdq_layout))
        prob = self.walk.problem(gQ, gK, (p.window_left, p.window_right))
        prob, work = self.walk.cta_work(prob, gK, tail_tiles, tail_pieces, tail_ptr, partial_ptr)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        self._run_roles(warp, tidx, start, (tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV),
                        Outputs(tma_dk, gdK, start.sdK, tma_dv, gdV, start.sdV),
                        DqTarget(tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr),
                        (lse2_ptr, dsum_ptr), Scalars(scale, scale_log2, turn_tiles, first_write, self._softcap(p)), prob,
                        work, sds_layout)

    def _softcap(self, p):
        """softcap: softmax_scale / cap from the params, else None."""
        return p.softcap_scale if const_expr(self.cfg.softcap) else None

    @cute.kernel
    def kernel_varlen(self, p: BWD_MAIN.tuple_type, sq_layout: cute.ComposedLayout,
                      sdo_layout: cute.ComposedLayout, skv_layout: cute.ComposedLayout,
                      sv_layout: cute.ComposedLayout, sds_layout: cute.ComposedLayout,
                      sdq_layout: cute.ComposedLayout):
        """The varlen main kernel: ``kernel``'s roles on one (key tile of a sequence, KV
        head) item (scheduler.TileWalk.cta_work_varlen); TMA coordinates (total, d, h, 1);
        dK and dV (total_k, h_kv, d) written row by row (packed_rows.py); the workspace by
        config.varlen_workspace_rule. Launched programmatically, as ``kernel``."""
        (tma_q, gQ), (tma_do, gdO), (tma_k, gK), (tma_v, gV) = p.q, p.dout, p.k, p.v
        (dk_ptr, (dk_ss, dk_sh)), (dv_ptr, (dv_ss, dv_sh)) = p.dk_rows, p.dv_rows
        tma_dq, gdQacc = (None, None) if p.dq_accum is None else p.dq_accum  # None in fragment order
        tma_dq_store, dqacc_ptr = p.dq_accum_store, p.dq_accum_ptr
        lse2_ptr, dsum_ptr, sem_ptr, done_ptr, ended_ptr = p.lse2, p.dsum, p.dq_semaphore, p.dq_done, p.ctas_done
        scale, scale_log2, turn_tiles, first_write = p.scale, p.scale_log2, p.turn_tiles, p.first_write
        cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr = p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k
        use_used_q, use_used_k, batch_count, order_ptr, lpt = p.use_seqused_q, p.use_seqused_k, p.batch, p.order, p.lpt
        warp, tidx, start = self._start((tma_q, tma_do, tma_k, tma_v), tma_dq, tma_dq_store,
                                        (sq_layout, sdo_layout, skv_layout, sv_layout, sds_layout, sdq_layout))
        batches = batch_count
        seqs = Sequences(*(cute.make_tensor(at, cute.make_layout(batches + extra)) for at, extra in
                           ((cu_q_ptr, 1), (cu_k_ptr, 1), (used_q_ptr, 0), (used_k_ptr, 0))),
                         use_used_q, use_used_k, batches)
        prob, work = self.walk.cta_work_varlen(gQ, gK, seqs, cute.make_tensor(order_ptr, cute.make_layout(batches)),
                                               lpt, (p.window_left, p.window_right))
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        self._run_roles(warp, tidx, start, (tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV),
                        Outputs(None, PackedRows(dk_ptr, dk_ss, dk_sh, p.columns), start.sdK,
                                None, PackedRows(dv_ptr, dv_ss, dv_sh, p.columns_v), start.sdV),
                        DqTarget(tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr, ended_ptr),
                        (lse2_ptr, dsum_ptr), Scalars(scale, scale_log2, turn_tiles, first_write, self._softcap(p)),
                        prob, work, sds_layout)

    @cute.jit
    def _start(self, loads, tma_dq, tma_dq_store, layouts):
        """A CTA's start, before its walk: the descriptors of ``loads`` (and the dQ
        accumulator's) prefetched, shared storage, pipelines (initialized, not yet waited
        for) and tiles (``layouts``: _main_atoms' q, do, kv, v, ds, dq). Returns (warp,
        tidx, Start)."""
        sq_layout, sdo_layout, skv_layout, sv_layout, sds_layout, sdq_layout = layouts
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            for atom in loads:
                cpasync.prefetch_descriptor(atom)
            if const_expr(not self.cfg.dq_fragment_order):
                cpasync.prefetch_descriptor(tma_dq)
                cpasync.prefetch_descriptor(tma_dq_store)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe_kv = tma_pipeline(storage.mbar_kv, self.cfg.kv_stages, self.cfg.num_consumers, self.kv_bytes)
        # Q and dO in separate pipelines: dO is released once dV's GEMM is done, Q after dK's.
        # Each Q (dO) stage also carries its tile's LSE2 (D) values: 4 * tile_m bytes more.
        tiles = self.cfg.step_rows // self.cfg.tile_m
        pipe_q, pipe_do = [
            tma_pipeline(bar, self.cfg.stages, self.cfg.num_consumers, (tile_bytes + 4 * self.cfg.tile_m) * tiles)
            for bar, tile_bytes in ((storage.mbar_q, self.q_bytes), (storage.mbar_do, self.do_bytes))]
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = storage.sdO.get_tensor(sdo_layout.outer, swizzle=sdo_layout.inner)
        sK = storage.sK.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
        sV = storage.sV.get_tensor(sv_layout.outer, swizzle=sv_layout.inner)
        sdS = storage.sdS.get_tensor(sds_layout.outer, swizzle=sds_layout.inner)
        if const_expr(self.cfg.dq_fragment_order):
            # (4 values, thread of the warpgroup, 16-byte chunk, buffer): see DqFragments
            part = self.cfg.dq_tile[0] * self.cfg.dq_tile[1]
            sdQ = cute.make_tensor(storage.sdQ.data_ptr(), cute.make_layout(
                (4, WARPGROUP, part // WARPGROUP // 4, self.cfg.dq_slots), stride=(1, 4, 4 * WARPGROUP, part)))
        else:
            sdQ = storage.sdQ.get_tensor(sdq_layout.outer, swizzle=sdq_layout.inner)
        stats_layout = cute.make_layout((self.cfg.step_rows, self.cfg.stages))
        sLSE2, sDsum = storage.sLSE2.get_tensor(stats_layout), storage.sDsum.get_tensor(stats_layout)
        # dK, dV over spent Q, dO (keys on M; head on M stages them over K and V)
        staging_k, staging_v = (smem_layout(self.dtype, self.cfg.tile_n, w, col_parts=self.cfg.col_parts)
                                for w in (self.cfg.head_dim, self.cfg.head_dim_v))
        sdK = storage.sQ.get_tensor(staging_k.outer, swizzle=staging_k.inner)
        sdV = storage.sdO.get_tensor(staging_v.outer, swizzle=staging_v.inner)

        return warp, tidx, Start(storage, pipe_kv, pipe_q, pipe_do, sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDsum, sdK, sdV)

    @cute.jit
    def _run_roles(self, warp, tidx, start, loads, outputs, target, stats_ptrs, scalars, prob, work, sds_layout):
        """Each warp's role on the CTA's ``work`` (the scheduler's CtaWork)."""
        storage, pipe_kv, pipe_q, pipe_do, sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDsum, _, _ = start
        tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV = loads
        lse2_ptr, dsum_ptr = stats_ptrs
        pipes = Pipes(pipe_kv, pipe_q, pipe_do)
        if warp < 4:
            # ---------------- producer warpgroup: TMA loads, dQ writer ----------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                inputs = Inputs(tma_q, gQ, sQ, tma_do, gdO, sdO, tma_k, gK, sK, tma_v, gV, sV)
                self.producer.run(inputs, pipes, Stats(lse2_ptr, sLSE2, dsum_ptr, sDsum), prob, work)
            if warp == DQ_WRITER_WARP:
                self.dq_writer.run(tidx, sdQ, target, prob, scalars, work)
        else:
            # ---------------- consumer warpgroups ----------------
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            tiles = Tiles(sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDsum)
            if const_expr(self.cfg.head_on_m):
                sP = storage.sP.get_tensor(sds_layout.outer, swizzle=sds_layout.inner)
                self.consumer.run(tidx, tiles, sP, pipes, prob, scalars, outputs, work)
            else:
                self.consumer.run(tidx, tiles, pipes, prob, scalars, outputs, work)
