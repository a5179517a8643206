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
from ..mask import Window
from ..softmax import OnlineSoftmax, cap_scores, rescale_rows, row_value, scale_rows
from ..widen import widen_tile
from ...common import symbols
from ...common.params import Tma
from ...interfaces import DECODE, DECODE_INPUTS
from .config import DecodeConfig

Q_BARRIER = 1  # the consumer warpgroup's Q tile written to shared memory (head_split: 1, 2 by warpgroup)
HALVES_WRITTEN = 3  # head_split: both warpgroups' S halves in shared memory
HALVES_READ = 4  # head_split: both have read the other's half
LOG2E = math.log2(math.e)


def _writes_lse(tidx, wg):
    """Whether this epilogue thread writes its rows' LSE: a quad's first (head_split:
    warpgroup 0's)."""
    if const_expr(wg is None):
        return tidx % 4 == 0
    return (tidx % 4 == 0) & (wg == 0)


def _key_tile(i, n_end, steps, turn):
    """The ``i``-th key tile a CTA takes of its ``steps`` ending at ``n_end``: from the
    last, downwards, starting ``turn`` tiles in and wrapping around. i and turn are both
    below steps, so the wrap is one compare, not a division (each tile, in the producer's
    and the consumer's loops)."""
    j = i + turn
    return n_end - 1 - cutlass.select_(j >= steps, j - steps, j)


def _token_head(p, group, seqlen_q, head_kv):
    """(token, query head) of packed row ``p`` of KV head ``head_kv``."""
    token = _token(p, group, seqlen_q)
    return token, head_kv * group + p - token * group


@cute.jit
def _token(p, group, seqlen_q):
    """The token of packed row ``p`` (p // group). With one token every packed row in use
    is below group: 0, with no division (rows past them are neither read nor written)."""
    token = Int32(0)
    if seqlen_q > 1:
        token = p // group
    return token


def _pair_offset(p, group, pair, columns):
    """cfg.pairs: the first column of packed row ``p``'s KV head within its pair (``pair``
    KV heads side by side, each ``columns`` wide; ``group``: query heads per pair), 0 where
    ``pair`` is 1."""
    return (p % group) // (group // pair) * columns


