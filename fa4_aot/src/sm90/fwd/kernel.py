"""FlashAttention forward for Hopper (sm_90a), warp-specialized, TMA + wgmma.

One CTA computes one (tile_m query rows, head, batch) output tile, or with ``q_tiles`` 2
two of them (query tiles m and M-1-m: equal causal work), with the second tile's Q loaded
while the first is computed and the first's O store running under the second; the API
takes two for short key sequences (fa4_aot.policy.TWO_TILES_MAX_SEQLEN_K). Warpgroups:
- warpgroup 0, warp 0: the producer. TMA loads Q once and K, V tile by tile into
  `stages`-deep mbarrier pipelines, walking key tiles from the last (the one that may need
  masking) to the first, K one tile ahead of V.
- warpgroups 1 and 2 (and 3, 4 for 192- and 256-row tiles): consumers, 64 query rows each. S = Q K^T by SS-wgmma, masking,
  online softmax in the exp2 domain with conditional rescaling of O, P converted in registers and fed to O += P V as the
  A operand of an RS-wgmma. Within a warpgroup, S(j+1) and P(j) V(j) are in flight
  together and the softmax of S(j+1) overlaps P(j) V(j); across the warpgroups, named
  barriers hand the tensor cores round (ping-pong), so one warpgroup's softmax hides
  behind another's GEMMs. The epilogue normalizes O, stages it in shared memory
  over the spent Q buffer and writes it with one TMA store; LSE is written by the owning
  threads.
Registers are moved from the producer to the consumers with setmaxnreg.

Causal masking is bottom-right aligned; fully masked key tiles are never loaded; with one
query tile per CTA the tiles are issued in reverse order so the longest (last) start first.

Constraints: head_dim in {64, 96, 128, 192, 256}; bf16 or fp16; seqlen_q, seqlen_k >= 1;
heads_q a multiple of heads_kv. Build with ``build_kernels.py``; the kernel reads no
environment and queries no device.
"""

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...common import lpt, symbols
from ...common.params import Tma
from ...common.seqlen import packed_tile_of_cta, sequence
from ...common.launch_order import forward_head_group, launch_in_head_groups
from ..fragments import acc_as_operand_a, acc_as_rows_cols, transpose_smem
from ..mask import TileMask, Window
from ..packed_rows import PackedRows, store_rows
from ..primitives import (
    DTYPES, WARPGROUP, convert_into, sdhb, smem_buffer, smem_layout, stage_and_store, tiled_mma, tma_pipeline, wait_after,
    wgmma,
)
from ..softmax import OnlineSoftmax, cap_scores, rescale_rows, scale_rows
from ...interfaces import FWD, FWD_INPUTS, FWD_LPT
from .config import FwdConfig
from .key_tiles import KeyRange, KeyTiles

EPILOGUE_BARRIER = 1
SCHEDULER_BARRIER = 2  # .. 2 + consumers - 1: one per consumer warpgroup


def order_barrier(consumers: int) -> int:
    """The first of the consumers' order barriers (primitives.wait_after), one per warpgroup,
    after the scheduler barriers: 5 with two or three consumers, 6 with four."""
    first = SCHEDULER_BARRIER + max(consumers, 3)
    assert first + consumers <= 16, "named barrier ids overlap"  # bar.sync takes ids 0..15
    return first


