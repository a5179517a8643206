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
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ...common import heaviest_first, symbols
from ..primitives import DTYPES, WARPGROUP, sdhb, smem_buffer, smem_layout, tma_pipeline
from .bundles import DqTarget, Inputs, Outputs, Pipes, Scalars, Start, Stats, Tiles
from .config import PRODUCER_REGS, BwdConfig
from .dq_writer import DQ_WRITER_WARP, DqBuffers, DqWriter
from .head_on_m import HeadOnM
from .keys_on_m import KeysOnM
from .pre_post import DqFragments, PrePostSm90
from .packed_rows import PackedRows
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
        self.rows = PrePostSm90(cfg, fragments)  # pre/postprocess
        self.tma_boxes = {}
        self.smem_bytes = None

    def _storage(self, s_q, s_kv, s_ds, s_dq):
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
            sV: buf(s_kv)
            sQ: buf(s_q)  # also dK's staging tile (persistent: over K)
            sdO: buf(s_q)  # also dV's staging tile (persistent: over V)
            sdS: buf(s_ds)  # (tile_m, tile_n, ds_stages); head_on_m: (tile_n, tile_m)
            if p_in_smem:
                sP: buf(s_ds)  # (tile_m, tile_n)
            sdQ: buf(s_dq, Float32)  # (*dq_tile, dq_slots) fp32 staging

        return Storage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d)
        mV: cute.Tensor,  # (b, s_k, h_kv, d)
        mO: cute.Tensor,  # (b, s_q, h_q, d)
        mdO: cute.Tensor,  # (b, s_q, h_q, d)
        mdQ: cute.Tensor,  # (b, s_q, h_q, d)
        mdK: cute.Tensor,  # (b, s_k, h_kv, d)
        mdV: cute.Tensor,  # (b, s_k, h_kv, d)
        mLSE: cute.Tensor,  # (b, h_q, s_q) float32, contiguous, from the forward
        mLSE2: cute.Tensor,  # (b, h_q, s_q padded to tile_m) float32 workspace: LSE * log2(e)
        mDsum: cute.Tensor,  # (b, h_q, s_q padded to tile_m) float32 workspace: rowsum(dO * O)
        mdQacc: cute.Tensor,  # (b * chains, s_q, h_q, d) float32 workspace
        mSem: cute.Tensor,  # (b, h_q, ceil(s_q / tile_m) * chains) int32 workspace
        mDone: cute.Tensor,  # (b, h_q) int32 workspace: key tiles done adding into each head's dQ
        scale: Float32,  # softmax_scale
        scale_log2: Float32,  # softmax_scale * log2(e)
        turn_tiles: Int32,  # deterministic: query tiles per ordered turn (see dq_writer)
        first_write: Int32,  # 1: no accumulator clear, each tile's first share stored
        mTail: cute.Tensor,  # (TAIL_MAX_TILES * TAIL_COUNTERS,) int32 workspace: the split tiles' counters
        mPartial: cute.Tensor,  # (TAIL_MAX_TILES * 2 * tile_n * d,) float32 workspace: their dK, dV sums
        tail_tiles: Int32,  # key tiles split (the last ones in launch order; 0: none)
        tail_pieces: Int32,  # pieces per split tile
    ):
        b, s_q, h_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        rows_grid = (cute.ceil_div(s_q, self.cfg.tile_m), h_q, b)
        self.rows.preprocess(
            mO.iterator, mO.stride[0], mO.stride[1], mO.stride[2],
            mdO.iterator, mdO.stride[0], mdO.stride[1], mdO.stride[2],
            mLSE.iterator, mLSE2.iterator, mDsum.iterator, mdQacc.iterator, mSem.iterator, mDone.iterator,
            mTail.iterator, s_q, h_q, first_write,
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1])

        q, k, v, do, dk, dv, dq_acc = [sdhb(t) for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc)]
        (tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, tma_dk, gdk, tma_dv, gdv, tma_dq, gdq, tma_dq_store,
         s_q_tile, s_kv_all, s_ds, s_dq) = self._main_atoms(q, k, v, do, dk, dv, dq_acc)
        grid = (cute.ceil_div(k.shape[0], self.cfg.tile_n), k.shape[2], k.shape[3])
        self.kernel(
            tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, tma_dk, gdk, tma_dv, gdv, tma_dq, gdq, tma_dq_store,
            mLSE2.iterator, mDsum.iterator, mSem.iterator, mdQacc.iterator, mDone.iterator, scale, scale_log2,
            turn_tiles, first_write, mTail.iterator, mPartial.iterator, tail_tiles, tail_pieces,
            s_q_tile, s_kv_all, s_ds, s_dq,
        ).launch(grid=grid, block=[self.cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1)

        self.rows.postprocess(
            mdQacc.iterator, mSem.iterator, mDone.iterator, mdQ.iterator, mdQ.stride[0], mdQ.stride[1], mdQ.stride[2],
            s_q,
            mK.shape[1], h_q, scale, first_write,
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1], smem=self.rows.post_smem_bytes)

    @cute.jit
    def varlen_call(
        self,
        mQ: cute.Tensor,  # (1, total_q, h_q, d): packed sequences
        mK: cute.Tensor,  # (1, total_k, h_kv, d)
        mV: cute.Tensor,  # (1, total_k, h_kv, d)
        mO: cute.Tensor,  # (1, total_q, h_q, d)
        mdO: cute.Tensor,  # (1, total_q, h_q, d)
        mdQ: cute.Tensor,  # (1, total_q, h_q, d)
        mdK: cute.Tensor,  # (1, total_k, h_kv, d)
        mdV: cute.Tensor,  # (1, total_k, h_kv, d)
        mLSE: cute.Tensor,  # (h_q, total_q) float32, contiguous, from the forward
        mLSE2: cute.Tensor,  # (h_q, ws_tiles * tile_m) float32 workspace (config.varlen_workspace_rule)
        mDsum: cute.Tensor,  # (h_q, ws_tiles * tile_m) float32 workspace
        mdQacc: cute.Tensor,  # (chains, ws_tiles * tile_m, h_q, d) float32 workspace
        mSem: cute.Tensor,  # (chains, h_q, ws_tiles) int32 workspace
        mDone: cute.Tensor,  # (b, h_q) int32 workspace
        mEnded: cute.Tensor,  # (1,) int64 workspace: main-kernel CTAs ended
        scale: Float32,
        scale_log2: Float32,
        turn_tiles: Int32,
        first_write: Int32,
        mCuQ: cute.Tensor,  # (b + 1,) int32: each sequence's first query row, then total_q
        mCuK: cute.Tensor,  # (b + 1,) int32
        mUsedQ: cute.Tensor,  # (b,) int32: query rows used (read where use_used_q)
        mUsedK: cute.Tensor,  # (b,) int32
        use_used_q: Int32,
        use_used_k: Int32,
        mOrder: cute.Tensor,  # (b,) int32 workspace: the sequences heaviest first (where lpt)
        lpt: Int32,  # 0: the caller's order; else order_varlen sorts, kernel_varlen walks mOrder
    ):
        """The varlen backward: as ``__call__``, sequences located by cu_seqlens (and
        seqused): the row kernels one block per (query tile of a sequence, head), the main
        kernel one CTA per (key tile of a sequence, KV head), the sequences' tiles back to
        back (grids of ceil(total / tile) + b, which bound every sequence's tiles while the
        sequences do not overlap). Four launches: the heaviest-first sort (one CTA; the run
        time skips it where lpt is 0), then the three of ``__call__``. Every main-kernel CTA
        counts itself in ``mEnded`` as it ends, so a postprocess block waiting for key tiles
        that lying metadata left past the grid stops once the grid has ended."""
        total_q, h_q, batches = mQ.shape[1], mQ.shape[2], mCuQ.shape[0] - 1
        rows_grid = (cute.ceil_div(total_q, self.cfg.tile_m) + batches, h_q, 1)
        self.order_varlen(mCuQ.iterator, mCuK.iterator, mUsedQ.iterator, mUsedK.iterator, use_used_q, use_used_k,
                          batches, total_q, mK.shape[1], mOrder.iterator).launch(
            grid=[1, 1, 1], block=[heaviest_first.THREADS, 1, 1], smem=heaviest_first.SMEM_BYTES
        )
        self.rows.preprocess_varlen(
            mO.iterator, mO.stride[1], mO.stride[2], mdO.iterator, mdO.stride[1], mdO.stride[2],
            mLSE.iterator, mLSE2.iterator, mDsum.iterator, mdQacc.iterator, mSem.iterator, mDone.iterator,
            mEnded.iterator, total_q, h_q, first_write, mCuQ.iterator, mUsedQ.iterator, use_used_q, batches,
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1])

        q, k, v, do, dq_acc = [sdhb(t) for t in (mQ, mK, mV, mdO, mdQacc)]
        (tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, _, _, _, _, tma_dq, gdq, tma_dq_store,
         s_q_tile, s_kv_all, s_ds, s_dq) = self._main_atoms(q, k, v, do, None, None, dq_acc)
        grid = (varlen_grid_x(k.shape[0], batches, self.cfg.tile_n), k.shape[2], 1)
        self.kernel_varlen(
            tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, mdK.iterator, mdK.stride[1], mdK.stride[2],
            mdV.iterator, mdV.stride[1], mdV.stride[2], tma_dq, gdq, tma_dq_store,
            mLSE2.iterator, mDsum.iterator, mSem.iterator, mdQacc.iterator, mDone.iterator, mEnded.iterator,
            scale, scale_log2,
            turn_tiles, first_write, mCuQ.iterator, mCuK.iterator, mUsedQ.iterator, mUsedK.iterator,
            use_used_q, use_used_k, batches, mOrder.iterator, lpt, s_q_tile, s_kv_all, s_ds, s_dq,
        ).launch(grid=grid, block=[self.cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1)

        self.rows.postprocess_varlen(
            mdQacc.iterator, mSem.iterator, mDone.iterator, mEnded.iterator, mdQ.iterator, mdQ.stride[1],
            mdQ.stride[2], total_q, h_q, scale, first_write, mCuQ.iterator, mUsedQ.iterator, use_used_q,
            mCuK.iterator, mUsedK.iterator, use_used_k, batches, mK.shape[1], mK.shape[2],
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1], smem=self.rows.post_smem_bytes)

    @cute.kernel
    def order_varlen(
        self,
        cu_q_ptr: cute.Pointer,  # int32 (b + 1,)
        cu_k_ptr: cute.Pointer,  # int32 (b + 1,)
        used_q_ptr: cute.Pointer,  # int32 (b,), read where use_used_q
        used_k_ptr: cute.Pointer,  # int32 (b,), read where use_used_k
        use_used_q: Int32,
        use_used_k: Int32,
        batch_count: Int32,
        total_q: Int32,
        total_k: Int32,
        order_ptr: cute.Pointer,  # int32 (b,) out: the sequences heaviest first
    ):
        """The sequences sorted by cost, heaviest first (common/heaviest_first.py: the
        (key tile, query tile) pairs of their key tiles, causal-aware), for kernel_varlen's
        walk. Launched before the preprocess, not programmatically: the main kernel reads
        the order before its griddepcontrol.wait, as it reads the metadata."""
        meta = heaviest_first.Metadata(cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr, use_used_q, use_used_k, batch_count,
                                       total_q, total_k)
        heaviest_first.sort_sequences(meta, order_ptr, self.cfg.tile_m, self.cfg.tile_n, self.cfg.causal, keys_outer=True)

    def _main_atoms(self, q, k, v, do, dk, dv, dq_acc):
        """The main kernel's TMA atoms and coordinate tensors (q, do, k, v, dk, dv (None
        varlen), the dQ accumulator's reduce and store (None in fragment order)), its shared
        layouts, storage and shared bytes; the boxes for the manifest's tensor maps.
        Tensors (s, d, h, b)."""
        s_q_tile = smem_layout(self.dtype, self.cfg.step_rows, self.cfg.head_dim, self.cfg.stages, self.cfg.col_parts)
        # one query tile: the TMA box (wide: each stage holds two, loaded apart)
        s_q_one = smem_layout(self.dtype, self.cfg.tile_m, self.cfg.head_dim, col_parts=self.cfg.col_parts)
        s_kv = smem_layout(self.dtype, self.cfg.tile_n, self.cfg.head_dim, col_parts=self.cfg.col_parts)
        s_kv_all = s_kv
        if const_expr(self.cfg.persistent):
            s_kv_all = smem_layout(self.dtype, self.cfg.tile_n, self.cfg.head_dim, self.cfg.kv_stages, self.cfg.col_parts)
        if const_expr(self.cfg.head_on_m):
            s_ds = smem_layout(self.dtype, self.cfg.tile_n, self.cfg.tile_m)  # (keys, queries)
        else:
            s_ds = smem_layout(self.dtype, self.cfg.step_rows, self.cfg.tile_n, self.cfg.ds_stages)  # (queries, keys, stage)
        s_dq = smem_layout(Float32, *self.cfg.dq_tile, self.cfg.dq_slots)
        s_dq_one = cute.select(s_dq, mode=[0, 1])
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_q, gq = cpasync.make_tiled_tma_atom(load, q, s_q_one, (self.cfg.tile_m, self.cfg.head_dim))
        tma_do, gdo = cpasync.make_tiled_tma_atom(load, do, s_q_one, (self.cfg.tile_m, self.cfg.head_dim))
        tma_k, gk = cpasync.make_tiled_tma_atom(load, k, s_kv, (self.cfg.tile_n, self.cfg.head_dim))
        tma_v, gv = cpasync.make_tiled_tma_atom(load, v, s_kv, (self.cfg.tile_n, self.cfg.head_dim))
        boxes = [("q", tma_q, s_q_one), ("do", tma_do, s_q_one), ("k", tma_k, s_kv), ("v", tma_v, s_kv)]
        tma_dk, gdk, tma_dv, gdv = None, None, None, None
        if const_expr(dk is not None):  # varlen: dK and dV written row by row (packed_rows.py)
            tma_dk, gdk = cpasync.make_tiled_tma_atom(store, dk, s_kv, (self.cfg.tile_n, self.cfg.head_dim))
            tma_dv, gdv = cpasync.make_tiled_tma_atom(store, dv, s_kv, (self.cfg.tile_n, self.cfg.head_dim))
            boxes += [("dk", tma_dk, s_kv), ("dv", tma_dv, s_kv)]
        # fragment order: 1D bulk reduces (and stores) at dq_accum's address instead
        tma_dq, gdq, tma_dq_store = None, None, None
        if const_expr(not self.cfg.dq_fragment_order):
            tma_dq, gdq = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), dq_acc, s_dq_one, self.cfg.dq_tile)
            boxes.append(("dq_accum", tma_dq, s_dq_one))
            # a tile's first dQ share is stored (first_write); same tensor map (the
            # operation is the instruction's, not the map's): the manifest encodes it
            # from dq_accum's recipe, and compile checks that the two atoms agree
            tma_dq_store, _ = cpasync.make_tiled_tma_atom(store, dq_acc, s_dq_one, self.cfg.dq_tile)
            self.dq_store_box = (str(tma_dq_store.type), str(s_dq_one.inner))
        self.tma_boxes = {name: (str(atom.type), str(layout.inner)) for name, atom, layout in boxes}
        self.q_bytes = cute.size_in_bytes(self.dtype, s_q_one)
        self.kv_bytes = cute.size_in_bytes(self.dtype, s_kv)
        self.storage = self._storage(s_q_tile, s_kv_all, s_ds, s_dq)
        self.smem_bytes = self.storage.size_in_bytes() + 1024
        return (tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, tma_dk, gdk, tma_dv, gdv, tma_dq, gdq, tma_dq_store,
                s_q_tile, s_kv_all, s_ds, s_dq)

    # ------------------------------------------------------------------ main kernel
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom, gQ: cute.Tensor,  # TMA coordinates (s_q, d, h_q, b)
        tma_do: cute.CopyAtom, gdO: cute.Tensor,  # (s_q, d, h_q, b)
        tma_k: cute.CopyAtom, gK: cute.Tensor,  # (s_k, d, h_kv, b)
        tma_v: cute.CopyAtom, gV: cute.Tensor,  # (s_k, d, h_kv, b)
        tma_dk: cute.CopyAtom, gdK: cute.Tensor,  # (s_k, d, h_kv, b)
        tma_dv: cute.CopyAtom, gdV: cute.Tensor,  # (s_k, d, h_kv, b)
        tma_dq: cute.CopyAtom, gdQacc: cute.Tensor,  # reduce-add into float32 (s_q, d, h_q, b); None in fragment order
        tma_dq_store: cute.CopyAtom,  # store into the same (a tile's first share); None in fragment order
        lse2_ptr: cute.Pointer,  # float32 (b, h_q, s_q padded to tile_m), 256-byte aligned
        dsum_ptr: cute.Pointer,  # float32 (b, h_q, s_q padded to tile_m), 256-byte aligned
        sem_ptr: cute.Pointer,  # int32 (b, h_q, ceil(s_q / tile_m) * chains): turns (deterministic) or tickets
        dqacc_ptr: cute.Pointer,  # float32: the accumulator, for the fragment-order reduces
        done_ptr: cute.Pointer,  # int32 (b, h_q): key tiles whose dQ adds are complete
        scale: Float32,
        scale_log2: Float32,
        turn_tiles: Int32,
        first_write: Int32,
        tail_ptr: cute.Pointer,  # int32 (TAIL_MAX_TILES, TAIL_COUNTERS): the split tiles' counters
        partial_ptr: cute.Pointer,  # float32: the split tiles' dK, dV sums (split_last_wave.py)
        tail_tiles: Int32,  # the last tail_tiles key tiles in launch order are split (0: none)
        tail_pieces: Int32,  # into this many pieces each
        sq_layout: cute.ComposedLayout,
        skv_layout: cute.ComposedLayout,
        sds_layout: cute.ComposedLayout,
        sdq_layout: cute.ComposedLayout,
    ):
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
                                        sq_layout, skv_layout, sds_layout, sdq_layout)
        prob = self.walk.problem(gQ, gK)
        prob, work = self.walk.cta_work(prob, gK, tail_tiles, tail_pieces, tail_ptr, partial_ptr)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        self._run_roles(warp, tidx, start, (tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV),
                        Outputs(tma_dk, gdK, start.sdK, tma_dv, gdV, start.sdV),
                        DqTarget(tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr),
                        (lse2_ptr, dsum_ptr), Scalars(scale, scale_log2, turn_tiles, first_write), prob, work,
                        sds_layout)

    @cute.kernel
    def kernel_varlen(
        self,
        tma_q: cute.CopyAtom, gQ: cute.Tensor,  # TMA coordinates (total_q, d, h_q, 1): packed sequences
        tma_do: cute.CopyAtom, gdO: cute.Tensor,  # (total_q, d, h_q, 1)
        tma_k: cute.CopyAtom, gK: cute.Tensor,  # (total_k, d, h_kv, 1)
        tma_v: cute.CopyAtom, gV: cute.Tensor,  # (total_k, d, h_kv, 1)
        dk_ptr: cute.Pointer, dk_ss: Int64, dk_sh: Int64,  # dK (total_k, h_kv, d): address, row and head strides
        dv_ptr: cute.Pointer, dv_ss: Int64, dv_sh: Int64,  # dV (total_k, h_kv, d)
        tma_dq: cute.CopyAtom, gdQacc: cute.Tensor,  # reduce-add into float32 (ws rows, d, h_q, chains); None in fragment order
        tma_dq_store: cute.CopyAtom,  # None in fragment order
        lse2_ptr: cute.Pointer,  # float32 (h_q, ws_tiles * tile_m): config.varlen_workspace_rule
        dsum_ptr: cute.Pointer,  # float32 (h_q, ws_tiles * tile_m)
        sem_ptr: cute.Pointer,  # int32 (h_q, ws_tiles, chains)
        dqacc_ptr: cute.Pointer,  # float32: the accumulator, for the fragment-order reduces
        done_ptr: cute.Pointer,  # int32 (b, h_q): key tiles whose dQ adds are complete
        ended_ptr: cute.Pointer,  # int64 (1,): CTAs of this grid that have ended
        scale: Float32,
        scale_log2: Float32,
        turn_tiles: Int32,
        first_write: Int32,
        cu_q_ptr: cute.Pointer,  # int32 (b + 1,): each sequence's first query row, then total_q
        cu_k_ptr: cute.Pointer,  # int32 (b + 1,)
        used_q_ptr: cute.Pointer,  # int32 (b,): query rows used (read where use_used_q)
        used_k_ptr: cute.Pointer,  # int32 (b,)
        use_used_q: Int32,
        use_used_k: Int32,
        batch_count: Int32,  # sequences
        order_ptr: cute.Pointer,  # int32 (b,): the sequences heaviest first, read where lpt
        lpt: Int32,
        sq_layout: cute.ComposedLayout,
        skv_layout: cute.ComposedLayout,
        sds_layout: cute.ComposedLayout,
        sdq_layout: cute.ComposedLayout,
    ):
        """The varlen main kernel: ``kernel``'s roles on one (key tile of a sequence, KV
        head) item (scheduler.TileWalk.cta_work_varlen); dK and dV written row by row
        (packed_rows.py). Launched programmatically, as ``kernel``."""
        warp, tidx, start = self._start((tma_q, tma_do, tma_k, tma_v), tma_dq, tma_dq_store,
                                        sq_layout, skv_layout, sds_layout, sdq_layout)
        batches = batch_count
        seqs = Sequences(*(cute.make_tensor(p, cute.make_layout(batches + extra)) for p, extra in
                           ((cu_q_ptr, 1), (cu_k_ptr, 1), (used_q_ptr, 0), (used_k_ptr, 0))),
                         use_used_q, use_used_k, batches)
        prob, work = self.walk.cta_work_varlen(gQ, gK, seqs, cute.make_tensor(order_ptr, cute.make_layout(batches)),
                                               lpt)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        self._run_roles(warp, tidx, start, (tma_q, gQ, tma_do, gdO, tma_k, gK, tma_v, gV),
                        Outputs(None, PackedRows(dk_ptr, dk_ss, dk_sh), start.sdK,
                                None, PackedRows(dv_ptr, dv_ss, dv_sh), start.sdV),
                        DqTarget(tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr, ended_ptr),
                        (lse2_ptr, dsum_ptr), Scalars(scale, scale_log2, turn_tiles, first_write), prob, work,
                        sds_layout)

    @cute.jit
    def _start(self, loads, tma_dq, tma_dq_store, sq_layout, skv_layout, sds_layout, sdq_layout):
        """A CTA's start, before its walk: the descriptors of ``loads`` (and the dQ
        accumulator's) prefetched, shared storage, pipelines (initialized, not yet waited
        for) and tiles. Returns (warp, tidx, Start)."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            for atom in loads:
                cpasync.prefetch_descriptor(atom)
            if const_expr(not self.cfg.dq_fragment_order):
                cpasync.prefetch_descriptor(tma_dq)
                cpasync.prefetch_descriptor(tma_dq_store)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe_kv = tma_pipeline(storage.mbar_kv, self.cfg.kv_stages, self.cfg.num_consumers, 2 * self.kv_bytes)
        # Q and dO in separate pipelines: dO is released once dV's GEMM is done, Q after dK's.
        # Each Q (dO) stage also carries its tile's LSE2 (D) values: 4 * tile_m bytes more.
        step_bytes = (self.q_bytes + 4 * self.cfg.tile_m) * (self.cfg.step_rows // self.cfg.tile_m)
        pipe_q, pipe_do = [tma_pipeline(bar, self.cfg.stages, self.cfg.num_consumers, step_bytes)
                           for bar in (storage.mbar_q, storage.mbar_do)]
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = storage.sdO.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sK.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
        sV = storage.sV.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
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
        staging = smem_layout(self.dtype, self.cfg.tile_n, self.cfg.head_dim, col_parts=self.cfg.col_parts)  # dK, dV over spent Q, dO
        sdK = storage.sQ.get_tensor(staging.outer, swizzle=staging.inner)
        sdV = storage.sdO.get_tensor(staging.outer, swizzle=staging.inner)

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
