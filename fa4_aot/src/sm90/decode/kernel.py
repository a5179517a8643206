"""Attention of a few query tokens against a KV cache (decode) for Hopper (sm_90a).

Decode is bound by reading the cache: each K and V byte is used by the few query rows of
its KV head and nothing else. So (docs/design.md, "Decode"):
- GQA packing: one CTA's 64 rows are the (query token, query head) pairs of one KV head,
  query head fastest (row p: token p // group, head head_kv * group + p % group), so each
  K/V tile is read once per KV head, not once per query head.
- Split-KV: the grid is (row tiles x splits, KV heads, batch); split s of a sequence's key
  tiles takes an equal share of them. With one split the CTA writes out and lse; with more,
  each writes its normalized O (fp32) and LSE to the workspace and the combine kernel
  (combine.py) merges them by LSE.
- Paging: K and V tiles are TMA loads from a cache viewed as (pages, page rows, heads, d):
  a contiguous cache is one page per sequence (page = batch entry), a paged one looks each
  piece of a key tile up in the page table. A piece is ``piece_rows`` keys (the host's box:
  the key tile or ``cfg.piece_rows``, or the largest power of two dividing both it and the
  page size), so a tile that crosses pages is loaded in pieces from each; with
  ``cfg.piece_rows`` the pieces wholly outside a window are not read (``_piece_place``).

Warpgroups: warp 0 of warpgroup 0 loads K and V through `stages`-deep TMA pipelines, key
tiles from the last (the one that may need masking) to the first; warpgroup 1 loads Q
(plain loads: packed rows are not a TMA box), then per key tile S = Q K^T (SS-wgmma),
masking, online softmax (conditional rescaling, exp2), O += P V (RS-wgmma), and writes.
With ``cfg.producer_warp`` (the span-narrow kernels, several CTAs an SM) the consumer
warpgroup is warps 0-3 and the loads are warp 4's, the CTA's last. With ``cfg.persistent``
(the span-narrow kernels) the grid is at most a CTA a slot, each walking its items (row
tile x split, KV head, sequence) with the pipelines running on from one into the next
and the next item's Q fetched into a second buffer (``walk``).

Local (a sliding window and sinks, run-time values) and softcap: as the forward's
(docs/design.md, "Local attention, sinks, softcap"): a row tile's key tiles start at its
first token's window, so pages wholly outside the windows are not read and the splits
divide the window's tiles only; every key tile is masked (the window's both edges); the
sink joins split 0's rows' denominators (the combine's merge by LSE then counts it once).

An FP8 (e4m3) cache (``cfg.fp8``): TMA loads e4m3 tiles (half the bytes); a third
warpgroup between the producer and the consumer widens each K and V tile into a 16-bit
buffer of q's dtype (sm90/widen.py: exact) that the consumer's wgmmas read, one buffer
each for K and V (so K of the next tile is widened while the consumer reads V). The
dequantization scales (per sequence and KV head, run-time tensors) multiply the scores'
scale and O's normalization (docs/design.md, "Decode": FP8 cache).

Without cache_seqlens (``full_cache``: the dense API's decode shapes, docs/design.md,
"Run-time selection policy") every sequence's keys are its whole cache.

Nothing is read out of bounds whatever the device-side metadata says: cache_seqlens is
clamped to the cache's rows (or the page table's), page numbers to the pages, and TMA
fills a box past the tensor with zeros.

Constraints: head_dim in {64, 96, 128, 192, 256}; bf16 or fp16; heads_q a multiple of
heads_kv. Build with ``build_kernels.py``.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..fragments import acc_as_operand_a, acc_as_rows_cols, transpose_smem
from ..primitives import (
    DTYPES, WARPGROUP, sdhb, select_f32, smem_buffer, smem_layout, sum_halves, tiled_mma, tma_pipeline, wgmma,
)
from ..softmax import OnlineSoftmax, cap_scores, rescale_rows, row_value, scale_rows
from ...common import symbols
from ...common.params import Tma
from ...interfaces import DECODE, DECODE_INPUTS
from .config import DecodeConfig
from .loads import DecodeLoads
from .rows import key_tile, pair_offset, token_of
from .walk import DecodeWalk

HALVES_WRITTEN = 3  # head_split: both warpgroups' S halves in shared memory
HALVES_READ = 4  # head_split: both have read the other's half
LOG2E = math.log2(math.e)


def _writes_lse(tidx, wg):
    """Whether this epilogue thread writes its rows' LSE: a quad's first (head_split:
    warpgroup 0's)."""
    if const_expr(wg is None):
        return tidx % 4 == 0
    return (tidx % 4 == 0) & (wg == 0)


class DecodeSm90(DecodeLoads, DecodeWalk):
    """One decode variant (its ``config.DecodeConfig``): host side, kernel and the
    consumer's math; the loads (loads.py) and the work items (walk.py) as mixins."""

    def __str__(self):
        return symbols.DECODE_SM90  # the cubin's kernel name (common/symbols.py)

    def __init__(self, cfg: DecodeConfig):
        assert cfg.tile_m == 64 and cfg.head_dim % 32 == 0 and cfg.tile_n % 16 == 0
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.kv_type = cutlass.Float8E4M3FN if cfg.fp8 else self.dtype  # the cache's element type
        # the wgmmas' operands: q's dtype, or fp16 for an FP8 cache (e4m3 widens to fp16 in one
        # conversion per pair; docs/design.md, "Decode": FP8 cache)
        self.mma_type = cutlass.Float16 if cfg.fp8 else self.dtype
        self.tma_boxes = {}
        self.smem_bytes = None

    def _storage(self, sq, skv, skw):
        dtype, kv_type, stages = self.mma_type, self.kv_type, self.cfg.stages

        @cute.struct
        class Storage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: smem_buffer(sq, dtype)  # (64, d) packed rows
            sK: smem_buffer(skv, kv_type)  # (tile_n, d, stages)
            sV: smem_buffer(skv, kv_type)

        @cute.struct
        class SplitStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: smem_buffer(sq, dtype)
            sK: smem_buffer(skv, kv_type)
            sV: smem_buffer(skv, kv_type)
            sS: cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.cfg.tile_m * self.cfg.tile_n], 16]

        if const_expr(self.cfg.head_split):
            return SplitStorage
        if const_expr(not self.cfg.fp8):
            return Storage

        @cute.struct
        class WideStorage:
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_kw: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_vw: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: smem_buffer(sq, dtype)
            sK: smem_buffer(skv, kv_type)  # e4m3 (tile_n, d, stages)
            sV: smem_buffer(skv, kv_type)
            sKw: smem_buffer(skw, dtype)  # widened: (tile_n, d, 1)
            sVw: smem_buffer(skw, dtype)

        return WideStorage

    @cute.jit
    def __call__(self, x: DECODE_INPUTS.tuple_type):
        """One launch (interfaces.DECODE): a CTA per (row tile x split, KV head, batch), or
        (cfg.persistent) a CTA a slot at most, each walking several (the grid rule: compile.py)."""
        k, v = sdhb(x.k_cache), sdhb(x.v_cache)
        q_buffers = 2 if const_expr(self.cfg.persistent) else None  # the walk's: this item's Q and the next's
        sq = smem_layout(self.mma_type, self.cfg.tile_m, self.cfg.head_dim, q_buffers)
        skv = smem_layout(self.kv_type, self.cfg.tile_n, self.cfg.head_dim, self.cfg.stages)
        skw = smem_layout(self.mma_type, self.cfg.tile_n, self.cfg.head_dim, 1) if const_expr(self.cfg.fp8) else skv
        skv_one = cute.select(skv, mode=[0, 1])
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma = {name: Tma(*cpasync.make_tiled_tma_atom(load, t, skv_one, (self.cfg.tile_n, self.cfg.head_dim)))
               for name, t in (("k_cache", k), ("v_cache", v))}
        self.tma_boxes = {name: (str(t.atom.type), str(skv_one.inner)) for name, t in tma.items()}
        self.kv_bytes = cute.size_in_bytes(self.kv_type, skv_one)
        self.storage = self._storage(sq, skv, skw)
        self.smem_bytes = self.storage.size_in_bytes() + 1024  # + base alignment slack
        m_tiles = cute.ceil_div(x.heads_q // k.shape[2] * x.seqlen_q, self.cfg.tile_m)
        grid = (m_tiles * x.splits, k.shape[2], x.batch)
        # more than one CTA per SM: ptxas caps the launch's registers (setmaxnreg moves them
        # between the warpgroups within that); the carveout named so that the DSL asks no
        # device (the driver picks one that fits the CTAs)
        occupancy = {} if self.cfg.ctas_per_sm == 1 else {"preferred_smem_carveout": 100}
        self.kernel(DECODE.bind(self.cfg, x, tma), sq, skv, skw).launch(
            grid=grid, block=[self.cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=self.cfg.ctas_per_sm,
            **occupancy)

    @cute.kernel
    def kernel(self, p: DECODE.tuple_type, sq_layout: cute.ComposedLayout, skv_layout: cute.ComposedLayout,
               skw_layout: cute.ComposedLayout):
        """One (row tile x split, KV head, sequence), or (cfg.persistent) those of
        ``walk``. ``p``: interfaces.DECODE; the cache's
        TMA coordinates (page rows, d, h_kv, pages); Q, O (b, s_q, h_q, d) by address and
        strides; LSE (b, h_q, s_q), the split workspace (splits, b, s_q, h_q, d) and
        (splits, b, h_q, s_q) fp32, contiguous; cache_seqlens (b,), page_table (b, max_pages)."""
        (tma_k, gK), (tma_v, gV) = p.k_cache, p.v_cache
        seqlen_q, heads_q = p.seqlen_q, p.heads_q
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe_k, pipe_v = [tma_pipeline(bar, cfg.stages, cfg.consumers, self.kv_bytes)
                          for bar in (storage.mbar_k, storage.mbar_v)]
        wide = None  # fp8: the widened buffers and their pipelines (the widener's to the consumer's)
        if const_expr(cfg.fp8):
            every = pipeline.CooperativeGroup(pipeline.Agent.Thread, WARPGROUP)
            wide = ((storage.sKw.get_tensor(skw_layout.outer, swizzle=skw_layout.inner),
                     storage.sVw.get_tensor(skw_layout.outer, swizzle=skw_layout.inner)),
                    tuple(pipeline.PipelineAsync.create(num_stages=1, producer_group=every, consumer_group=every,
                                                        barrier_storage=bar.data_ptr(), defer_sync=True)
                          for bar in (storage.mbar_kw, storage.mbar_vw)))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        # a split call's combine (launched programmatically) may start once every CTA of
        # this grid has: its launch then overlaps this kernel (it waits for the writes).
        # Not in the walking kernels (not measured there): their combine starts as they end.
        if const_expr(not cfg.persistent):
            cute.arch.griddepcontrol_launch_dependents()
        sQ = storage.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sK.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
        sV = storage.sV.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)

        bidx, head_kv, b = cute.arch.block_idx()
        heads_kv = gK.shape[2]
        group = heads_q // heads_kv
        rows = group * seqlen_q  # packed rows of this KV head
        m_tiles = cute.ceil_div(rows, cfg.tile_m)
        if const_expr(cfg.persistent):
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            self.walk(warp, tidx, bidx, ((tma_k, gK, sK), (tma_v, gV, sV)), sQ, (pipe_k, pipe_v), p,
                      (group, rows, m_tiles))
        else:
            m_block, split, seqlen_k, window, n_begin, n_end, keys, turn = self._work(p, gK.shape[0], bidx, b,
                                                                                      (group, rows, m_tiles))
            pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
            if const_expr(cfg.producer_warp):
                # ------- warps 0-3 the consumer warpgroup, warp 4 the producer: TMA loads of K and V -------
                # (no setmaxnreg, which a partial warpgroup cannot take: every thread at the launch's cap)
                if warp == 4:
                    self.load((tma_k, gK, sK), (tma_v, gV, sV), (pipe_k, pipe_v), p, head_kv, b, n_begin, n_end,
                              turn, keys)
                else:
                    place = (b, head_kv, group, seqlen_q, heads_q, m_block * cfg.tile_m, rows)
                    self.consume(tidx, sQ, (sK, sV), (pipe_k, pipe_v), (p, place, split, seqlen_k, n_begin, n_end,
                                                                         turn, window))
            elif warp < 4:
                # ---------------- producer warpgroup: TMA loads of K and V ----------------
                cute.arch.setmaxregister_decrease(cfg.producer_regs)
                if warp == 0:
                    self.load((tma_k, gK, sK), (tma_v, gV, sV), (pipe_k, pipe_v), p, head_kv, b, n_begin, n_end,
                              turn, keys)
            else:
                place = (b, head_kv, group, seqlen_q, heads_q, m_block * cfg.tile_m, rows)
                consume = (p, place, split, seqlen_k, n_begin, n_end, turn, window)
                if const_expr(cfg.fp8):
                    if warp < 8:
                        # ---------------- widener warpgroup: e4m3 tiles -> 16-bit buffers ----------------
                        cute.arch.setmaxregister_decrease(cfg.widener_regs)
                        self.widen(tidx - WARPGROUP, (sK, sV), wide, (pipe_k, pipe_v), n_end - n_begin)
                    else:
                        self.consume(tidx - 2 * WARPGROUP, sQ, wide[0], wide[1], consume)
                elif const_expr(cfg.head_split):
                    elements = cfg.tile_m * cfg.tile_n // WARPGROUP
                    sS = storage.sS.get_tensor(cute.make_layout((2, elements, WARPGROUP),
                                                                stride=(elements * WARPGROUP, WARPGROUP, 1)))
                    self.consume(tidx - WARPGROUP, sQ, (sK, sV), (pipe_k, pipe_v), consume, sS)
                else:
                    self.consume(tidx - WARPGROUP, sQ, (sK, sV), (pipe_k, pipe_v), consume)

    @cute.jit
    def consume(self, ctidx, sQ, kv, pipes, consume, sS=None, state=None):
        """The consumer warpgroup (its thread ``ctidx``): Q, then per key tile MMA and
        softmax from ``kv`` (sK, sV) as ``pipes`` fill them, then the epilogue.
        head_split: two warpgroups (ctidx 0..255), warpgroup w with head dims [w d/2,
        (w + 1) d/2) of Q, of S's sum (the halves through ``sS``) and of O. ``state``: the
        pipelines' (cfg.persistent: carried from item to item, returned after this one's
        tiles), else a new one."""
        cfg = self.cfg
        p, place, split, seqlen_k, n_begin, n_end, turn, window = consume
        (q_ptr, (q_sb, q_ss, q_sh)), (o_ptr, (o_sb, o_ss, o_sh)) = p.q, p.out
        if const_expr(not cfg.producer_warp):
            cute.arch.setmaxregister_increase(cfg.consumer_regs)
        b, head_kv = place[0], place[1]
        halves = None
        if const_expr(cfg.head_split):
            wg = cute.arch.make_warp_uniform(ctidx // WARPGROUP)
            halves = (wg, sS)
            ctidx = ctidx % WARPGROUP
            self.load_q(ctidx, sQ, q_ptr, (q_sb, q_ss, q_sh), place, p.columns, wg)
        else:
            if const_expr(not cfg.persistent):  # persistent: the walk fetched it
                self.load_q(ctidx, sQ, q_ptr, (q_sb, q_ss, q_sh), place, p.columns,
                            pair=p.pair_heads if const_expr(cfg.pairs) else None)
        scale_log2 = p.scale_log2
        softcap_scale = p.softcap_scale if const_expr(cfg.softcap) else None
        v_scale = None
        if const_expr(cfg.fp8 and cfg.pairs):  # each row its own head's scales (a pair's two heads' differ)
            k_descale = (p.k_descale, p.k_descale_sb, p.k_descale_sh, p.use_k_descale)
            v_descale = (p.v_descale, p.v_descale_sb, p.v_descale_sh, p.use_v_descale)
            k_scale = self.row_descales(ctidx, place, k_descale, p.pair_heads)
            v_scale = self.row_descales(ctidx, place, v_descale, p.pair_heads)
            for r in cutlass.range_constexpr(cute.size(k_scale)):
                k_scale[r] = k_scale[r] * scale_log2
            scale_log2 = k_scale
        elif const_expr(cfg.fp8):  # the scores' scale times K's, O's normalization times V's
            k_scale = self._descale(p.k_descale, p.k_descale_sb, p.k_descale_sh, p.use_k_descale, b, head_kv)
            v_scale = self._descale(p.v_descale, p.v_descale_sb, p.v_descale_sh, p.use_v_descale, b, head_kv)
            if const_expr(cfg.softcap):
                softcap_scale = softcap_scale * k_scale
            else:
                scale_log2 = scale_log2 * k_scale
        # the sinks' logits read before the key tiles, their latency hidden behind them
        sink_log2 = self.sink_logits(ctidx, place, (p.sink, p.use_sink), split) if const_expr(cfg.local) else None
        acc_o, softmax, state = self.attend(ctidx, (sQ, *kv), pipes, place, (seqlen_k, n_begin, n_end, turn),
                                            scale_log2, (window, softcap_scale), halves, state)
        out = (o_ptr, o_sb, o_ss, o_sh, p.columns_v, p.lse, p.o_partial, p.lse_partial, split, p.splits, p.batch)
        self.epilogue(ctidx, acc_o, softmax, place, out, sink_log2, v_scale, None if halves is None else halves[0],
                      pair=p.pair_heads if const_expr(cfg.pairs) else None)
        return state

    @cute.jit
    def row_descales(self, tidx, place, descale, pair):
        """cfg.fp8 with cfg.pairs: a dequantization scale (``descale``: its address,
        strides over (batch, heads_kv) and use) for each row this thread holds, that of the
        row's own KV head: of pair ``head_kv``, head head_kv * pair + the row's place in
        it (``rows.pair_offset``'s)."""
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        ptr, sb, sh, use = descale
        coords = self._o_coords(tidx)
        values = cute.make_rmem_tensor((cute.size(coords, mode=[0]),), Float32)
        for r in cutlass.range_constexpr(cute.size(values)):
            member = (first_row + coords[r, 0][0]) % group // (group // pair)
            values[r] = self._descale(ptr, sb, sh, use, b, head_kv * pair + member)
        return values

    @cute.jit
    def _descale(self, ptr, sb, sh, use, b, head_kv):
        """A dequantization scale of (sequence b, KV head): ptr[b * sb + head_kv * sh], or 1."""
        value = Float32(1.0)
        if use != 0:
            at = (Int64(b) * sb + Int64(head_kv) * sh) * 4
            value = cute.make_tensor(cute.make_ptr(Float32, ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=4),
                                     cute.make_layout(1))[0]
        return value

    @cute.jit
    def attend(self, tidx, smem, pipes, place, keys, scale_log2, mods=(None, None), halves=None, state=None):
        """O and the softmax state of the tile's rows over key tiles n_begin .. n_end-1
        (``keys``: the sequence's seqlen_k, n_begin, n_end and the turn),
        in ``rows.key_tile`` order; smem: sQ, sK, sV; ``mods``: (the window where local,
        softcap's scale where softcap); ``halves`` (head_split): this warpgroup and the S
        halves' buffer (its thread ``tidx`` 0..127)."""
        sQ, sK, sV = smem
        seqlen_k, n_begin, n_end, turn = keys
        window, softcap_scale = mods
        cfg = self.cfg
        pipe_k, pipe_v = pipes
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        mma_qk = tiled_mma(self.mma_type, "K", "K", (1, 1, 1), cfg.tile_n)
        own = cfg.head_dim // cfg.consumers  # O's (and S's sum's) head dims of this warpgroup
        mma_pv = tiled_mma(self.mma_type, "K", "MN", (1, 1, 1), own, a_in_registers=True)
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        if const_expr(cfg.head_split):
            wg = halves[0]
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(cute.local_tile(sQ, (cfg.tile_m, own), (0, wg))))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(cute.local_tile(sK, (cfg.tile_n, own), (0, wg, None))))
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(
                cute.local_tile(transpose_smem(sV), (own, cfg.tile_n), (wg, 0, None))))
        else:
            tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
            tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
            tOrVt = thr_pv.make_fragment_B(thr_pv.partition_B(transpose_smem(sV)))
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        s_shape = thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
        coords = acc_as_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n))))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((cfg.tile_m, own)), Float32)
        acc_o.fill(0.0)
        nrows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax(scale_log2, nrows)
        softmax.reset()
        row_scale = cute.make_rmem_tensor((nrows,), Float32)
        # each row's key limit (exclusive): its token's diagonal when causal, its window's
        # end when local; local, its window's first key too
        limits = cute.make_rmem_tensor((nrows,), Int32)
        lows = cute.make_rmem_tensor((nrows,), Int32)
        for r in cutlass.range_constexpr(nrows):
            limits[r] = seqlen_k
            if const_expr(cfg.causal):
                token = token_of(first_row + coords[r, 0][0], group, seqlen_q)
                limits[r] = cutlass.min(seqlen_k, seqlen_k - seqlen_q + token + 1)
            if const_expr(cfg.local):
                token = token_of(first_row + coords[r, 0][0], group, seqlen_q)
                limits[r] = cutlass.min(seqlen_k, seqlen_k - seqlen_q + token + 1 + window.right)
                lows[r] = seqlen_k - seqlen_q + token - window.left
        # rows in use: a warp none of whose rows is one of the KV head's packed rows (their Q
        # is zero, their O not written) skips each tile's scores and softmax (with 4-8 packed
        # rows, three warps of four: docs/design.md, "Decode"). Rows past the packed ones
        # are the last, so a warp's first row is in use if any is.
        in_use = Int32(0)
        if cute.arch.vote_any_sync(first_row + coords[0, 0][0] < rows):
            in_use = Int32(1)
        # key tiles from the first whose end passes the lowest limit need the mask
        lowest = seqlen_k
        if const_expr(cfg.causal):
            lowest = cutlass.min(seqlen_k, seqlen_k - seqlen_q + first_row // group + 1)
        softmax_step = softmax.step
        score = (coords, limits, lows, lowest, softcap_scale)
        steps = n_end - n_begin
        if const_expr(state is None):  # fp8: the widened buffers' one stage
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                 1 if const_expr(cfg.fp8) else cfg.stages)
        for i in cutlass.range(steps, unroll=1):
            n_block = None if const_expr(cfg.head_split) else key_tile(i, n_end, steps, turn)
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            pipe_k.consumer_wait(state)
            wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=True)
            pipe_k.consumer_release(state)
            if const_expr(cfg.head_split):  # the two warpgroups meet at S's sum every tile
                sum_halves(acc_s, halves[1], halves[0], tidx, (HALVES_READ, HALVES_WRITTEN))
                # the tile's index taken after the sum: the order the H200 tests ran
                n_block = key_tile(i, n_end, steps, turn)
            if in_use != 0:
                self._score_tile(acc_s, n_block, score)
                softmax_step(acc_s, row_scale)
                rescale_rows(acc_o, row_scale)
            tOrP.store(acc_as_operand_a(acc_s).load().to(self.mma_type))
            pipe_v.consumer_wait(state)
            wgmma(mma_pv, acc_o, tOrP, tOrVt[None, None, None, state.index], True, wait=True)
            pipe_v.consumer_release(state)
            state.advance()
        return acc_o, softmax, state

    @cute.jit
    def _score_tile(self, acc_s, n_block, score):
        """Key tile n_block's scores capped (softcap) and masked: every tile where local
        (decode reads, it barely computes), else the tiles past the lowest row's limit."""
        cfg = self.cfg
        coords, limits, lows, lowest, softcap_scale = score
        nrows = cute.size(limits)
        if const_expr(cfg.softcap):
            cap_scores(acc_s, softcap_scale)
        if const_expr(cfg.local):
            s = acc_as_rows_cols(acc_s)
            for r in cutlass.range_constexpr(nrows):
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    key = n_block * cfg.tile_n + coords[r, c][1]
                    s[r, c] = select_f32(key < lows[r], -Float32.inf,
                                         select_f32(key >= limits[r], -Float32.inf, s[r, c]))
        else:
            if (n_block + 1) * cfg.tile_n > lowest:
                s = acc_as_rows_cols(acc_s)
                for r in cutlass.range_constexpr(nrows):
                    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                        key = n_block * cfg.tile_n + coords[r, c][1]
                        s[r, c] = select_f32(key >= limits[r], -Float32.inf, s[r, c])

    def _o_coords(self, tidx):
        """(row, column) in the tile of each element of O that thread ``tidx`` of a consumer
        warpgroup holds, as (rows, columns) (its own columns where the head dim is split)."""
        own = self.cfg.head_dim // self.cfg.consumers
        thr_pv = tiled_mma(self.mma_type, "K", "MN", (1, 1, 1), own, a_in_registers=True).get_slice(tidx)
        return acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.cfg.tile_m, own))))

    @cute.jit
    def sink_logits(self, tidx, place, sinks, split):
        """The sink's logit (exp2 domain) of each row this thread holds of O: split 0's rows
        count their head's sink (the combine's merge by LSE then counts it once); other
        splits' rows and a launch without sinks -inf. ``sinks``: the sinks' address and
        use_sink."""
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        sink_ptr, use_sink = sinks
        coords = self._o_coords(tidx)
        nrows = cute.size(coords, mode=[0])
        sink_log2 = cute.make_rmem_tensor((nrows,), Float32)
        for r in cutlass.range_constexpr(nrows):
            sink_log2[r] = -Float32.inf
            if use_sink != 0:
                if split == 0:  # the head of row p: head_kv * group + p % group, within heads_q
                    head = head_kv * group + (first_row + coords[r, 0][0]) % group
                    sink_log2[r] = cute.make_tensor(sink_ptr, cute.make_layout(heads_q))[head] * Float32(LOG2E)
        return sink_log2

    @cute.jit
    def epilogue(self, tidx, acc_o, softmax, place, out, sink_log2=None, v_scale=None, wg=None, pair=None):
        """O normalized and LSE: with one split into out and lse (the dtype), else this
        split's share into the workspace (fp32), for the combine. Rows past the KV head's
        packed rows are not written, nor O's columns past its head dim. Pairs of adjacent
        columns per store. ``sink_log2`` (local): ``sink_logits``.
        ``v_scale`` (fp8): V's dequantization scale, on O (not on LSE); with pairs, a
        register tensor of one a row (``row_descales``). ``wg`` (head_split):
        this warpgroup, whose half of O's columns it writes (LSE: warpgroup 0's). ``pair``
        (cfg.pairs: the run-time pair_heads): each row's O is its own KV head's columns of
        the pair (``rows.pair_offset``), written from column 0 of the row (out, or the split's
        share, whose rows the combine reads ``columns`` wide)."""
        cfg = self.cfg
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        o_ptr, o_sb, o_ss, o_sh, columns, lse_ptr, o_part_ptr, lse_part_ptr, split, splits, batch = out
        nrows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
        inv_sum = cute.make_rmem_tensor((nrows,), Float32)
        lse = cute.make_rmem_tensor((nrows,), Float32)
        own = cfg.head_dim // cfg.consumers
        coords = self._o_coords(tidx)
        col0 = 0  # head_split: this warpgroup's first column
        if const_expr(wg is not None):
            col0 = wg * own
        softmax.finalize(inv_sum, lse, sink_log2)
        if const_expr(v_scale is not None):
            for r in cutlass.range_constexpr(nrows):
                inv_sum[r] = inv_sum[r] * row_value(v_scale, r)
        scale_rows(acc_o, inv_sum)
        o = acc_as_rows_cols(acc_o)
        ncols = cute.size(o, mode=[1])
        for r in cutlass.range_constexpr(nrows):
            p = first_row + coords[r, 0][0]
            if p < rows:
                token, head = p // group, head_kv * group + p % group
                lse_at = (b * heads_q + head) * seqlen_q + token
                offset = 0
                if const_expr(pair is not None):  # this row's KV head's columns of the pair, from 0
                    offset = pair_offset(p, group, pair, columns)
                if splits == 1:
                    base = Int64(b) * o_sb + Int64(token) * o_ss + Int64(head) * o_sh
                    for c in cutlass.range_constexpr(0, ncols, 2):
                        pair32 = cute.make_rmem_tensor((2,), Float32)
                        pair32[0] = o[r, c]
                        pair32[1] = o[r, c + 1]
                        two = cute.make_rmem_tensor((2,), self.dtype)
                        two.store(pair32.load().to(self.dtype))
                        if const_expr(pair is None):
                            if coords[r, c][1] + col0 < columns:  # an even column: both or neither (columns % 8 == 0)
                                at = (base + coords[r, c][1] + col0) * (self.dtype.width // 8)
                                dst = cute.make_ptr(self.dtype, o_ptr.toint() + at, cute.AddressSpace.gmem,
                                                    assumed_align=4)
                                cute.autovec_copy(two, cute.make_tensor(dst, cute.make_layout(2)))
                        else:
                            if (coords[r, c][1] >= offset) & (coords[r, c][1] - offset < columns):
                                at = (base + coords[r, c][1] - offset) * (self.dtype.width // 8)
                                dst = cute.make_ptr(self.dtype, o_ptr.toint() + at, cute.AddressSpace.gmem,
                                                    assumed_align=4)
                                cute.autovec_copy(two, cute.make_tensor(dst, cute.make_layout(2)))
                    if _writes_lse(tidx, wg):
                        cute.make_tensor(lse_ptr, cute.make_layout(batch * heads_q * seqlen_q))[lse_at] = lse[r]
                else:
                    row = (Int64(split) * batch + b) * seqlen_q + token
                    part_base = (row * heads_q + head) * cfg.head_dim
                    for c in cutlass.range_constexpr(0, ncols, 2):
                        two = cute.make_rmem_tensor((2,), Float32)
                        two[0] = o[r, c]
                        two[1] = o[r, c + 1]
                        if const_expr(pair is None):
                            part_dst = cute.make_ptr(Float32, o_part_ptr.toint() + (part_base + coords[r, c][1] + col0) * 4,
                                                     cute.AddressSpace.gmem, assumed_align=8)
                            cute.autovec_copy(two, cute.make_tensor(part_dst, cute.make_layout(2)))
                        else:
                            if (coords[r, c][1] >= offset) & (coords[r, c][1] - offset < columns):
                                part_dst = cute.make_ptr(Float32,
                                                         o_part_ptr.toint() + (part_base + coords[r, c][1] - offset) * 4,
                                                         cute.AddressSpace.gmem, assumed_align=8)
                                cute.autovec_copy(two, cute.make_tensor(part_dst, cute.make_layout(2)))
                    if _writes_lse(tidx, wg):
                        lse_part_at = Int64(split) * (batch * heads_q * seqlen_q) + lse_at
                        lse_dst = cute.make_ptr(Float32, lse_part_ptr.toint() + lse_part_at * 4,
                                                cute.AddressSpace.gmem, assumed_align=4)
                        cute.make_tensor(lse_dst, cute.make_layout(1))[0] = lse[r]