class FlashFwdSm90(KeyTiles):
    """One forward variant (its ``config.FwdConfig``): host side and kernel (which key
    tiles a query tile and each warpgroup see: key_tiles.py)."""

    def __str__(self):
        return symbols.FORWARD_SM90  # the cubin's kernel names (common/symbols.py)

    def __init__(self, cfg: FwdConfig):
        self.check(cfg)
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.tma_boxes = {}
        self.smem_bytes = None

    @staticmethod
    def check(cfg: FwdConfig):
        """What this kernel's code assumes of its variant (asserted at build time)."""
        assert cfg.tile_m in (128, 192, 256), "two to four consumer warpgroups of 64 rows"
        # causal: a warpgroup's rows see at most one key tile fewer than its tile's last row
        # (attend's _skip_key_tile passes over one)
        # (local: a warpgroup passes over any number, _pass_key_tile)
        assert cfg.local or cfg.tile_m - 64 <= cfg.tile_n
        assert cfg.head_dim % 32 == 0 and cfg.tile_n % 16 == 0 and cfg.q_tiles in (1, 2)

    def _storage(self, sq, sk, sv):
        def buf(layout):
            return smem_buffer(layout, self.dtype)

        cfg = self.cfg

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * cfg.q_tiles]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.stages]
            sQ: buf(sq)  # (tile_m, d, q_tiles); each also its tile's O staging buffer (tile_m, d_v)
            sK: buf(sk)
            sV: buf(sv)
            if cfg.head_split:  # P and the rows' factors, for warpgroup 1 (head_split.py)
                sP: buf(smem_layout(self.dtype, cfg.tile_m, cfg.tile_n))
                sRows: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 2 * WARPGROUP], 16]

        return Storage

    @cute.jit
    def __call__(self, x: FWD_INPUTS.tuple_type):
        """The launches of one forward (interfaces.FWD_INPUTS): dense, the attention
        kernel; varlen, the heaviest-first sort (one CTA; the run time leaves it out where
        lpt is 0), then ``kernel_varlen`` over the packed sequences (one CTA per (query
        tile, head), the sequences' tiles back to back, O written row by row: a tile's rows
        past its sequence belong to the next one)."""
        cfg = self.cfg
        q, k, v = [sdhb(t) for t in (x.q, x.k, x.v)]
        o = None if const_expr(cfg.varlen) else sdhb(x.out)
        tma, (sq, sk, sv, so) = self._atoms(q, k, v, o)
        params = FWD.bind(cfg, x, tma)
        if const_expr(cfg.varlen):
            self.order_varlen(FWD_LPT.bind(cfg, x)).launch(
                grid=[1, 1, 1], block=[lpt.THREADS, 1, 1], smem=lpt.SMEM_BYTES
            )
            grid = (cute.ceil_div(q.shape[0], cfg.tile_m) + x.batch, q.shape[2], 1)
            self.kernel_varlen(params, sq, sk, sv, so).launch(
                grid=grid, block=[cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1
            )
        else:
            grid = (cute.ceil_div(q.shape[0], cfg.tile_m * cfg.q_tiles), q.shape[2], q.shape[3])
            self.kernel(params, sq, sk, sv, so).launch(
                grid=grid, block=[cfg.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1
            )

    @cute.kernel
    def order_varlen(self, p: FWD_LPT.tuple_type):
        """The sequences sorted by cost, heaviest first (common/lpt.py), for
        kernel_varlen's walk."""
        lpt.sort_sequences(p, self.cfg.tile_m, self.cfg.tile_n, self.cfg.causal)

    def _atoms(self, q, k, v, o):
        """TMA atoms and coordinates of Q, K, V (and O, if given) as {name: Tma}, and the
        shared layouts (sq, sk, sv, so: O's staging tiles, over Q's buffers); sets the
        storage and the manifest's boxes."""
        cfg = self.cfg
        sq = smem_layout(self.dtype, cfg.tile_m, cfg.head_dim, cfg.q_tiles)
        sk = smem_layout(self.dtype, cfg.tile_n, cfg.head_dim, cfg.stages)
        sv = smem_layout(self.dtype, cfg.tile_n, cfg.head_dim_v, cfg.stages)
        so = smem_layout(self.dtype, cfg.tile_m, cfg.head_dim_v, cfg.q_tiles)
        # O's staging tiles are read over Q's buffer (_setup): each within its own Q tile's
        # bytes (v narrower than q: one tile, its O tile the Q tile's first bytes), with the
        # same swizzle atom, so that the buffer's alignment serves both
        q_tile, o_tile = (cute.size_in_bytes(self.dtype, cute.select(t, mode=[0, 1])) for t in (sq, so))
        assert o_tile <= q_tile and (cfg.q_tiles == 1 or o_tile == q_tile), (o_tile, q_tile)
        assert str(so.inner) == str(sq.inner), (so.inner, sq.inner)
        boxes = {name: cute.select(layout, mode=[0, 1]) for name, layout in (("q", sq), ("k", sk), ("v", sv),
                                                                              ("out", so))}
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma = {name: Tma(*cpasync.make_tiled_tma_atom(load, t, boxes[name], tile))
               for name, t, tile in (("q", q, (cfg.tile_m, cfg.head_dim)), ("k", k, (cfg.tile_n, cfg.head_dim)),
                                     ("v", v, (cfg.tile_n, cfg.head_dim_v)))}
        if const_expr(o is not None):
            tma["out"] = Tma(*cpasync.make_tiled_tma_atom(store, o, boxes["out"], (cfg.tile_m, cfg.head_dim_v)))
        # name -> (atom type, smem swizzle), read by the build for the manifest
        self.tma_boxes = {name: (str(t.atom.type), str(boxes[name].inner)) for name, t in tma.items()}
        self.q_bytes = cute.size_in_bytes(self.dtype, boxes["q"])
        self.k_bytes = cute.size_in_bytes(self.dtype, boxes["k"])
        self.v_bytes = cute.size_in_bytes(self.dtype, boxes["v"])
        self.storage = self._storage(sq, sk, sv)
        self.smem_bytes = self.storage.size_in_bytes() + 1024  # + base alignment slack
        return tma, (sq, sk, sv, so)

    @cute.kernel
    def kernel(self, p: FWD.tuple_type, sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
               sv_layout: cute.ComposedLayout, so_layout: cute.ComposedLayout):
        """One CTA of the dense forward: (query tile(s), head, batch). ``p``: interfaces.FWD,
        its TMA coordinates (s, d, h, b), LSE contiguous (b, h_q, s_q)."""
        (tma_q, gQ), (tma_k, gK), (tma_v, gV), (tma_o, gO) = p.q, p.k, p.v, p.out
        lse_ptr, scale_log2 = p.lse, p.scale_log2
        warp, tidx, pipes, smem = self._setup((tma_q, tma_k, tma_v, tma_o), (sq_layout, sk_layout, sv_layout,
                                                                             so_layout))
        pipe_q, pipe_k, pipe_v = pipes
        sQ, sK, sV = smem[:3]
        bidx, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = gQ.shape[0], gK.shape[0]
        if const_expr(self.cfg.kv_head_order_keys > 0):
            # long sequences: a KV head's query heads side by side in launch order, each
            # tile's window of K and V read once for all of them (docs/design.md, "Local
            # attention, sinks, softcap"); the remap's divisions, which every warp runs
            # before the roles split, only where it is taken (unconditional, they cost
            # short-lived grids 1-5%)
            if seqlen_k > self.cfg.kv_head_order_keys:
                bidx, head = launch_in_head_groups(bidx, head, cute.arch.grid_dim()[0], cute.arch.grid_dim()[1],
                                                   gQ.shape[2] // gK.shape[2])
        if const_expr(self.cfg.q_tiles == 1):
            launch = bidx
            if const_expr(self.cfg.causal):
                # heads in L2-sized groups, heaviest tiles of the group's heads first
                launch, head = launch_in_head_groups(bidx, head, cute.arch.grid_dim()[0], cute.arch.grid_dim()[1],
                                                     forward_head_group(gK.shape[0], self.cfg.head_dim))
            m_blocks = (cute.arch.grid_dim()[0] - 1 - launch,)  # longest causal tiles first
        else:
            # the middle tile of an odd count is computed twice (same values, same writes)
            m_blocks = (cute.ceil_div(seqlen_q, self.cfg.tile_m) - 1 - bidx, bidx)
        heads_q, batches = gQ.shape[2], gQ.shape[3]
        head_kv = head // (heads_q // gK.shape[2])
        opts = self._score_options(p, head, heads_q, seqlen_q, seqlen_k)
        mLSE = cute.make_tensor(
            lse_ptr, cute.make_layout((seqlen_q, heads_q, batches), stride=(1, seqlen_q, seqlen_q * heads_q))
        )

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp < 4:
            # ---------------- producer warpgroup: TMA loads ----------------
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp == 0:
                q = (tma_q, gQ[None, None, head, batch], sQ)
                k = (tma_k, gK[None, None, head_kv, batch], sK)
                v = (tma_v, gV[None, None, head_kv, batch], sV)
                self.load(q, k, v, (pipe_q, pipe_k, pipe_v), m_blocks, seqlen_q, seqlen_k, opts.window)
        else:
            # ---------------- consumer warpgroups: MMA, softmax, epilogue ----------------
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.attend(tidx - WARPGROUP, smem, pipes, m_blocks, (seqlen_q, seqlen_k),
                        scale_log2, (tma_o, gO[None, None, head, batch], mLSE[None, head, batch]), opts)

    @cute.kernel
    def kernel_varlen(self, p: FWD.tuple_type, sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout,
                      sv_layout: cute.ComposedLayout, so_layout: cute.ComposedLayout):
        """One (query tile, head) of packed sequences: as ``kernel``, with the sequence's
        rows from cu_seqlens (common/seqlen.py); CTAs past the last tile compute an empty
        tile and write nothing. TMA coordinates (total, d, h, 1); O (total_q, h_q, d) by
        address and (row, head) strides; LSE (h_q, total_q)."""
        (tma_q, gQ), (tma_k, gK), (tma_v, gV) = p.q, p.k, p.v
        (o_ptr, (o_ss, o_sh)), lse_ptr, scale_log2 = p.out_rows, p.lse, p.scale_log2
        cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr = p.cu_seqlens_q, p.cu_seqlens_k, p.seqused_q, p.seqused_k
        use_used_q, use_used_k, batch_count, order_ptr, lpt = p.use_seqused_q, p.use_seqused_k, p.batch, p.order, p.lpt
        warp, tidx, pipes, smem = self._setup((tma_q, tma_k, tma_v), (sq_layout, sk_layout, sv_layout, so_layout))
        pipe_q, pipe_k, pipe_v = pipes
        sQ, sK, sV = smem[:3]
        total_q, total_k, heads_q = gQ.shape[0], gK.shape[0], gQ.shape[2]
        batches = batch_count
        cu_q, used_q = (cute.make_tensor(at, cute.make_layout(batches + extra))
                        for at, extra in ((cu_q_ptr, 1), (used_q_ptr, 0)))
        found, tile, head = self._varlen_item(cu_q, used_q, use_used_q, batches, total_q, heads_q,
                                              cute.make_tensor(order_ptr, cute.make_layout(batches)), lpt)
        live = found >= 0
        batch = cutlass.max(found, 0)
        seq_q = sequence(batch, cu_q, used_q, use_used_q, total_q)
        seq_k = sequence(batch, cute.make_tensor(cu_k_ptr, cute.make_layout(batches + 1)),
                         cute.make_tensor(used_k_ptr, cute.make_layout(batches)), use_used_k, total_k)
        m_block = cute.ceil_div(seq_q.length, self.cfg.tile_m) - 1 - tile  # longest causal tiles first
        seqlen_q = Int32(cutlass.select_(live, seq_q.length, 0))
        seqlen_k = Int32(cutlass.select_(live, seq_k.length, 0))
        m_blocks = (cutlass.max(m_block, 0),)
        head_kv = head // (heads_q // gK.shape[2])
        opts = self._score_options(p, head, heads_q, seqlen_q, seqlen_k)
        out = RowsOut(o_ptr, o_ss, o_sh, cute.make_tensor(lse_ptr, cute.make_layout(heads_q * total_q)),
                      seq_q.offset, total_q, head, heads_q, p.columns_v)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp < 4:
            # ---------------- producer warpgroup: TMA loads ----------------
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp == 0:
                q = (tma_q, cute.domain_offset((seq_q.offset, 0), gQ[None, None, head, 0]), sQ)
                k = (tma_k, cute.domain_offset((seq_k.offset, 0), gK[None, None, head_kv, 0]), sK)
                v = (tma_v, cute.domain_offset((seq_k.offset, 0), gV[None, None, head_kv, 0]), sV)
                self.load(q, k, v, (pipe_q, pipe_k, pipe_v), m_blocks, seqlen_q, seqlen_k, opts.window)
        else:
            # ---------------- consumer warpgroups: MMA, softmax, epilogue ----------------
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self.attend(tidx - WARPGROUP, smem, pipes, m_blocks, (seqlen_q, seqlen_k),
                        scale_log2, (None, out, None), opts)

    @cute.jit
    def _score_options(self, p, head, heads_q, seqlen_q, seqlen_k):
        """The sequence's ``ScoreOptions`` from the kernel's parameters (None for what the
        variant leaves out): its window, head ``head``'s sink in the exp2 domain (-inf
        where the call gives none), the softcap's scale."""
        window, sink_log2, softcap_scale = None, None, None
        if const_expr(self.cfg.local):
            window = Window.of(p.window_left, p.window_right, seqlen_q, seqlen_k)
            sink_log2 = -Float32.inf
            if p.use_sink != 0:
                sink_log2 = cute.make_tensor(p.sink, cute.make_layout(heads_q))[head] * Float32(LOG2E)
        if const_expr(self.cfg.softcap):
            softcap_scale = p.softcap_scale
        return ScoreOptions(window, sink_log2, softcap_scale)

    @cute.jit
    def _varlen_item(self, cu_q, used_q, use_used_q, batches, total_q, heads_q, order, lpt):
        """(sequence or -1, query tile within it, head) of this CTA. The sequences' query
        tiles back to back (no CTA per tile of a longest sequence each), CTAs past the
        last tile idle. lpt 0: CTA (x, head) takes the x-th tile of the sequences in the
        caller's order. Else the CTAs in launch order (x fastest, then y) take the
        sequences in ``order`` (heaviest first), each sequence's heads one after another
        and a head's tiles together (they share K and V in L2)."""
        bidx, head_y, _ = cute.arch.block_idx()
        return packed_tile_of_cta(bidx, head_y, cute.arch.grid_dim()[0], cu_q, used_q, use_used_q, batches, total_q,
                                  self.cfg.tile_m, order, lpt, heads_q)

    @cute.jit
    def _setup(self, atoms, layouts):
        """The CTA's start: descriptors prefetched, shared storage, pipelines, tiles
        (``layouts``: _atoms' sq, sk, sv, so). Returns (warp, tidx, (pipe_q, pipe_k,
        pipe_v), (sQ, sK, sV, sO)): sO, O's staging tiles, over sQ."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe_q = tma_pipeline(storage.mbar_q, self.cfg.q_tiles, self.cfg.num_consumers, self.q_bytes)
        k_consumers = 1 if self.cfg.head_split else self.cfg.num_consumers  # K: the warpgroups computing S
        pipe_k, pipe_v = [tma_pipeline(bar, self.cfg.stages, consumers, tx)
                          for bar, tx, consumers in ((storage.mbar_k, self.k_bytes, k_consumers),
                                                     (storage.mbar_v, self.v_bytes, self.cfg.num_consumers))]
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        return warp, tidx, (pipe_q, pipe_k, pipe_v), self._views(storage, layouts)

    def _views(self, storage, layouts):
        """The shared tiles (sQ, sK, sV, sO) of ``storage`` (``layouts``: _atoms' sq, sk,
        sv, so); sO, O's staging tiles, over sQ."""
        sq_layout, sk_layout, sv_layout, so_layout = layouts
        sQ = storage.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sK.get_tensor(sk_layout.outer, swizzle=sk_layout.inner)
        sV = storage.sV.get_tensor(sv_layout.outer, swizzle=sv_layout.inner)
        sO = storage.sQ.get_tensor(so_layout.outer, swizzle=so_layout.inner)
        return sQ, sK, sV, sO

    @cute.jit
    def load(self, q, k, v, pipes, m_blocks, seqlen_q: Int32, seqlen_k: Int32, window=None):
        """q, k, v: (TMA atom, coordinates, shared tiles) of each input, the coordinates
        gQ: (s_q, d) and gK, gV: (s_k, d) of this (head, batch); pipes: Q's, K's, V's;
        m_blocks: this CTA's query tiles, in order; window: where local. The first tile's
        first K, then every Q, then K/V, key tiles from the last down to the first."""
        (tma_q, gQ, sQ), (tma_k, gK, sK), (tma_v, gV, sV) = q, k, v
        pipe_q, pipe_k, pipe_v = pipes
        whole = cute.make_layout(1)
        tiles_k = cute.local_tile(gK, (self.cfg.tile_n, self.cfg.head_dim), (None, 0))
        tiles_v = cute.local_tile(gV, (self.cfg.tile_n, self.cfg.head_dim_v), (None, 0))
        tKs, tKg = cpasync.tma_partition(
            tma_k, 0, whole, cute.group_modes(sK, 0, 2), cute.group_modes(tiles_k, 0, 2)
        )
        tVs, tVg = cpasync.tma_partition(
            tma_v, 0, whole, cute.group_modes(sV, 0, 2), cute.group_modes(tiles_v, 0, 2)
        )
        load_k = lambda n, st: cute.copy(  # noqa: E731
            tma_k, tKg[None, n], tKs[None, st.index], tma_bar_ptr=pipe_k.producer_get_barrier(st))
        load_v = lambda n, st: cute.copy(  # noqa: E731
            tma_v, tVg[None, n], tVs[None, st.index], tma_bar_ptr=pipe_v.producer_get_barrier(st))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.stages)
        n_first = self._key_tiles(m_blocks[0], seqlen_q, seqlen_k, window)
        if n_first > self._first_key_tile(m_blocks[0], seqlen_q, seqlen_k, window):
            pipe_k.producer_acquire(kv_state)
            load_k(n_first - 1, kv_state)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.q_tiles)
        for t in cutlass.range_constexpr(self.cfg.q_tiles):
            tile_q = cute.local_tile(gQ, (self.cfg.tile_m, self.cfg.head_dim), (m_blocks[t], 0))
            tQs, tQg = cpasync.tma_partition(
                tma_q, 0, whole, cute.group_modes(sQ[None, None, t], 0, 2), cute.group_modes(tile_q, 0, 2)
            )
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQg, tQs, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        for t in cutlass.range_constexpr(self.cfg.q_tiles):
            n_blocks = self._key_tiles(m_blocks[t], seqlen_q, seqlen_k, window)
            n_min = self._first_key_tile(m_blocks[t], seqlen_q, seqlen_k, window)
            if n_blocks > n_min:
                if const_expr(t > 0):
                    pipe_k.producer_acquire(kv_state)
                    load_k(n_blocks - 1, kv_state)
                # K runs one tile ahead of V: the consumers need K(j+1) before V(j).
                for i in cutlass.range(self._less(n_blocks - 1, n_min), unroll=1):
                    v_state = kv_state.clone()
                    kv_state.advance()
                    pipe_k.producer_acquire(kv_state)
                    load_k(n_blocks - 2 - i, kv_state)
                    pipe_v.producer_acquire(v_state)
                    load_v(n_blocks - 1 - i, v_state)
                pipe_v.producer_acquire(kv_state)
                load_v(n_min, kv_state)
                if const_expr(t + 1 < self.cfg.q_tiles):
                    kv_state.advance()

    @cute.jit
    def _tiled_mmas(self):
        qk = tiled_mma(self.dtype, "K", "K", (self.cfg.num_consumers, 1, 1), self.cfg.tile_n)
        pv = tiled_mma(self.dtype, "K", "MN", (self.cfg.num_consumers, 1, 1), self.cfg.head_dim_v,
                       a_in_registers=True)
        return qk, pv

    @cute.jit
    def _fragments(self, tidx, sK, sV):
        """The consumer's GEMMs, its warpgroup, and the fragments and shapes ``attend`` uses."""
        mma_qk, mma_pv = self._tiled_mmas()
        # warp-uniform, so the warpgroup's shared-memory descriptors (its Q rows) are built
        # in uniform registers: from tidx alone they took an R2UR per descriptor per GEMM
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wg_first_thread = wg * WARPGROUP
        wg_qk = mma_qk.get_slice(wg_first_thread)
        wg_pv = mma_pv.get_slice(wg_first_thread)
        thr_qk = mma_qk.get_slice(tidx)
        thr_pv = mma_pv.get_slice(tidx)
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(transpose_smem(sV)))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.cfg.tile_m, self.cfg.tile_n)))
        s_shape = thr_qk.partition_shape_C((self.cfg.tile_m, self.cfg.tile_n))
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
        return Fragments(mma_qk, mma_pv, wg, wg_qk, thr_pv, tSrK, tOrVt, tOrP, s_shape, s_coords)

    @cute.jit
    def attend(self, tidx: Int32, smem, pipes, m_blocks, seqlens, scale_log2: Float32, out, opts):
        """tidx: 0..255 over the consumer warpgroups; smem: sQ, sK, sV, sO; pipes: Q's, K's,
        V's; m_blocks: this CTA's query tiles, in order; seqlens: (seqlen_q, seqlen_k); out:
        O's TMA atom, gO (s_q, d) and mLSE (s_q,) (varlen: None, its RowsOut, None); opts:
        ScoreOptions."""
        sQ, sK, sV, sO = smem
        seqlen_q, seqlen_k = seqlens
        pipe_q, pipe_k, pipe_v = pipes
        f = self._fragments(tidx, sK, sV)
        wg = f.wg
        window = opts.window
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.q_tiles)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.stages)
        if wg == 0:
            # The first consumer issues first. Once, not per tile: every tile leaves the last
            # consumer's final arrive on this barrier pending, which starts the next tile alike.
            cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER, number_of_threads=2 * WARPGROUP)
        for t in cutlass.range_constexpr(self.cfg.q_tiles):
            m_block = m_blocks[t]
            n_blocks = self._key_tiles(m_block, seqlen_q, seqlen_k, window)
            n_min = self._first_key_tile(m_block, seqlen_q, seqlen_k, window)
            tSrQ = f.wg_qk.make_fragment_A(f.wg_qk.partition_A(sQ[None, None, t]))
            acc_o = cute.make_rmem_tensor(f.thr_pv.partition_shape_C((self.cfg.tile_m, self.cfg.head_dim_v)), Float32)
            acc_o.fill(0.0)
            rows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
            softmax = OnlineSoftmax(scale_log2, rows)
            softmax.reset()
            row_scale = cute.make_rmem_tensor((rows,), Float32)
            first_masked = self._first_masked(m_block, seqlen_q, seqlen_k, window, wg if self.cfg.local else None)
            pipe_q.consumer_wait(q_state)
            q_state.advance()
            # A warpgroup whose 64 rows all lie past seqlen_q (the last tile of a sequence
            # that is not a multiple of the tile: at head_dim 64, 1k-16k tokens in 192-row
            # tiles, two of its three warpgroups) computes nothing: it keeps only its part
            # in the K/V pipelines and the scheduler barriers, so the one warpgroup with real
            # rows runs alone (its output rows are the only ones stored).
            n_low = self._own_first_key_tile(m_block, wg, seqlen_q, seqlen_k, window)
            n_own, idle = self._own_key_tiles(m_block, wg, n_blocks, seqlen_q, seqlen_k, window, n_low)
            if n_blocks > n_min:
                if idle:
                    kv_state = self._idle_tile(pipe_k, pipe_v, kv_state, self._less(n_blocks, n_min), wg)
                else:
                    keys = KeyRange(m_block, n_min, n_blocks, n_low, n_own, first_masked)
                    kv_state = self._key_loop(f, tSrQ, (pipe_k, pipe_v), kv_state, keys, seqlens, opts,
                                              (acc_o, softmax, row_scale))
                if const_expr(t + 1 < self.cfg.q_tiles):
                    kv_state.advance()  # the next tile's first K

            # O over this tile's spent Q; only the last store is waited for (CTA exit)
            self._finish_tile(tidx, (acc_o, softmax), f, sO[None, None, t], out, m_block, seqlen_q,
                              t == self.cfg.q_tiles - 1, opts.sink_log2)

    def _tile_masks(self):
        """(the whole mask, the left edge's, the right edge's) as bound methods: not local,
        only the first; local, only the other two. Local masks each edge apart: the third
        loop's tiles lie below first_masked (the left edge alone); the right-edge tiles take
        the left edge only where it crosses them (_left_masked_end)."""
        cfg = self.cfg
        if not cfg.local:
            return TileMask(cfg.tile_m, cfg.tile_n, cfg.causal, False).apply, None, None
        return (None, TileMask(cfg.tile_m, cfg.tile_n, cfg.causal, True, right=False).apply,
                TileMask(cfg.tile_m, cfg.tile_n, cfg.causal, True, left=False).apply)

    @cute.jit
    def _mask_tile(self, masks, acc_s, coords, tile, seqlens, edges, phase: cutlass.Constexpr[int]):
        """Masks S of ``tile`` (m_block, n_block) as _key_loop's loop ``phase`` needs: 0 (the
        first tile and the right-edge tiles) the whole mask, or local the right edge and
        the left only below ``edges``' left_end; 2 (local: the left-edge tiles) the left
        edge; 1 nothing. ``masks``: _tile_masks'; ``edges``: (the window, left_end)."""
        apply_mask, left_mask, right_mask = masks
        (m_block, n_block), (seqlen_q, seqlen_k), (window, left_end) = tile, seqlens, edges
        if const_expr(phase == 0 and self.cfg.local):
            right_mask(acc_s, coords, m_block, n_block, seqlen_q, seqlen_k, window)
            if n_block < left_end:
                left_mask(acc_s, coords, m_block, n_block, seqlen_q, seqlen_k, window)
        elif const_expr(phase == 0):
            apply_mask(acc_s, coords, m_block, n_block, seqlen_q, seqlen_k, window)
        elif const_expr(phase == 2):
            left_mask(acc_s, coords, m_block, n_block, seqlen_q, seqlen_k, window)

    @cute.jit
    def _key_loop(self, f, tSrQ, pipes, kv_state, keys, seqlens, opts, acc):
        """One query tile's key tiles for a warpgroup that computes: S, mask, online
        softmax and O += P V over its key tiles (``keys``: KeyRange), the pipelines'
        other tiles passed over; ``acc``: (O, its OnlineSoftmax, the rows' rescale
        factors). Returns kv_state at the last key tile.

        Causal, a warpgroup's rows may need fewer key tiles than the tile's last row
        (n_own: one fewer for the warpgroups of earlier rows on many diagonal tiles): it
        passes over the tile's highest key tile without computing it (_skip_key_tile).
        Local, the tile's key tiles run from n_min (its first row's window) up, and a
        warpgroup computes only its own rows' range [n_low, n_own): it passes over the
        tiles above it first and the ones below it last (_pass_key_tile), so that a
        narrow window costs each warpgroup its own span, not the tile's."""
        pipe_k, pipe_v = pipes
        m_block, n_min, n_blocks, n_low, n_own, first_masked = keys
        seqlen_q, seqlen_k = seqlens
        acc_o, softmax, row_scale = acc
        window, wg, rows = opts.window, f.wg, cute.size(row_scale)
        # Bound methods: the DSL would treat a method call on a local object inside a
        # run-time loop as a write of that object and try to carry it through the loop.
        masks, softmax_step = self._tile_masks(), softmax.step
        left_end = None
        if const_expr(self.cfg.local):
            left_end = self._left_masked_end(m_block, wg, seqlen_q, seqlen_k, window)
            for _ in cutlass.range(n_blocks - n_own, unroll=1):
                self._pass_key_tile(pipe_k, pipe_v, kv_state, wg)
                kv_state.advance()
        elif const_expr(self.cfg.masks_right):
            if n_own < n_blocks:
                kv_state = self._skip_key_tile(pipe_k, pipe_v, kv_state, wg)
        # Key tile n_own-1 (always masked): S only; its P V is issued with the next S.
        acc_s = cute.make_rmem_tensor(f.s_shape, Float32)
        pipe_k.consumer_wait(kv_state)
        wgmma(f.mma_qk, acc_s, tSrQ, f.tSrK[None, None, None, kv_state.index], False, wait=True)
        pipe_k.consumer_release(kv_state)
        if const_expr(self.cfg.softcap):
            cap_scores(acc_s, opts.softcap_scale)
        self._mask_tile(masks, acc_s, f.s_coords, (m_block, n_own - 1), seqlens, (window, left_end), 0)
        softmax_step(acc_s, row_scale)
        self._to_operand(acc_s, f.tOrP)
        # Key tiles n_own-2 .. first_masked need the mask, the rest do not: two
        # loops, so the unmasked one carries neither mask code nor a branch on it.
        # (Non-causal, only the last key tile needs the mask: no masked loop at all.)
        # Local: a third loop, masked, for the key tiles at the windows' left edges.
        masked_steps = cutlass.max(n_own - 1 - first_masked, 0) if const_expr(self.cfg.masks_right) else 0
        phases, steps_by_phase = 2, None
        if const_expr(self.cfg.local):
            total = n_own - 1 - n_low
            masked_steps = cutlass.min(masked_steps, total)
            left_steps = cutlass.min(cutlass.max(left_end - n_low, 0), total - masked_steps)
            phases, steps_by_phase = 3, (masked_steps, total - masked_steps - left_steps, left_steps)
        for phase in cutlass.range_constexpr(0 if self.cfg.masks_right else 1, phases):
            if const_expr(self.cfg.local):
                steps = steps_by_phase[phase]
            else:
                steps = masked_steps if phase == 0 else n_own - 1 - masked_steps
            for i in cutlass.range(steps, unroll=1):
                # Overlap within the warpgroup: S(j+1) = Q K(j+1)^T and O += P(j) V(j)
                # are in flight together; softmax of S(j+1) runs while P(j) V(j)
                # finishes. Across warpgroups (ping-pong): one issues its GEMMs while
                # the other does softmax, handing over through the scheduler barriers.
                n_block = n_own - 2 - i - (0 if phase == 0 else masked_steps)
                if const_expr(phase == 2):
                    n_block = n_block - steps_by_phase[1]
                v_state = kv_state.clone()
                kv_state.advance()
                acc_s = cute.make_rmem_tensor(f.s_shape, Float32)
                pipe_k.consumer_wait(kv_state)
                cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WARPGROUP)
                wgmma(f.mma_qk, acc_s, tSrQ, f.tSrK[None, None, None, kv_state.index], False, wait=False)
                pipe_v.consumer_wait(v_state)
                wgmma(f.mma_pv, acc_o, f.tOrP, f.tOrVt[None, None, None, v_state.index], True, wait=False)
                cute.arch.barrier_arrive(
                    barrier_id=SCHEDULER_BARRIER + (wg + 1) % self.cfg.num_consumers,
                    number_of_threads=2 * WARPGROUP,
                )
                warpgroup.wait_group(1)
                pipe_k.consumer_release(kv_state)
                if const_expr(self.cfg.softcap):
                    cap_scores(acc_s, opts.softcap_scale)
                self._mask_tile(masks, acc_s, f.s_coords, (m_block, n_block), seqlens, (window, left_end), phase)
                softmax_step(acc_s, row_scale)
                # P(j) V(j) must be done before P(j+1) overwrites its operand registers.
                wait_after([softmax.row_sum[r] for r in range(rows)], order_barrier(self.cfg.num_consumers) + wg,
                           WARPGROUP)
                pipe_v.consumer_release(v_state)
                # P(j+1) as the next A operand; O to the scale of P(j+1), with no wgmma in flight.
                self._to_operand(acc_s, f.tOrP, acc_o, row_scale)
        pipe_v.consumer_wait(kv_state)
        wgmma(f.mma_pv, acc_o, f.tOrP, f.tOrVt[None, None, None, kv_state.index], True, wait=True)
        pipe_v.consumer_release(kv_state)
        if const_expr(self.cfg.local):
            for _ in cutlass.range(n_low - n_min, unroll=1):
                kv_state.advance()
                self._pass_key_tile(pipe_k, pipe_v, kv_state, wg)
        return kv_state

    @cute.jit
    def _finish_tile(self, tidx, acc, f, sO, out, m_block, seqlen_q, wait_read: cutlass.Constexpr[bool],
                     sink_log2=None):
        """O normalized by the row sums (and the sink, where local) and written with LSE
        (``acc``: O and its OnlineSoftmax; ``f``: Fragments; ``out``: O's TMA atom and
        coordinates, LSE's row)."""
        acc_o, softmax = acc
        rows = cute.size(acc_as_rows_cols(acc_o), mode=[0])
        inv_sum = cute.make_rmem_tensor((rows,), Float32)
        lse = cute.make_rmem_tensor((rows,), Float32)
        softmax.finalize(inv_sum, lse, sink_log2)
        scale_rows(acc_o, inv_sum)
        self.epilogue(tidx, acc_o, lse, (f.mma_pv, f.thr_pv), sO, out, m_block, seqlen_q, wait_read)

    @cute.jit
    def _skip_key_tile(self, pipe_k, pipe_v, kv_state, wg):
        """A warpgroup whose rows see one key tile fewer than its tile: the tile's highest
        key tile passes by as the loop's first step would take it (K waited for and
        released; the first scheduler hand-off, with V's wait and release), so the rest of
        attend's loop runs as for a tile of one key tile fewer, at the same place in the
        pipelines and the hand-off order. Returns kv_state advanced past that K."""
        pipe_k.consumer_wait(kv_state)
        pipe_k.consumer_release(kv_state)
        v_state = kv_state.clone()
        kv_state.advance()
        cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WARPGROUP)
        pipe_v.consumer_wait(v_state)
        cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + (wg + 1) % self.cfg.num_consumers,
                                 number_of_threads=2 * WARPGROUP)
        pipe_v.consumer_release(v_state)
        return kv_state

    @cute.jit
    def _pass_key_tile(self, pipe_k, pipe_v, kv_state, wg):
        """Local: a key tile outside the warpgroup's rows' windows passes by as a step of
        attend's loop would take it (K and V waited for and released, one scheduler
        hand-off), kv_state left where it is: every warpgroup then releases every stage
        and hands off once per key tile but the first it computes."""
        pipe_k.consumer_wait(kv_state)
        pipe_k.consumer_release(kv_state)
        cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WARPGROUP)
        pipe_v.consumer_wait(kv_state)
        cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + (wg + 1) % self.cfg.num_consumers,
                                 number_of_threads=2 * WARPGROUP)
        pipe_v.consumer_release(kv_state)

    @cute.jit
    def _idle_tile(self, pipe_k, pipe_v, kv_state, n_blocks, wg):
        """attend's key loop for a warpgroup with no rows in the sequence: every key tile but
        the last passes by as in _skip_key_tile (its K and V waited for and released, one
        scheduler hand-off each), the last one's K and V as the loop's final P V takes them
        (no hand-off): the same K/V releases (the stages are refilled once every consumer
        has released them) and the same hand-offs, in the same order, without the GEMMs and
        the softmax. Returns kv_state at the last key tile, as the loop leaves it."""
        for _ in cutlass.range(n_blocks - 1, unroll=1):
            kv_state = self._skip_key_tile(pipe_k, pipe_v, kv_state, wg)
        pipe_k.consumer_wait(kv_state)
        pipe_k.consumer_release(kv_state)
        pipe_v.consumer_wait(kv_state)
        pipe_v.consumer_release(kv_state)
        return kv_state

    @cute.jit
    def _to_operand(self, acc_s, tOrP, acc_o=None, row_scale=None):
        """P in the input dtype into tOrP, the A operand of the P V wgmma; then, if given,
        O rescaled by row_scale.

        bf16 tiles of 80 or 112 columns (head_dim 256, 192) take convert_into: the DSL's
        own conversion goes element by element there, and ptxas then fences every k-block
        of the P V wgmma (measured 1-6% faster with convert_into, O rescaled first).
        Elsewhere the DSL's conversion and the original order (convert_into measured 1-3%
        slower at head_dim 128): docs/design.md, "Forward: softmax and conditional rescaling".
        """
        paired = self.cfg.paired_convert
        if const_expr(paired and acc_o is not None):
            rescale_rows(acc_o, row_scale)
        if const_expr(paired):
            convert_into(acc_as_operand_a(acc_s), tOrP)
        else:
            tOrP.store(acc_as_operand_a(acc_s).load().to(self.dtype))
        if const_expr(not paired and acc_o is not None):
            rescale_rows(acc_o, row_scale)

    @cute.jit
    def epilogue(self, tidx, acc_o, lse, mmas, sO, out, m_block, seqlen_q, wait_read: cutlass.Constexpr[bool]):
        """O: registers -> shared (over Q) -> one TMA store; LSE: quad leaders write rows
        (``mmas``: the P V GEMM and this thread's slice; ``out``: O's TMA atom, gO, mLSE).
        Varlen (``gO``: the sequence's RowsOut): O's rows written from shared memory."""
        mma_pv, thr_pv = mmas
        tma_o, gO, mLSE = out
        if const_expr(self.cfg.varlen):
            self._epilogue_rows(tidx, acc_o, lse, mma_pv, thr_pv, sO, gO, m_block, seqlen_q)
        else:
            tile_o = cute.local_tile(gO, (self.cfg.tile_m, self.cfg.head_dim_v), (m_block, 0))
            stage_and_store(tidx, acc_o, self.dtype, mma_pv, sO, tma_o, tile_o, EPILOGUE_BARRIER,
                            self.cfg.num_consumers * WARPGROUP, wait_read)
            coords = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.cfg.tile_m,
                                                                                     self.cfg.head_dim_v))))
            if tidx % 4 == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = m_block * self.cfg.tile_m + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE[row] = lse[r]

    @cute.jit
    def _epilogue_rows(self, tidx, acc_o, lse, mma_pv, thr_pv, sO, out, m_block, seqlen_q):
        """Varlen: O staged in shared memory (over Q) as for the TMA store, then written 16
        bytes per access by every consumer thread, only the sequence's rows (the tile's
        other rows belong to the next sequence) and the tensor's columns; LSE likewise, at
        (head, offset + row)."""
        cfg = self.cfg
        threads = cfg.num_consumers * WARPGROUP
        staged = cute.make_rmem_tensor_like(acc_o, self.dtype)
        staged.store(acc_o.load().to(self.dtype))
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        copy = cute.make_tiled_copy_C(atom, mma_pv)
        thr = copy.get_slice(tidx)
        cute.copy(copy, thr.retile(staged), thr.partition_D(sO))
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER, number_of_threads=threads)
        first_row = m_block * cfg.tile_m
        store_rows(tidx, threads, sO, PackedRows(out.o_ptr, out.o_ss, out.o_sh, out.columns, out.offset, seqlen_q,
                                                 out.head), first_row)
        coords = acc_as_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))))
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = first_row + coords[r, 0][0]
                if row < seqlen_q:
                    out.lse[out.head * out.total + out.offset + row] = lse[r]


LOG2E = math.log2(math.e)


class ScoreOptions(NamedTuple):
    """What a variant adds to the scores, None where it is not built: the sequence's
    window (mask.Window) and the head's sink logit times log2(e) (-inf: none), where
    local; softmax_scale / cap, where softcap."""

    window: object
    sink_log2: object
    softcap_scale: object


class Fragments(NamedTuple):
    """A consumer's GEMMs, warpgroup and fragments (``_fragments``)."""

    mma_qk: object
    mma_pv: object
    wg: object  # the warpgroup, warp-uniform
    wg_qk: object
    thr_pv: object
    tSrK: object
    tOrVt: object
    tOrP: object
    s_shape: object
    s_coords: object


class RowsOut(NamedTuple):
    """Where a varlen CTA writes: O (its address and row and head strides, in elements),
    LSE (h_q, total_q) as one flat tensor, the sequence's first row, the packed rows, the
    head, the query heads, O's head dim (columns: at most the variant's)."""

    o_ptr: object
    o_ss: object
    o_sh: object
    lse: object
    offset: object
    total: object
    head: object
    heads_q: object
    columns: object
