"""FlashAttention backward for Hopper (sm_90a): three kernels launched in order.

1. ``preprocess`` (``bwd_rows_sm90``): D = rowsum(dO * O) in fp32, LSE moved to the exp2
   domain, the dQ semaphores cleared, and the fp32 dQ accumulator unless ``first_write``
   (run time: then each tile's first dQ share is stored instead of added).
2. ``kernel`` (one CTA per key tile, KV head and batch): K and V stay in shared memory.
   Warp 0 streams Q and dO tiles of 64 query rows (80 at head_dim 128 not causal: see
   variants.BWD_SM90_TILING_NOT_CAUSAL), each with the tile's LSE2 or D values
   on the same mbarrier stage (separate pipelines, so dO can be reloaded as soon as dV's
   GEMM is done) for every query head of the KV head's group (causal: from the tile at
   the CTA's diagonal up; not causal and not deterministic: from a tile of its own,
   wrapping, so a head's CTAs do not reduce into the same dQ tile at once);
   two consumer warpgroups compute
       S^T = K Q^T, dP^T = V dO^T          (SS-wgmma, keys x queries)
       P^T = exp2(S^T * scale*log2(e) - LSE2),  dS^T = P^T (dP^T - D)
       dV += P^T dO, dK += dS^T Q
       dQ_tile = dS K                      (dS through shared memory)
   and stage dQ_tile in shared memory for warp 1, the dQ writer, which adds it into the
   fp32 accumulator by a bulk reduce-add (2D TMA into rows; at head_dim 96 and 128 one
   1D reduce of the tile staged in fragment order): in any order by default (with the
   run-time ``first_write``, fa4_aot.api: the first CTA to take a tile's ticket stores
   instead, and the others add once that store is complete, so the accumulator needs no
   clearing; deterministic, a tile's first turn stores), or, when
   deterministic, in a fixed key-tile order per query tile and accumulator copy, serialized by a
   per-(run of query tiles, head, copy) semaphore (shortest-processing-time order for
   causal; two copies when not causal, variants.dq_chains; see ``bwd_dq_handoff``).
   Per head dim:
   - 64 not causal (``compute_wide``, in bwd_wide_sm90): two query tiles per step, 128
     queries: each warpgroup computes S^T, dP^T of its 64 keys over both, and the dQ of
     one whole tile, staged in fragment order.
   - 64 (causal), 96, 128: 128 keys per CTA, 64 per warpgroup; P^T and dS^T stay in registers as
     the A operands of dV and dK (at 64, K and V too, as those of S^T and dP^T). dQ is
     split along head_dim: warpgroup w computes
     columns [w d/2, (w+1) d/2) from the whole dS tile, so the two reduces are disjoint
     (Q, dO, K in the swizzle whose atom fits the halves: 64 bytes at 64, 32 at 96);
     at 64 it is split along queries instead, as dQ^T = K^T dS^T with K^T in registers
     (warpgroup w: query rows [32 w, 32 w + 32)); with 80-row tiles (128 not causal) it
     is dQ^T too, K^T from shared memory, warpgroup w computing head dims [64 w, 64 w +
     64) of all 80 queries, and the staging is single-buffered (shared memory is full).
     Elsewhere the dQ staging is double-buffered, and
     at 96 (not deterministic) the warpgroups are staggered: the dQ GEMM of a query tile
     is issued at the start of the next one, once the other warpgroup has said its dS
     half is ready (``compute``, in bwd_keys_on_m_sm90).
   - 192, 256 (``compute_head_on_m``, in bwd_head_on_m_sm90): S and dP split by keys
     between the consumer warpgroups, dV^T, dK^T and dQ^T by head dims (the head dim on
     the GEMMs' M side, 64 per warpgroup at 192, 128 at 256); P and dS through shared
     memory; Q/dO single-buffered. 192: 96 keys per CTA, three consumer warpgroups (160
     registers each), a dQ staging buffer per warpgroup (194 KB). 256: 80 keys, two
     consumer warpgroups, dQ staged in three 16 KB buffers the step's four parts take in
     turn (214 KB).
   dK (times scale) and dV are written once, by TMA, after the last query tile.
   Persistent (head_dim 64 causal, bf16, not deterministic, up to PERSISTENT_MAX_KEYS keys): one
   CTA per SM walks these (key tile, KV head, batch) items in launch order, K and V
   double-buffered and dK, dV staged over the item's K and V, so that one item's start and
   end overlap the steps of the next and the last (``persistent`` in __init__).
3. ``postprocess`` (``bwd_rows_sm90``): dQ = accumulator * scale, in the input dtype (0
   for a query tile or copy no key tile wrote: causal rows that see no key).

Kernels 2 and 3 are launched with programmatic stream serialization (PDL; the manifest's
``programmatic``): each may be placed on the GPU once every block of the one before has
started. The main kernel waits with griddepcontrol.wait before it reads what the
preprocess writes; the postprocess waits only for its head: each key tile's dQ writer,
once its adds are complete, counts itself in every query head of its group (``dq_done``,
release), and a postprocess block converts its tile once its head's count is the number
of key tiles (acquire), so heads whose key tiles are done are converted while the main
kernel's last CTAs still run.

GQA/MQA: a CTA loops over the query heads of its KV head, so dK and dV of a shared head sum
every query head's contribution in registers, in a fixed order.
Constraints: head_dim in {64, 96, 128, 192, 256}; see fwd_sm90 for the rest.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ....variants import bwd_step_tiles, bwd_tail_split, dq_chains, dq_fragment_order
from .dq_writer import DQ_WRITER_WARP, DqHandoff
from ...common.bwd_order import first_query_tile, key_tile_of_launch, piece_tiles, tail_item
from .head_on_m import HeadOnMCompute
from .keys_on_m import KeysOnMCompute
from .pre_post import BwdRowsSm90, DqFragments
from .split_last_wave import TailPieces
from .two_query_tiles import WideCompute
from ...common import symbols
from ...common.launch_order import backward_head_group, launch_in_head_groups
from ..fragments import acc_as_rows_cols
from ..primitives import WARPGROUP, bulk_copy_g2s, sdhb, select_f32, smem_buffer, smem_layout, tma_pipeline

PRODUCER_REGS = 24
# per consumer thread: two consumer warpgroups 240, three 160 (the register file holds
# 128 x 24 + 384 x 160)
CONSUMER_REGS = {2: 240, 3: 160}
# Persistent variants (see FlashBwdSm90.persistent) take one CTA per SM up to this many
# keys, one CTA per key tile beyond (the same kernel walks one item then; the grid rule in
# the manifest decides).
PERSISTENT_MAX_KEYS = 2048
# Not causal, not deterministic: CTAs start their query loop at multiples of this many tiles.
ROTATION_TILES = 2


class FlashBwdSm90(KeysOnMCompute, WideCompute, HeadOnMCompute, DqHandoff, TailPieces):
    """Compile-time knobs of one backward variant; see fa4_aot.variants.Variant."""

    def __str__(self):
        return symbols.BACKWARD_SM90  # the cubin's kernel names (common/symbols.py)


    def __init__(self, dtype, head_dim: int, causal: bool, deterministic: bool,
                 tile_m: int, tile_n: int, stages: int, q_tiles: int = 1):
        # head_on_m (head_dim 192, 256): dK, dV and dQ computed transposed, the head dim on
        # the M side of the GEMMs, 64 (192: three consumer warpgroups, 96 keys per CTA) or
        # 128 (256: two, 80 keys) head dims per warpgroup (bwd_head_on_m_sm90); P and dS go
        # through shared memory (the other head dims keep P in registers).
        self.head_on_m = head_dim in (192, 256)
        # 64 query rows per step; 80 at head_dim 128 not causal (variants.BWD_SM90_TILING)
        assert head_dim in (64, 96, 128, 192, 256) and (tile_m == 64 or (tile_m, head_dim, causal) == (80, 128, False))
        assert tile_n == {192: 96, 256: 80}.get(head_dim, 128)
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.deterministic = deterministic
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.stages = stages
        self.num_consumers = 3 if head_dim == 192 else 2
        # head_dim 64 (not causal, deterministic, or q_tiles 2): two query tiles per step
        # (``wide``, bwd_wide_sm90; variants.bwd_step_tiles; FA4's
        # Hopper shape): S^T and dP^T of 64 keys x 128 queries per warpgroup, the per-step
        # work (waits, barriers, descriptors) paid once per 128 rows. Each warpgroup then
        # computes the dQ of one whole query tile (dS rows from shared memory, K) and stages
        # it in fragment order; the writer adds tiles as before. Q and dO stages are 128
        # rows. Measured against the one-tile kernel (session 17, same process): +5-6% at
        # 4k-16k keys, deterministic +2%, 1k -1% (no persistent CTAs here).
        # query tiles per step; the dQ hand-off counts tiles (wide: two a step, one per warpgroup)
        self.step_tiles = bwd_step_tiles(head_dim, causal, deterministic, q_tiles)
        self.wide = self.step_tiles == 2
        self.step_rows = 2 * tile_m if self.wide else tile_m
        # the one-tile head_dim 64 kernel (causal, not deterministic, q_tiles 1), which the
        # knobs below name "head_dim 64"
        one_tile_64 = head_dim == 64 and not self.wide
        self.threads = WARPGROUP * (1 + self.num_consumers)
        # dQ = dS K per query tile, split along head_dim: warpgroup w computes columns
        # [w d/2, (w+1) d/2) over all keys, from the whole dS tile in shared memory, so the
        # two reduces cover disjoint halves. (Each warpgroup computing all columns from its
        # own 64 keys, warpgroup 1 adding into warpgroup 0's staging buffer, measured 5-10%
        # slower at head_dim 64 and 96: docs/perf-notes.md, session 3.)
        # head_on_m: each warpgroup's head dims of dQ^T in GEMMs of dq_chunk rows (two at
        # 256, one at 192), each staged as one part.
        self.dq_chunk = 64
        # Q, dO, K are wgmma operands in head_dim halves, so the swizzle atom must divide
        # d/2: the 64-byte swizzle at 64 and 192, the 32-byte one at 96; 128 and 256 keep
        # the 128-byte one (64-column halves or chunks).
        self.col_parts = 1 if head_dim == 128 or self.head_on_m or self.wide else 2
        self.dq_cols = head_dim if self.wide else head_dim // 2
        # head_dim 64: dQ^T = K^T dS^T instead, warpgroup w computing query rows
        # [32 w, 32 w + 32) of the tile over all head dims, with K^T (64 x 128 keys) read once
        # into registers as the A operand: the GEMM then reads only its 32 rows of dS from
        # shared memory (8 KB per warpgroup, where dQ = dS K read the whole dS tile and a
        # K^T half: 24 KB), on a kernel bound by shared-memory bandwidth.
        # 80-row tiles (head_dim 128): dQ^T = K^T dS^T too, as the GEMM's M must be a multiple
        # of 64 (the 80 queries go on N), warpgroup w computing head dims [64 w, 64 w + 64)
        # over all queries, with K^T from shared memory (no registers to spare).
        self.dq_transposed = one_tile_64 or tile_m % 64 != 0
        self.dq_kt_in_registers = one_tile_64
        # 80-row tiles: a thread's S^T columns are 20 queries; their LSE2 and D values are
        # read from shared memory where used instead of held in registers
        self.stats_by_query = tile_m % 64 != 0
        # the (rows, cols) of dQ one warpgroup stages per step, and their place in the tile
        # (head_on_m: a warpgroup's head dims in 64-column chunks, one tile each)
        if self.dq_kt_in_registers:
            self.dq_tile = (tile_m // 2, head_dim)
        else:
            self.dq_tile = (tile_m, self.dq_chunk if self.head_on_m else self.dq_cols)
        # staged tiles per step, one reduce each (wide: the hand-off counts query tiles, each
        # one warpgroup's whole tile, one part)
        self.dq_parts = head_dim // self.dq_chunk if self.head_on_m else (1 if self.wide else self.num_consumers)
        # Double-buffered staging, so a warpgroup waits for the writer only when the writer
        # is two steps behind. Not head_on_m: its shared memory is full. Deterministic variants
        # too since their writer returns a buffer once read and accumulates into two
        # copies (one staging buffer measured faster before that; session 8: d64 det
        # +2-4%, d128 +0.5-1%, docs/perf-notes.md). Causal head_dim 64 takes three (184 KB),
        # where a head's CTAs reduce into the same query tiles at once and the writer lags
        # by more: +0.5-1.5%; not causal, -1% (session 13).
        # 80-row tiles: one (Q, dO, dS and the staging then take 225 KB). wide: two, which
        # the two warpgroups' tiles of a step take (a buffer per warpgroup, FA4's; two each
        # do not fit next to 128-row stages and double-buffered dS).
        self.dq_stages = 1 if self.head_on_m or tile_m == 80 else (3 if one_tile_64 and causal else 2)
        # head_on_m: three 16 KB buffers that the parts of a step take in turn (at 256 its
        # four parts: four buffers do not fit next to 80-key K and V; at 192 one per part)
        self.dq_slots = 3 if self.head_on_m else self.dq_parts * self.dq_stages
        # head_dim 64: K and V read once into registers as the A operands of S^T and dP^T
        # (32 registers), so those GEMMs read only Q and dO from shared memory (ncu: its
        # pipe 76% busy, 1796 wavefronts a step for 1280 tensor cycles; this takes 252
        # off): +0-5% non-deterministic, +4-9% deterministic. Wider heads have no
        # registers to spare (at 128 ptxas serializes every wgmma).
        self.kv_in_registers = one_tile_64
        # Staggered warpgroups (64, 96): a warpgroup issues the dQ GEMM of a query tile at
        # the start of the next tile, once the other warpgroup has put its half of that
        # tile's dS in shared memory, instead of both meeting at a barrier every tile; so
        # the faster one waits with its next GEMMs already queued. dQ's accumulator is
        # then live next to S^T and dP^T, which does not fit at 128. Not deterministic:
        # the later dQ delays the ordered reduces other CTAs wait for (measured slower).
        # Not at 64 either: with K^T in registers (dq_transposed) the staggered loop spills
        # (152 bytes); unstaggered and transposed measured +1-4% over staggered.
        self.stagger = head_dim <= 96 and not deterministic and not self.dq_transposed
        # dS double-buffered: one barrier per step orders its reuse. head_on_m: single P
        # and dS buffers (shared memory is full), a second barrier orders their reuse.
        self.ds_stages = 1 if self.head_on_m else 2
        # Rotated query loops (not causal, not deterministic: see kernel). Deterministic
        # turns must only wait for CTAs launched earlier (lower key tiles), which a
        # rotation breaks: a CTA would wait at a tile for one not yet resident (deadlock).
        self.rotate = not causal and not deterministic
        # CTAs in L2-sized groups of heads (launch_order): causal and not deterministic, a
        # wave then holds the heaviest tiles of several heads (session 8); deterministic and
        # not causal, +5-6% at 4k, 1-2% at 1k (session 19; FA4's deterministic mode swizzles
        # its heads so too). Deterministic causal measured 0-2% slower with them (on the
        # 64-row kernel it then ran).
        self.head_groups = causal != deterministic
        # head_dim 64, bf16: a tile's S^T is issued behind the previous tile's dK GEMM (see
        # _overlapped_step): +1-2% not deterministic, -1 to +2% deterministic, for spilled
        # registers (8 bytes; 16 with session 11's early try-waits, reloaded once a step).
        # The same code in fp16 runs out of registers (ptxas serializes every wgmma, C7512);
        # wider heads too.
        self.overlap_scores = one_tile_64 and dtype is cutlass.BFloat16
        self.chains = dq_chains(causal, deterministic)  # copies of the dQ accumulator
        # Where the run-time flag first_write is set (fa4_aot.api), the preprocess does
        # not clear the dQ accumulator (half its bytes: the 128 MB accumulator at 16k
        # tokens x 2048): each query tile's first dQ share is stored, the later ones added.
        # Not deterministic, the first is whoever takes the tile's ticket first (its dQ
        # semaphore word; ``tickets``), the others add once that store is marked complete;
        # deterministic, the first turn at the tile in each accumulator copy
        # (bwd_order.first_dq_key_tile), the turns ordering the rest. The postprocess
        # writes zeros for a tile (copy) nobody wrote. See dq_writer.
        self.tickets = not deterministic
        # Persistent CTAs (head_dim 64, not deterministic): one CTA per SM (the manifest's
        # grid rule "persistent") walks the key tiles in launch order, item = block + k *
        # grid. K and V are double-buffered, so the next item's land during this one's
        # last steps, and dK, dV are staged over this item's K and V (dead once they are in
        # registers): a CTA's start (K, V loads) and end (dK, dV stores, exit) overlap its
        # neighbours' steps, which at 1k keys are ~16% of the kernel (ncu, session 13).
        # Not deterministic: a turn may wait for an item of a CTA that is not resident.
        self.persistent = one_tile_64 and not deterministic and dtype is cutlass.BFloat16
        self.kv_stages = 2 if self.persistent else 1
        # The last partial wave's key tiles split by query range (bwd_tail; variants.tail_split):
        # the grid is then one-dimensional, the split's run-time values decide its length.
        self.tail_split = bwd_tail_split(head_dim, causal, deterministic)
        assert not (self.tail_split and (self.persistent or self.head_on_m))
        # head_dim 96 and 128: each thread stages its dQ fragment in register order, 16
        # bytes a store, contiguous across the warp (no bank conflicts, half the stores of
        # the 64-bit row-layout ones), and the writer adds each staged tile with one 1D
        # bulk reduce into a fragment-order accumulator, which the postprocess puts in
        # place: +2-5% at 128, +3-6% at 96 (deterministic +3-12%). 64 keeps the row layout
        # (its transposed staging has no conflicts; measured -2 to +2%), and so do 192 and
        # 256 (-3 to +2%) (docs/perf-notes.md, session 11).
        # (wide: each warpgroup's whole query tile is one part; in fragment order its 16-byte
        # stores replaced the row layout's 64-bit ones, which conflicted two ways in the
        # banks: +5-7% at 4k-16k keys, session 17)
        self.dq_fragment_order = dq_fragment_order(head_dim, causal, deterministic, q_tiles)
        fragments = None
        if self.dq_fragment_order:
            fragments = DqFragments(self._mma_dq, self._dq_acc_shape(), self.dq_transposed, self.dq_parts)
        self.rows = BwdRowsSm90(dtype, head_dim, tile_m, self.chains, fragments, causal, tile_n,
                                self.tickets)  # pre/postprocess
        self.tma_boxes = {}
        self.smem_bytes = None

    def _storage(self, s_q, s_kv, s_ds, s_dq):
        def buf(layout, dtype=self.dtype):
            return smem_buffer(layout, dtype)

        stages, p_in_smem = self.stages, self.head_on_m
        stats = cute.struct.Align[cute.struct.MemRange[Float32, self.step_rows * stages], 128]

        @cute.struct
        class Storage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * self.kv_stages]
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
        rows_grid = (cute.ceil_div(s_q, self.tile_m), h_q, b)
        self.rows.preprocess(
            mO.iterator, mO.stride[0], mO.stride[1], mO.stride[2],
            mdO.iterator, mdO.stride[0], mdO.stride[1], mdO.stride[2],
            mLSE.iterator, mLSE2.iterator, mDsum.iterator, mdQacc.iterator, mSem.iterator, mDone.iterator,
            mTail.iterator, s_q, h_q, first_write,
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1])

        q, k, v, do, dk, dv, dq_acc = [sdhb(t) for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc)]
        s_q_tile = smem_layout(self.dtype, self.step_rows, self.head_dim, self.stages, self.col_parts)
        # one query tile: the TMA box (wide: each stage holds two, loaded apart)
        s_q_one = smem_layout(self.dtype, self.tile_m, self.head_dim, col_parts=self.col_parts)
        s_kv = smem_layout(self.dtype, self.tile_n, self.head_dim, col_parts=self.col_parts)
        s_kv_all = s_kv
        if const_expr(self.persistent):
            s_kv_all = smem_layout(self.dtype, self.tile_n, self.head_dim, self.kv_stages, self.col_parts)
        if const_expr(self.head_on_m):
            s_ds = smem_layout(self.dtype, self.tile_n, self.tile_m)  # (keys, queries)
        else:
            s_ds = smem_layout(self.dtype, self.step_rows, self.tile_n, self.ds_stages)  # (queries, keys, stage)
        s_dq = smem_layout(Float32, *self.dq_tile, self.dq_slots)
        s_dq_one = cute.select(s_dq, mode=[0, 1])
        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        tma_q, gq = cpasync.make_tiled_tma_atom(load, q, s_q_one, (self.tile_m, self.head_dim))
        tma_do, gdo = cpasync.make_tiled_tma_atom(load, do, s_q_one, (self.tile_m, self.head_dim))
        tma_k, gk = cpasync.make_tiled_tma_atom(load, k, s_kv, (self.tile_n, self.head_dim))
        tma_v, gv = cpasync.make_tiled_tma_atom(load, v, s_kv, (self.tile_n, self.head_dim))
        tma_dk, gdk = cpasync.make_tiled_tma_atom(store, dk, s_kv, (self.tile_n, self.head_dim))
        tma_dv, gdv = cpasync.make_tiled_tma_atom(store, dv, s_kv, (self.tile_n, self.head_dim))
        boxes = [("q", tma_q, s_q_one), ("do", tma_do, s_q_one), ("k", tma_k, s_kv),
                 ("v", tma_v, s_kv), ("dk", tma_dk, s_kv), ("dv", tma_dv, s_kv)]
        # fragment order: 1D bulk reduces (and stores) at dq_accum's address instead
        tma_dq, gdq, tma_dq_store = None, None, None
        if const_expr(not self.dq_fragment_order):
            tma_dq, gdq = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), dq_acc, s_dq_one, self.dq_tile)
            boxes.append(("dq_accum", tma_dq, s_dq_one))
            # a tile's first dQ share is stored (first_write); same tensor map (the
            # operation is the instruction's, not the map's): the manifest encodes it
            # from dq_accum's recipe, and compile checks that the two atoms agree
            tma_dq_store, _ = cpasync.make_tiled_tma_atom(store, dq_acc, s_dq_one, self.dq_tile)
            self.dq_store_box = (str(tma_dq_store.type), str(s_dq_one.inner))
        self.tma_boxes = {name: (str(atom.type), str(layout.inner)) for name, atom, layout in boxes}
        self.q_bytes = cute.size_in_bytes(self.dtype, s_q_one)
        self.kv_bytes = cute.size_in_bytes(self.dtype, s_kv)
        self.storage = self._storage(s_q_tile, s_kv_all, s_ds, s_dq)
        self.smem_bytes = self.storage.size_in_bytes() + 1024
        grid = (cute.ceil_div(k.shape[0], self.tile_n), k.shape[2], k.shape[3])
        self.kernel(
            tma_q, gq, tma_do, gdo, tma_k, gk, tma_v, gv, tma_dk, gdk, tma_dv, gdv, tma_dq, gdq, tma_dq_store,
            mLSE2.iterator, mDsum.iterator, mSem.iterator, mdQacc.iterator, mDone.iterator, scale, scale_log2,
            turn_tiles, first_write, mTail.iterator, mPartial.iterator, tail_tiles, tail_pieces,
            s_q_tile, s_kv_all, s_ds, s_dq,
        ).launch(grid=grid, block=[self.threads, 1, 1], smem=self.smem_bytes, min_blocks_per_mp=1)

        self.rows.postprocess(
            mdQacc.iterator, mSem.iterator, mDone.iterator, mdQ.iterator, mdQ.stride[0], mdQ.stride[1], mdQ.stride[2],
            s_q,
            mK.shape[1], h_q, scale, first_write,
        ).launch(grid=rows_grid, block=[self.rows.threads, 1, 1], smem=self.rows.post_smem_bytes)

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
        partial_ptr: cute.Pointer,  # float32: the split tiles' dK, dV sums (bwd_tail)
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
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)
            if const_expr(not self.dq_fragment_order):
                cpasync.prefetch_descriptor(tma_dq)
                cpasync.prefetch_descriptor(tma_dq_store)
        storage = cutlass.utils.SmemAllocator().allocate(self.storage)
        pipe_kv = tma_pipeline(storage.mbar_kv, self.kv_stages, self.num_consumers, 2 * self.kv_bytes)
        # Q and dO in separate pipelines: dO is released once dV's GEMM is done, Q after dK's.
        # Each Q (dO) stage also carries its tile's LSE2 (D) values: 4 * tile_m bytes more.
        step_bytes = (self.q_bytes + 4 * self.tile_m) * (self.step_rows // self.tile_m)
        pipe_q, pipe_do = [tma_pipeline(bar, self.stages, self.num_consumers, step_bytes)
                           for bar in (storage.mbar_q, storage.mbar_do)]
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sdO = storage.sdO.get_tensor(sq_layout.outer, swizzle=sq_layout.inner)
        sK = storage.sK.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
        sV = storage.sV.get_tensor(skv_layout.outer, swizzle=skv_layout.inner)
        sdS = storage.sdS.get_tensor(sds_layout.outer, swizzle=sds_layout.inner)
        if const_expr(self.dq_fragment_order):
            # (4 values, thread of the warpgroup, 16-byte chunk, buffer): see DqFragments
            part = self.dq_tile[0] * self.dq_tile[1]
            sdQ = cute.make_tensor(storage.sdQ.data_ptr(), cute.make_layout(
                (4, WARPGROUP, part // WARPGROUP // 4, self.dq_slots), stride=(1, 4, 4 * WARPGROUP, part)))
        else:
            sdQ = storage.sdQ.get_tensor(sdq_layout.outer, swizzle=sdq_layout.inner)
        stats_layout = cute.make_layout((self.step_rows, self.stages))
        sLSE2, sDsum = storage.sLSE2.get_tensor(stats_layout), storage.sDsum.get_tensor(stats_layout)
        staging = smem_layout(self.dtype, self.tile_n, self.head_dim, col_parts=self.col_parts)  # dK, dV over spent Q, dO
        sdK = storage.sQ.get_tensor(staging.outer, swizzle=staging.inner)
        sdV = storage.sdO.get_tensor(staging.outer, swizzle=staging.inner)

        seqlen_q, seqlen_k = gQ.shape[0], gK.shape[0]
        heads_q = gQ.shape[2]
        group = heads_q // gK.shape[2]
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        if const_expr(self.persistent):
            # the items (key tile, KV head, batch) in launch order, x fastest; this CTA's
            # are block + k * grid
            n_tiles, heads_kv = cute.ceil_div(seqlen_k, self.tile_n), gK.shape[2]
            items, first, stride = n_tiles * heads_kv * gK.shape[3], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        else:
            launch, head_kv, batch = cute.arch.block_idx()
            n_tiles, heads_kv = cute.ceil_div(seqlen_k, self.tile_n), gK.shape[2]
            tail = None
            if const_expr(self.tail_split):
                # one-dimensional grid: whole items in launch order, then the last tail_tiles
                # in pieces
                whole, split, piece = tail_item(launch, n_tiles * heads_kv * gK.shape[3], tail_tiles, tail_pieces)
                tail = (split, tail_ptr, partial_ptr, tail_pieces)
                work = self._work_of_item(whole, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks,
                                          (split, piece, tail_pieces))
            else:
                work = self._work(launch, head_kv, batch, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp < 4:
            # ---------------- producer warpgroup: TMA loads ----------------
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                sources = (tma_q, gQ, sQ, tma_do, gdO, sdO, tma_k, gK, sK, tma_v, gV, sV, pipe_kv, pipe_q, pipe_do)
                stats = (lse2_ptr, sLSE2, dsum_ptr, sDsum, m_blocks, heads_q, group)
                if const_expr(self.persistent):
                    for item in cutlass.range(first, items, stride, unroll=1):
                        mine = self._work_of_item(item, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks)
                        kv_state, state = self.load(sources, stats, kv_state, state, *mine)
                elif const_expr(self.wide):
                    self.load_wide(sources, stats, kv_state, state, *work)
                else:
                    self.load(sources, stats, kv_state, state, *work)
            if warp == DQ_WRITER_WARP:
                cute.arch.griddepcontrol_wait()  # the cleared semaphores, counters (and accumulator)
                cute.arch.griddepcontrol_launch_dependents()  # only now: see above
                args = (tidx, sdQ, tma_dq, tma_dq_store, gdQacc, dqacc_ptr, sem_ptr, done_ptr, group, seqlen_q,
                        seqlen_k, heads_q, turn_tiles, first_write)
                if const_expr(self.persistent):
                    done = Int32(0)  # the CTA's steps before this item
                    for item in cutlass.range(first, items, stride, unroll=1):
                        mine = self._work_of_item(item, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks)
                        self.dq_writer(*args, *mine, done, None)
                        done = done + mine[-1]
                else:
                    self.dq_writer(*args, *work, 0, tail)
        else:
            # ---------------- consumer warpgroups ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS[self.num_consumers])
            if const_expr(self.head_on_m):
                # dK and dV staged over the spent K and V (tiles of the same shape)
                n_block, head_kv, batch, m_first, span, steps = work
                sP = storage.sP.get_tensor(sds_layout.outer, swizzle=sds_layout.inner)
                self.compute_head_on_m(
                    tidx - WARPGROUP, sQ, sdO, sK, sV, sP, sdS, sdQ, pipe_kv, pipe_q, pipe_do, n_block,
                    m_first, span, steps, seqlen_q, seqlen_k, sLSE2, sDsum, scale, scale_log2,
                    tma_dk, gdK[None, None, head_kv, batch], tma_dv, gdV[None, None, head_kv, batch],
                )
            else:
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                args = (tidx - WARPGROUP, sQ, sdO, sK, sV, sdS, sdK, sdV, sdQ, pipe_kv, pipe_q, pipe_do, group,
                        seqlen_q, seqlen_k, heads_q, sLSE2, sDsum, scale, scale_log2, tma_dk, gdK, tma_dv, gdV)
                if const_expr(self.persistent):
                    done = Int32(0)
                    for item in cutlass.range(first, items, stride, unroll=1):
                        mine = self._work_of_item(item, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks)
                        kv_state, state = self.compute(*args, kv_state, state, *mine, done, None)
                        done = done + mine[-1]
                    self._drain_dq((tidx - WARPGROUP) // WARPGROUP, done)
                elif const_expr(self.wide):
                    self.compute_wide(*args, kv_state, state, *work, tail)
                else:
                    self.compute(*args, kv_state, state, *work, 0, tail)

    @cute.jit
    def _work_of_item(self, item, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks, piece=None):
        """``_work`` of the item-th CTA in launch order (persistent, or the split tail's)."""
        return self._work(item % n_tiles, (item // n_tiles) % heads_kv, item // (n_tiles * heads_kv),
                          n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks, piece)

    @cute.jit
    def _work(self, launch, head_kv, batch, n_tiles, heads_kv, seqlen_q, seqlen_k, group, m_blocks, piece=None):
        """(key tile, KV head, batch, first query tile, query tiles per query head, steps)
        of the CTA launched at (launch, head_kv, batch) of a (n_tiles, heads_kv, batch)
        grid; ``piece``: (split tile or -1, piece, pieces) of the split tail (bwd_tail), whose
        pieces take their own query tiles (the run time splits only where a CTA walks one
        query head's tiles, group 1)."""
        if const_expr(self.head_groups):
            launch, head_kv = launch_in_head_groups(launch, head_kv, n_tiles, heads_kv,
                                                    backward_head_group(seqlen_q, self.head_dim, group, self.chains))
        n_block = key_tile_of_launch(launch, n_tiles, self.causal, self.deterministic)
        m_first = Int32(first_query_tile(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal))
        span = cutlass.max(m_blocks - m_first, 0)
        if const_expr(self.rotate):
            # Not causal, every CTA of a head visits every query tile: each starts at its own
            # tile (spread over the head in steps of ROTATION_TILES) and wraps around, so
            # the CTAs of a head reduce into different dQ tiles at any moment (see _m_block).
            runs = cute.ceil_div(m_blocks, ROTATION_TILES)
            m_first = (n_block * runs // cute.ceil_div(seqlen_k, self.tile_n)) * ROTATION_TILES
        steps = group * span
        if const_expr(piece is not None):
            split, j, pieces = piece
            piece_first, piece_count = piece_tiles(j, pieces, m_blocks, self.step_rows // self.tile_m)
            m_first = cutlass.select_(split >= 0, piece_first, m_first)
            steps = cutlass.select_(split >= 0, piece_count, steps)
        return n_block, head_kv, batch, m_first, span, steps

    @cute.jit
    def load(self, sources, stats, kv_state, state, n_block, head_kv, batch, m_first, span, steps):
        """Warp 0, one item (a CTA's key tile): K and V; then per step dO (with the tile's
        D) and Q (with its LSE2), each tile and its 64 statistics on one mbarrier stage.
        Returns the advanced pipeline states."""
        tma_q, gQ, sQ, tma_do, gdO, sdO, tma_k, gK, sK, tma_v, gV, sV, pipe_kv, pipe_q, pipe_do = sources
        lse2_ptr, sLSE2, dsum_ptr, sDsum, m_blocks, heads_q, group = stats
        whole = cute.make_layout(1)
        self._load_kv(sources, kv_state, n_block, head_kv, batch)
        for step in cutlass.range(steps, unroll=1):
            head_q = head_kv * group + step // span
            m_block = self._m_block(step, m_first, span, m_blocks)
            stats_at = self._stats_at(batch, heads_q, head_q, m_blocks, m_block)
            # dO first: the consumers release it before Q. Each tile's statistics follow it
            # at once, except at an item's first step, where they follow both tiles (K, V and
            # the first Q and dO tiles are put in flight before the wait for the preprocess,
            # whose output they are: see kernel, programmatic launch; the wait returns at
            # once after the first). (Statistics after
            # both tiles at every step paid for the deterministic d64 kernel while its
            # turns cost two barriers; with one, equal: docs/perf-notes.md, session 12.)
            loads = ((tma_do, gdO, sdO, pipe_do, dsum_ptr, sDsum), (tma_q, gQ, sQ, pipe_q, lse2_ptr, sLSE2))
            for atom, g_all, s_all, pipe, stats_ptr, s_stats in loads:
                pipe.producer_acquire(state)
                q_tile = cute.local_tile(g_all[None, None, head_q, batch], (self.tile_m, self.head_dim), (m_block, 0))
                part_s, part_g = cpasync.tma_partition(
                    atom, 0, whole, cute.group_modes(s_all, 0, 2), cute.group_modes(q_tile, 0, 2))
                cute.copy(atom, part_g, part_s[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
                if step > 0:
                    self._load_stats(s_stats, stats_ptr + stats_at, pipe, state)
            if step == 0:
                cute.arch.griddepcontrol_wait()
                for _, _, _, pipe, stats_ptr, s_stats in loads:
                    self._load_stats(s_stats, stats_ptr + stats_at, pipe, state)
            state.advance()
        return kv_state, state

    def _load_kv(self, sources, kv_state, n_block, head_kv, batch):
        """Warp 0: the item's K and V tiles onto one mbarrier stage (persistent: the
        item's stage of two); advances kv_state."""
        _, _, _, _, _, _, tma_k, gK, sK, tma_v, gV, sV, pipe_kv, _, _ = sources
        pipe_kv.producer_acquire(kv_state)
        for atom, g, s in ((tma_k, gK, sK), (tma_v, gV, sV)):
            tile = cute.local_tile(g[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
            t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                             cute.group_modes(tile, 0, 2))
            if const_expr(self.persistent):
                t_s = t_s[None, kv_state.index]
            cute.copy(atom, t_g, t_s, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        kv_state.advance()

    def _stats_at(self, batch, heads_q, head_q, m_blocks, m_block):
        """Element offset of query tile m_block's statistics in the LSE2 or D workspace
        ((b, h_q, s_q padded to whole tiles))."""
        return ((batch * heads_q + head_q) * m_blocks + m_block) * self.tile_m

    def _load_stats(self, s_stats, src, pipe, state, half: int = 0):
        """A tile's tile_m statistics (LSE2 or D) onto its stage's mbarrier, at row
        half * tile_m of the stage (wide: each stage holds two tiles')."""
        with cute.arch.elect_one():
            bulk_copy_g2s(s_stats[None, state.index].iterator + half * self.tile_m, src,
                          pipe.producer_get_barrier(state), 4 * self.tile_m)

    @cute.jit
    def _m_block(self, step, m_first, span, m_blocks):
        """The query tile of ``step``: m_first, m_first + 1, ... over the span, wrapping
        past the last tile when not causal (m_first is then the CTA's rotation start)."""
        return self._m_block_at(step % span, m_first, m_blocks)

    @cute.jit
    def _m_block_at(self, offset, m_first, m_blocks):
        """The query tile ``offset`` tiles into the CTA's span (as ``_m_block``)."""
        m_block = m_first + offset
        if const_expr(self.rotate):
            if m_block >= m_blocks:
                m_block = m_block - m_blocks
        return m_block

    @cute.jit
    def _probs(self, acc_s, s_coords, lse2, n_block, m_block, seqlen_q, seqlen_k, scale_log2,
               queries_on_rows: cutlass.Constexpr[bool] = False, by_query: cutlass.Constexpr[bool] = False,
               m_upper=None):
        """S^T -> P^T (or, ``queries_on_rows``, S -> P) in place: exp2(S * scale * log2(e) -
        LSE2), 0 where masked; ``lse2`` holds this thread's queries' values (by column, or by
        row), or, ``by_query``, is the stage's shared (tile_m,) values, read where used (no
        registers held for them). Only the last key tile (padding) and, causal, tiles that
        cross the diagonal are masked. ``m_upper`` (wide, causal): the query tile of the
        step's queries from tile_m on, which need not follow m_block (a pair of tiles that
        spans two query heads of a GQA group).

        Keys on rows, the scores are masked (to -inf) before the exponentials, so that no
        branch stands between the exponentials and dS: ptxas then spreads the MUFU.EX2s among
        dS's arithmetic instead of issuing forty in a row (session 20: d64 causal +4%, d128
        causal +2.5%). Queries on rows (head_on_m), the exponentials come first and the mask
        after (to 0): there the other order let ptxas sink the exponentials behind dP's wait
        and the dS barrier (d256 -3 to -4%)."""
        s = acc_as_rows_cols(acc_s)
        if const_expr(not queries_on_rows):
            self._mask_scores(s, s_coords, n_block, m_block, seqlen_q, seqlen_k, -Float32.inf, False, m_upper)
        if const_expr(by_query):
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                value = lse2[s_coords[0, j][1]]
                for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                    s[r, j] = cute.math.exp2(s[r, j] * scale_log2 - value, fastmath=True)
        else:
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, j] = cute.math.exp2(s[r, j] * scale_log2 - lse2[r if queries_on_rows else j],
                                             fastmath=True)
        if const_expr(queries_on_rows):
            self._mask_scores(s, s_coords, n_block, m_block, seqlen_q, seqlen_k, Float32(0.0), True, m_upper)

    @cute.jit
    def _mask_scores(self, s, s_coords, n_block, m_block, seqlen_q, seqlen_k, fill,
                     queries_on_rows: cutlass.Constexpr[bool], m_upper):
        """``fill`` where a key lies past its query's limit (``_probs``'s tiles, as rows and
        columns); a branch around it all, taken only by the last key tile (padding) and,
        causal, tiles that cross the diagonal."""
        # the last key the tile's first query may see (exclusive bound, as a count)
        visible = seqlen_k
        if const_expr(self.causal):
            first_tile = m_block if const_expr(m_upper is None) else cutlass.min(m_block, m_upper)
            visible = cutlass.min(visible, first_tile * self.tile_m + 1 + seqlen_k - seqlen_q)
        if (n_block + 1) * self.tile_n > visible:
            # what depends on the row alone (its key, or its query's limit) computed once a row
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                if const_expr(queries_on_rows):
                    row_limit = self._key_limit(s_coords[r, 0][0], m_block, seqlen_q, seqlen_k)
                else:
                    row_key = n_block * self.tile_n + s_coords[r, 0][0]
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    if const_expr(queries_on_rows):
                        key, limit = n_block * self.tile_n + s_coords[r, j][1], row_limit
                    else:
                        query, tile = s_coords[r, j][1], m_block
                        if const_expr(m_upper is not None):
                            # queries tile_m.. of the upper tile: row m_upper * tile_m + (query - tile_m)
                            tile = cutlass.select_(query < self.tile_m, m_block, m_upper - 1)
                        key, limit = row_key, self._key_limit(query, tile, seqlen_q, seqlen_k)
                    s[r, j] = select_f32(key >= limit, fill, s[r, j])

    def _key_limit(self, query, m_block, seqlen_q, seqlen_k):
        """The keys query ``query`` of tile m_block may see (an exclusive bound)."""
        limit = seqlen_k
        if const_expr(self.causal):
            limit = cutlass.min(limit, m_block * self.tile_m + query + 1 + seqlen_k - seqlen_q)
        return limit

    @cute.jit
    def _grads(self, acc_p, acc_dp, dsum, queries_on_rows: cutlass.Constexpr[bool] = False, s_coords=None,
               by_query: cutlass.Constexpr[bool] = False):
        """dP^T -> dS^T (or, ``queries_on_rows``, dP -> dS) in place: P (dP - D); ``dsum``
        holds this thread's queries' D values, as ``_probs`` takes LSE2 (``by_query``: the
        stage's shared values, at s_coords' queries)."""
        p, dp = acc_as_rows_cols(acc_p), acc_as_rows_cols(acc_dp)
        if const_expr(by_query):
            for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                value = dsum[s_coords[0, j][1]]
                for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                    dp[r, j] = p[r, j] * (dp[r, j] - value)
        else:
            for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                    dp[r, j] = p[r, j] * (dp[r, j] - dsum[r if queries_on_rows else j])