class DecodeSm90:
    """One decode variant (its ``config.DecodeConfig``): host side and kernel."""

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
    def _work(self, p, page_rows, bidx, b, shape):
        """One CTA's work, (row tile x split ``bidx``, sequence ``b``): its row tile and split,
        the sequence's keys, the window, the key tiles [n_begin, n_end), the keys its rows
        see and where in its range it starts. ``shape``: (group, packed rows, row tiles)."""
        cfg = self.cfg
        group, rows, m_tiles = shape
        seqlen_q, splits = p.seqlen_q, p.splits
        # one row tile (seqlen_q x group up to tile_m: every one-token decode): no division
        m_block, split = Int32(0), bidx
        if m_tiles > 1:
            m_block, split = bidx % m_tiles, bidx // m_tiles
        # keys of the sequence: clamped to the cache (or the page table's reach)
        reach = cutlass.select_(p.paged != 0, p.max_pages * page_rows, page_rows)
        seqlen_k = reach
        if p.full_cache == 0:
            seqlens = cute.make_tensor(p.cache_seqlens, cute.make_layout(p.batch))
            seqlen_k = cutlass.min(cutlass.max(seqlens[b], Int32(0)), reach)
        window = Window.of(p.window_left, p.window_right, seqlen_q, seqlen_k) if const_expr(cfg.local) else None
        n_begin, n_end, keys = self._key_range(m_block, split, splits, rows, group, seqlen_q, seqlen_k, window)
        # Where in its key range a CTA starts (it wraps around): every (sequence, split)
        # elsewhere, the KV heads of one together. CTAs that walk ranges a power of two
        # apart in step read addresses that the memory's channel hash maps alike and queue
        # on the same channels (measured: 1.6-1.9 TB/s unturned, docs/design.md, "Decode").
        turn = ((b * splits + split) * p.turn_stride) % cutlass.max(n_end - n_begin, Int32(1))
        return m_block, split, seqlen_k, window, n_begin, n_end, keys, turn

    @cute.jit
    def walk(self, warp, tidx, first, kv, sQ, pipes, p, shape):
        """cfg.persistent: this CTA's items, ``first`` and every grid's width after it, of
        the (row tile x split, KV head, sequence) items in launch order. Warp 4 loads each
        item's tiles through the pipelines as their stages free up (so the next item's
        tiles arrive while the consumer finishes the last); warps 0-3 consume them
        (``walk_consume``). Both roles work out each item's range themselves."""
        cfg = self.cfg
        gK = kv[0][1]
        per_head = shape[2] * p.splits
        per_seq = per_head * gK.shape[2]
        items = per_seq * p.batch
        ctas = cute.arch.grid_dim()[0]
        if warp == 4:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
            for item in cutlass.range(first, items, ctas, unroll=1):
                b, head_kv, bidx = self._item(item, per_seq, per_head)
                _, _, _, _, n_begin, n_end, keys, turn = self._work(p, gK.shape[0], bidx, b, shape)
                state = self.load_in_turn(kv, pipes, p, head_kv, b, (n_begin, n_end, turn, keys), state)
        else:
            self.walk_consume(tidx, (first, items, ctas, per_seq, per_head), kv, sQ, pipes, p, shape)

    @cute.jit
    def walk_consume(self, tidx, walk, kv, sQ, pipes, p, shape):
        """The consumer's walk (``walk``: its first item, the items, the grid's width and
        the items a sequence and a KV head hold). Q is in two buffers (``sQ``'s last mode):
        once an item's Q has arrived, the next item's is fetched into the other buffer
        (``fetch_q``, cp.async), so its latency passes behind this item's tiles."""
        cfg = self.cfg
        first, items, ctas, per_seq, per_head = walk
        (_, gK, sK), (_, _, sV) = kv
        group, rows, m_tiles = shape
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        (q_ptr, q_strides), columns = p.q, p.columns
        parity = Int32(0)
        b, head_kv, bidx = self._item(first, per_seq, per_head)
        self.fetch_q(tidx, sQ[None, None, 0], q_ptr, q_strides, (b, head_kv, group, p.seqlen_q, p.heads_q,
                     self._m_block(bidx, m_tiles) * cfg.tile_m, rows), columns)
        for item in cutlass.range(first, items, ctas, unroll=1):
            b, head_kv, bidx = self._item(item, per_seq, per_head)
            m_block, split, seqlen_k, window, n_begin, n_end, keys, turn = self._work(p, gK.shape[0], bidx, b, shape)
            place = (b, head_kv, group, p.seqlen_q, p.heads_q, m_block * cfg.tile_m, rows)
            work = (p, place, split, seqlen_k, n_begin, n_end, turn, window)
            # this item's Q arrived (and the zeros beside it), visible to the wgmma
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=Q_BARRIER, number_of_threads=WARPGROUP)
            after = item + ctas
            if after < items:  # the other buffer's last reader, the item before, is done
                b_n, head_n, bidx_n = self._item(after, per_seq, per_head)
                self.fetch_q(tidx, sQ[None, None, 1 - parity], q_ptr, q_strides,
                             (b_n, head_n, group, p.seqlen_q, p.heads_q,
                              self._m_block(bidx_n, m_tiles) * cfg.tile_m, rows), columns)
            state = self.consume(tidx, sQ[None, None, parity], (sK, sV), pipes, work, state=state)
            parity = 1 - parity

    @staticmethod
    def _item(item, per_seq, per_head):
        """(sequence, KV head, row tile x split) of walk item ``item``."""
        b = item // per_seq
        head_kv = (item - b * per_seq) // per_head
        return b, head_kv, item - b * per_seq - head_kv * per_head

    @cute.jit
    def _m_block(self, bidx, m_tiles):
        m_block = Int32(0)
        if m_tiles > 1:
            m_block = bidx % m_tiles
        return m_block

    @cute.jit
    def fetch_q(self, tidx, sQ, q_ptr, q_strides, place, columns):
        """cfg.persistent: an item's packed Q rows into buffer ``sQ`` by cp.async, 16 bytes a
        copy, committed as one group; zeros (plain stores) where the rows or columns are
        not in use (as ``load_q``). The caller waits for the group, fences and meets the
        other consumer threads before a wgmma reads it."""
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        q_sb, q_ss, q_sh = q_strides
        vec = 16 // (self.dtype.width // 8)
        per_row = self.cfg.head_dim // vec
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype, num_bits_per_copy=128)
        for i in cutlass.range_constexpr(self.cfg.tile_m * per_row // WARPGROUP):
            chunk = i * WARPGROUP + tidx
            r, part = chunk // per_row, chunk % per_row
            p = first_row + r
            dst = cute.local_tile(sQ[r, None], (vec,), (part,))
            if (p < rows) & (part * vec < columns):
                token, head = _token_head(p, group, seqlen_q, head_kv)
                at = (Int64(b) * q_sb + Int64(token) * q_ss + Int64(head) * q_sh + part * vec) * (self.dtype.width // 8)
                src = cute.make_ptr(self.dtype, q_ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
                cute.copy(atom, cute.make_tensor(src, cute.make_layout(vec)), dst)
            else:
                zeros = cute.make_rmem_tensor((vec,), self.dtype)
                zeros.fill(0.0)
                cute.autovec_copy(zeros, dst)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def load_in_turn(self, kv, pipes, p, head_kv, b, tiles, state):
        """cfg.persistent: one item's K and V tiles (``tiles``: n_begin, n_end, the turn and
        the keys its rows see) in ``_key_tile`` order, each tile's K then its V, from
        pipeline ``state`` on; returns the state after them."""
        (tma_k, gK, sK), (tma_v, gV, sV) = kv
        n_begin, n_end, turn, keys = tiles
        table = cute.make_tensor(p.page_table, cute.make_layout(p.batch * p.max_pages))
        pages = (table, b * p.max_pages, p.max_pages, gK.shape[0], gK.shape[3], p.paged, p.piece_rows)
        pipe_k, pipe_v = pipes
        steps = n_end - n_begin
        for i in cutlass.range(steps, unroll=1):
            place = self._piece_place(_key_tile(i, n_end, steps, turn), pages, b, keys)
            pipe_k.producer_acquire(state)
            self._load_tile(tma_k, gK, sK, pipe_k, state, place, pages, head_kv)
            pipe_v.producer_acquire(state)
            self._load_tile(tma_v, gV, sV, pipe_v, state, place, pages, head_kv)
            state.advance()
        return state

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
        it (``_pair_offset``'s)."""
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
    def widen(self, tidx, narrow, wide, pipes, steps):
        """The widener warpgroup (its thread ``tidx``): each key tile's e4m3 K, then V, as
        TMA fills their stages, into the 16-bit buffer the consumer reads once it has
        released the tile before (one buffer each: K of a tile is widened while the
        consumer reads the V before it)."""
        (sK, sV), ((sKw, sVw), (pipe_kw, pipe_vw)) = narrow, wide
        pipe_k, pipe_v = pipes
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        wstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for _ in cutlass.range(steps, unroll=1):
            self._widen_stage(tidx, pipe_k, sK, pipe_kw, sKw, state, wstate)
            self._widen_stage(tidx, pipe_v, sV, pipe_vw, sVw, state, wstate)
            state.advance()
            wstate.advance()

    @cute.jit
    def _widen_stage(self, tidx, pipe, src, pipe_w, dst, state, wstate):
        pipe.consumer_wait(state)
        pipe_w.producer_acquire(wstate)
        widen_tile(tidx, src[None, None, state.index], dst[None, None, 0], WARPGROUP)
        cute.arch.fence_proxy("async.shared", space="cta")  # the writes, visible to the wgmma
        pipe_w.producer_commit(wstate)
        pipe.consumer_release(state)

    @cute.jit
    def _key_range(self, m_block, split, splits, rows, group, seqlen_q, seqlen_k, window=None):
        """[n_begin, n_end): the key tiles of split ``split`` of row tile ``m_block``, and
        the keys [first, last) its rows see. Causal, the tile sees keys up to its last
        token's diagonal; local, from its first token's window start to its last token's
        window end (the splits share those)."""
        limit = seqlen_k
        if const_expr(self.cfg.causal or self.cfg.local):
            # one token: its rows' token is 0 (no division by group)
            last_token = Int32(0)
            if seqlen_q > 1:
                last_token = cutlass.min(seqlen_q - 1, (m_block * self.cfg.tile_m + self.cfg.tile_m - 1) // group)
            last_key = seqlen_k - seqlen_q + last_token + 1  # exclusive
            if const_expr(self.cfg.local):
                last_key = cutlass.min(last_key + window.right, seqlen_k)
            limit = cutlass.max(last_key, Int32(0))
        n_tiles = cute.ceil_div(limit, self.cfg.tile_n)
        first_key = Int32(0)
        if const_expr(self.cfg.local):
            first_token = Int32(0)
            if m_block > 0:
                first_token = (m_block * self.cfg.tile_m) // group
            first_key = cutlass.max(seqlen_k - seqlen_q + first_token - window.left, Int32(0))
            n_low = cutlass.min(first_key // self.cfg.tile_n, n_tiles)
            per = n_tiles - n_low  # one split: no division
            if splits > 1:
                per = cute.ceil_div(n_tiles - n_low, splits)
            n_begin = cutlass.min(n_low + split * per, n_tiles)
        else:
            per = n_tiles
            if splits > 1:
                per = cute.ceil_div(n_tiles, splits)
            n_begin = cutlass.min(split * per, n_tiles)
        n_end = cutlass.min(n_begin + per, n_tiles)
        return n_begin, n_end, (first_key, limit)

    @cute.jit
    def load(self, k, v, pipes, p, head_kv, b, n_begin, n_end, turn, keys):
        """K and V of the CTA's key tiles in ``_key_tile`` order, K one tile ahead of V;
        each tile in pieces of ``piece_rows`` keys, each from its page. A tile's pieces
        are looked up in the page table by one lane each, once for its K and its V.
        ``keys``: [first, last) the CTA's rows see (cfg.piece_rows: the pieces wholly
        outside are not read, ``_piece_place``)."""
        (tma_k, gK, sK), (tma_v, gV, sV) = k, v
        table = cute.make_tensor(p.page_table, cute.make_layout(p.batch * p.max_pages))
        pages = (table, b * p.max_pages, p.max_pages, gK.shape[0], gK.shape[3], p.paged, p.piece_rows)
        pipe_k, pipe_v = pipes
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
        steps = n_end - n_begin
        if steps > 0:
            place_next = self._piece_place(_key_tile(0, n_end, steps, turn), pages, b, keys)
            pipe_k.producer_acquire(state)
            self._load_tile(tma_k, gK, sK, pipe_k, state, place_next, pages, head_kv)
            for i in cutlass.range(steps - 1, unroll=1):
                place = place_next
                place_next = self._piece_place(_key_tile(i + 1, n_end, steps, turn), pages, b, keys)
                v_state = state.clone()
                state.advance()
                pipe_k.producer_acquire(state)
                self._load_tile(tma_k, gK, sK, pipe_k, state, place_next, pages, head_kv)
                pipe_v.producer_acquire(v_state)
                self._load_tile(tma_v, gV, sV, pipe_v, v_state, place, pages, head_kv)
            pipe_v.producer_acquire(state)
            self._load_tile(tma_v, gV, sV, pipe_v, state, place_next, pages, head_kv)

    @cute.jit
    def _piece_place(self, n_block, pages, b, keys):
        """(page, row in the page) of lane j's piece of key tile ``n_block`` (lanes past
        the tile's pieces: of its first), as an Int32 pair per lane. cfg.piece_rows (a
        window's edges mid-tile): a piece wholly outside ``keys`` [first, last) is placed
        past its page's rows, so TMA fills it with zeros and reads nothing (the consumer
        masks those keys; a zero V row adds nothing to O)."""
        table, first_entry, max_pages, page_rows, num_pages, paged, piece_rows = pages
        lane = cute.arch.lane_idx()
        j = cutlass.select_(lane * piece_rows < self.cfg.tile_n, lane, Int32(0))
        key = n_block * self.cfg.tile_n + j * piece_rows
        page, row = b, key
        if paged != 0:
            entry = cutlass.min(key // page_rows, max_pages - 1)
            page = cutlass.min(cutlass.max(table[first_entry + entry], Int32(0)), num_pages - 1)
            row = key % page_rows
        if const_expr(self.cfg.piece_rows != 0):
            first, last = keys
            row = cutlass.select_((key + piece_rows <= first) | (key >= last), page_rows, row)
        return page, row

    @cute.jit
    def _load_tile(self, atom, g, s, pipe, state, place, pages, head_kv):
        piece_rows = pages[6]
        page_of, row_of = place
        whole = cute.make_layout(1)
        for j in cutlass.range(self.cfg.tile_n // piece_rows, unroll=1):
            page = cute.arch.shuffle_sync(page_of, j)
            row = cute.arch.shuffle_sync(row_of, j)
            tile = cute.local_tile(cute.domain_offset((row, 0), g[None, None, head_kv, page]),
                                   (self.cfg.tile_n, self.cfg.head_dim), (0, 0))
            dst = cute.domain_offset((j * piece_rows, 0), s[None, None, state.index])
            t_s, t_g = cpasync.tma_partition(atom, 0, whole, cute.group_modes(dst, 0, 2), cute.group_modes(tile, 0, 2))
            cute.copy(atom, t_g, t_s, tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def load_q(self, tidx, sQ, q_ptr, q_strides, place, columns, wg=None, pair=None):
        """The tile's packed Q rows into shared memory, 16 bytes per access (rows past the
        KV head's rows and columns past Q's head dim ``columns`` are zeros), made visible
        to the wgmma; head_split, warpgroup ``wg``'s half of the columns (its own S half
        reads no other); ``pair`` (cfg.pairs: the run-time pair_heads), each row's Q at its
        own KV head's offset in the pair (``_pair_offset``), zeros elsewhere."""
        b, head_kv, group, seqlen_q, heads_q, first_row, rows = place
        q_sb, q_ss, q_sh = q_strides
        vec = 16 // (self.dtype.width // 8)
        per_row = self.cfg.head_dim // vec // self.cfg.consumers
        for i in cutlass.range_constexpr(self.cfg.tile_m * per_row // WARPGROUP):
            chunk = i * WARPGROUP + tidx
            r, part = chunk // per_row, chunk % per_row
            if const_expr(wg is not None):
                part = part + wg * per_row
            p = first_row + r
            values = cute.make_rmem_tensor((vec,), self.dtype)
            values.fill(0.0)
            if const_expr(pair is None):
                if (p < rows) & (part * vec < columns):
                    token, head = _token_head(p, group, seqlen_q, head_kv)
                    at = (Int64(b) * q_sb + Int64(token) * q_ss + Int64(head) * q_sh + part * vec) * (self.dtype.width // 8)
                    src = cute.make_ptr(self.dtype, q_ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
                    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(vec)), values)
            else:
                col = part * vec - _pair_offset(p, group, pair, columns)  # q's column of this chunk
                if (p < rows) & (col >= 0) & (col < columns):
                    token, head = _token_head(p, group, seqlen_q, head_kv)
                    at = (Int64(b) * q_sb + Int64(token) * q_ss + Int64(head) * q_sh + col) * (self.dtype.width // 8)
                    src = cute.make_ptr(self.dtype, q_ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
                    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(vec)), values)
            if const_expr(self.mma_type is not self.dtype):  # bf16 q for fp16 wgmmas (an FP8 cache)
                wide = cute.make_rmem_tensor((vec,), self.mma_type)
                wide.store(values.load().to(self.mma_type))
                values = wide
            cute.autovec_copy(values, cute.local_tile(sQ[r, None], (vec,), (part,)))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=Q_BARRIER if const_expr(wg is None) else Q_BARRIER + wg,
                          number_of_threads=WARPGROUP)

    @cute.jit
    def attend(self, tidx, smem, pipes, place, keys, scale_log2, mods=(None, None), halves=None, state=None):
        """O and the softmax state of the tile's rows over key tiles n_begin .. n_end-1
        (``keys``: the sequence's seqlen_k, n_begin, n_end and the turn),
        in ``_key_tile`` order; smem: sQ, sK, sV; ``mods``: (the window where local,
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
                token = _token(first_row + coords[r, 0][0], group, seqlen_q)
                limits[r] = cutlass.min(seqlen_k, seqlen_k - seqlen_q + token + 1)
            if const_expr(cfg.local):
                token = _token(first_row + coords[r, 0][0], group, seqlen_q)
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
            n_block = None if const_expr(cfg.head_split) else _key_tile(i, n_end, steps, turn)
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            pipe_k.consumer_wait(state)
            wgmma(mma_qk, acc_s, tSrQ, tSrK[None, None, None, state.index], False, wait=True)
            pipe_k.consumer_release(state)
            if const_expr(cfg.head_split):  # the two warpgroups meet at S's sum every tile
                sum_halves(acc_s, halves[1], halves[0], tidx, (HALVES_READ, HALVES_WRITTEN))
                # the tile's index taken after the sum: the order the H200 tests ran
                n_block = _key_tile(i, n_end, steps, turn)
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
        the pair (``_pair_offset``), written from column 0 of the row (out, or the split's
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
                    offset = _pair_offset(p, group, pair, columns)
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

