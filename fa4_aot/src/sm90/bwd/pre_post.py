"""The backward's pre- and postprocess for Hopper (sm_90a), launched before and after the main one
(``kernel.FlashBwdSm90``), one block per query tile (the main kernel's tile_m rows) of
a (head, batch) (docs/design.md, "Backward: pre- and postprocess"):

- ``preprocess``: D = rowsum(dO * O) in fp32, LSE moved to the exp2 domain (+inf for a row
  that saw no key, so its P is 0), the dQ semaphores cleared and, unless ``first_write``
  (run time: the main kernel then stores each tile's first share), the fp32 dQ
  accumulator (every copy: config.BwdConfig.chains); the padding rows of the last tile
  get LSE2 = +inf and D = 0.
- ``postprocess``: dQ = (sum of the accumulator copies, in copy order) * scale in the
  input dtype; with ``first_write``, only the copies the main kernel wrote (``_written``).

The accumulator holds copy c of batch b as (b * chains + c). Its layout is the main
kernel's: (s_q, h_q, d) rows, which its dQ writer adds tiles into with a 2D TMA
reduce, or, with ``DqFragments``, whole query tiles (s_q padded), each the
consumer warpgroups' staged dQ fragments in their register order (``frag_offset``),
added with one 1D bulk reduce per fragment tile; the postprocess then puts each value
at its (row, column) through shared memory.

Rows are read and written 16 bytes per access, THREADS_PER_ROW threads per row.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ...common import symbols
from ...common.bwd_order import first_dq_key_tile, semaphore_word, window_key_tiles
from ...common.seqlen import packed_tile, sequence
from ...interfaces import BWD_POSTPROCESS, BWD_PREPROCESS, BWD_SINK
from ..mask import Window
from ..primitives import DTYPES, WARPGROUP
from .config import TAIL_COUNTERS, TAIL_MAX_TILES
from .scheduler import varlen_grid_x

# THREADS_PER_ROW threads share a query row, each taking every THREADS_PER_ROW-th 16-byte
# chunk, so a warp's access covers 64 contiguous bytes of each of 8 rows; a block covers
# one query tile (its padding included): THREADS_PER_ROW * tile_m threads.
THREADS_PER_ROW = 4
LOG2E = 1.4426950408889634


class DqFragments:
    """The dQ tiles of the main kernel staged in fragment order: ``parts`` warpgroups'
    fragments of one wgmma accumulator of ``acc_shape`` each (``make_mma()`` builds its
    tiled MMA; thread t's value v lies at (v // 4) * 512 + 4 t + v % 4 of its part, so a
    warp's 16-byte stores are contiguous), part p covering head dims [p c, (p + 1) c) of
    the query tile: acc_shape (queries, c), or, ``transposed`` (dQ^T), (c, queries)."""

    def __init__(self, make_mma, acc_shape: tuple[int, int], transposed: bool, parts: int):
        self.make_mma = make_mma
        self.acc_shape = acc_shape
        self.transposed = transposed
        self.parts = parts
        self.part_elems = acc_shape[0] * acc_shape[1]
        self.values = self.part_elems // WARPGROUP  # per thread

    def place(self, part: int, r, c):
        """(query row in the tile, head dim) of accumulator element (r, c) of ``part``."""
        if self.transposed:
            return c, part * self.acc_shape[0] + r
        return r, part * self.acc_shape[1] + c


def frag_offset(batch, copy, head, m_block, heads_q, m_blocks, chains: int, tile_elems: int):
    """Element offset of query tile m_block of (batch, copy, head) in a fragment-order
    accumulator (``tile_elems`` = tile_m * d per tile)."""
    return ((Int64(batch * chains + copy) * heads_q + head) * m_blocks + m_block) * tile_elems


class PrePostSm90:
    """The pre- and postprocess of one backward variant (its config): the main kernel's query tile
    is their block (the unit of the statistics' padding and of the semaphores), the dQ
    accumulator has ``chains`` copies (batch * chains + copy; as many semaphores per query
    tile), laid out as rows (s_q, h_q, d), or ``fragments``' whole tiles."""

    def __str__(self):
        return symbols.PRE_POST_SM90  # the cubin's kernel names (common/symbols.py)

    def __init__(self, cfg, fragments: DqFragments | None):
        assert not (cfg.tickets and cfg.chains > 1)
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.threads = THREADS_PER_ROW * cfg.tile_m  # per block
        self.fragments = fragments
        # fragment order: the postprocess's first parts * WARPGROUP threads read the fragments
        assert fragments is None or fragments.parts * WARPGROUP <= self.threads
        # fragment order: the postprocess's (tile_m, d) output tile in shared memory, rows
        # padded by 16 bytes (fewer bank conflicts as the fragments scatter into it)
        self.out_stride = cfg.head_dim + 8
        self.post_smem_bytes = 0 if fragments is None else cfg.tile_m * self.out_stride * self.dtype.width // 8

    def _chunk(self, base: cute.Pointer, offset: Int64, dtype, elems: int):
        """``elems`` elements at ``base + offset`` (elements), 16-byte aligned by contract."""
        address = base.toint() + offset * (dtype.width // 8)
        ptr = cute.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout(elems))

    # ------------------------------------------------------------------ where a block is
    def _io_row(self, where, row, sb, ss, sh):
        """Element offset of query row ``row`` of the block's head in O, dO or dQ (strides
        in elements): of its batch entry, or varlen of its sequence (no batch stride)."""
        if const_expr(self.cfg.varlen):
            return Int64(where.offset + row) * ss + Int64(where.head) * sh
        return Int64(where.batch) * sb + Int64(row) * ss + Int64(where.head) * sh

    def _lse_at(self, where, row):
        """Index of row ``row``'s LSE: (b, h_q, s_q), or varlen (h_q, total_q)."""
        if const_expr(self.cfg.varlen):
            return where.head * where.total + where.offset + row
        return (where.batch * where.heads_q + where.head) * where.seqlen_q + row

    def _ws(self, where, m_blocks, m_block):
        """(batch, query tiles per head, tile) of query tile m_block in the workspace, as
        the main kernel's TileWalk.ws_tile: as given, or varlen the sequence's tile."""
        if const_expr(self.cfg.varlen):
            return 0, where.ws_tiles, where.ws_first + m_block
        return where.batch, m_blocks, m_block

    def _acc_row(self, where, copy, row):
        """Element offset of a row of accumulator copy ``copy`` (the rows layout)."""
        batch, seqlen_q = where.batch, where.seqlen_q
        if const_expr(self.cfg.varlen):
            batch, row, seqlen_q = 0, where.ws_first * self.cfg.tile_m + row, where.ws_tiles * self.cfg.tile_m
        return (((Int64(batch) * self.cfg.chains + copy) * seqlen_q + row) * where.heads_q + where.head) \
            * self.cfg.head_dim

    # ------------------------------------------------------------------ preprocess
    @cute.kernel
    def preprocess(self, p: BWD_PREPROCESS.tuple_type):
        """D = rowsum(dO * O), LSE2, zeroed dQ accumulator rows and semaphores, for one
        query tile; THREADS_PER_ROW threads per row, 16-byte accesses. The first tile of
        the first head also clears the split tiles' counters (split_last_wave.py).

        Launched as usual (after all earlier work on the stream), so the main kernel may be
        placed as soon as every block here has started: see FlashBwdSm90.kernel."""
        (o_ptr, (o_sb, o_ss, o_sh)), (do_ptr, (do_sb, do_ss, do_sh)) = p.out, p.dout
        lse_ptr, lse2_ptr, dsum_ptr, dqacc_ptr = p.lse, p.lse2, p.dsum, p.dq_accum
        sem_ptr, done_ptr, tail_ptr = p.dq_semaphore, p.dq_done, p.tail_counters
        seqlen_q, heads_q, first_write = p.seqlen_q, p.heads_q, p.first_write
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        # Blocks in launch order take the heads of a query tile first, then the next tile:
        # the blocks running together then read whole (s, h, d) rows of O and dO, where a
        # head's tiles first read 2d bytes in every heads_q * 2d (a DRAM page touched once
        # per head). The grid is still (query tiles, heads, batch).
        x, y, batch = cute.arch.block_idx()
        linear = x + cute.arch.grid_dim()[0] * y
        bidx, head = linear // heads_q, linear % heads_q
        where = RowBlock(batch, head, bidx, seqlen_q, heads_q)
        term = self._preprocess_block(tidx, where, (o_ptr, o_sb, o_ss, o_sh), (do_ptr, do_sb, do_ss, do_sh),
                                      (lse_ptr, lse2_ptr, dsum_ptr, dqacc_ptr, sem_ptr, done_ptr), first_write,
                                      p.columns_v, (tail_ptr, linear), self._sink(p))
        if const_expr(self.cfg.local):
            self._store_sink_partial(p, term, tidx, head, batch * cute.ceil_div(seqlen_q, self.cfg.tile_m) + bidx)

    @cute.kernel
    def preprocess_varlen(self, p: BWD_PREPROCESS.tuple_type):
        """``preprocess`` of packed sequences: block (x, head) takes the x-th query tile
        of all sequences in order (common/seqlen.packed_tile); blocks past the last one
        do nothing more. O, dO (total_q, h_q, d), LSE (h_q, total_q); the workspace's rows
        padded per sequence (config.varlen_workspace_rule).

        Whatever the metadata, block (x, head) clears the semaphore words of workspace tile
        x of the head (the grid's x is the workspace's ws_tiles), so every word is 0 when
        the main kernel's turns and tickets start: lying metadata can leave sequences past
        this grid, whose tiles no block takes, and a word left as the caller's workspace
        held it could stall a turn or a ticket's wait forever. Block (0, 0) clears the
        count of main-kernel CTAs ended (``ended_ptr``, int64)."""
        (o_ptr, (o_ss, o_sh)), (do_ptr, (do_ss, do_sh)) = p.out_rows, p.dout_rows
        lse_ptr, lse2_ptr, dsum_ptr, dqacc_ptr = p.lse, p.lse2, p.dsum, p.dq_accum
        sem_ptr, done_ptr, ended_ptr = p.dq_semaphore, p.dq_done, p.ctas_done
        total_q, heads_q, first_write = p.total_q, p.heads_q, p.first_write
        cu_q_ptr, used_q_ptr, use_used_q, batches = p.cu_seqlens_q, p.seqused_q, p.use_seqused_q, p.batch
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        x, head, _ = cute.arch.block_idx()
        ws_tiles = cute.ceil_div(total_q, self.cfg.tile_m) + batches
        if tidx < self.cfg.chains:
            sem = cute.make_tensor(sem_ptr, cute.make_layout(ws_tiles * heads_q * self.cfg.chains))
            sem[semaphore_word(0, heads_q, head, ws_tiles, x, self.cfg.chains, tidx)] = Int32(0)
        if x + head + tidx == 0:
            cute.arch.store(ended_ptr.llvm_ptr, Int64(0))
        where = self._varlen_block(cu_q_ptr, used_q_ptr, use_used_q, batches, total_q, heads_q)
        stats = (lse_ptr, lse2_ptr, dsum_ptr, dqacc_ptr, sem_ptr, done_ptr)
        if const_expr(self.cfg.local):
            term = Float32(0.0)
            if where.batch >= 0:
                term = self._preprocess_block(tidx, where, (o_ptr, 0, o_ss, o_sh), (do_ptr, 0, do_ss, do_sh), stats,
                                              first_write, p.columns_v, None, self._sink(p))
            self._store_sink_partial(p, term, tidx, head, x)  # every block, whether it has rows or not
        else:
            if where.batch >= 0:
                self._preprocess_block(tidx, where, (o_ptr, 0, o_ss, o_sh), (do_ptr, 0, do_ss, do_sh), stats,
                                       first_write, p.columns_v, None)

    def _varlen_block(self, cu_q_ptr, used_q_ptr, use_used_q, batches, total_q, heads_q) -> "RowBlock":
        """The varlen row block's sequence and tile (batch -1 past the last tile)."""
        x, head, _ = cute.arch.block_idx()
        cu_q = cute.make_tensor(cu_q_ptr, cute.make_layout(batches + 1))
        used_q = cute.make_tensor(used_q_ptr, cute.make_layout(batches))
        found, tile = packed_tile(x, cu_q, used_q, use_used_q, batches, total_q, self.cfg.tile_m)
        seq = sequence(cutlass.max(found, 0), cu_q, used_q, use_used_q, total_q)
        return RowBlock(found, head, tile, seq.length, heads_q, seq.offset, total_q,
                        seq.offset // self.cfg.tile_m + cutlass.max(found, 0),
                        cute.ceil_div(total_q, self.cfg.tile_m) + batches)

    @cute.jit
    def _preprocess_block(self, tidx, where, o_rows, do_rows, ptrs, first_write, columns, tail, sink=None):
        """The preprocess of one query tile of one head (``where``: a RowBlock), reading the
        first ``columns`` of each O and dO row (v's head dim); ``tail``:
        (the split tiles' counters, the block's linear index), cleared by the first block,
        or None (varlen). ``sink``: local, (the sinks, use_sink); returns this thread's
        term of the sink's gradient, -exp2(sink log2(e) - LSE2) D of its row where
        use_sink (the row's first thread; 0 elsewhere)."""
        o_ptr, o_sb, o_ss, o_sh = o_rows
        do_ptr, do_sb, do_ss, do_sh = do_rows
        lse_ptr, lse2_ptr, dsum_ptr, dqacc_ptr, sem_ptr, done_ptr = ptrs
        batch, head, bidx, seqlen_q, heads_q = where.batch, where.head, where.tile, where.seqlen_q, where.heads_q
        row = bidx * self.cfg.tile_m + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        d, d_v = self.cfg.head_dim, self.cfg.head_dim_v  # dQ's columns; O's and dO's
        vec = 8  # elements of O, dO per 16-byte chunk
        total = Float32(0.0)
        term = Float32(0.0)
        clear = first_write == 0  # the accumulator (else the main kernel stores first shares)
        if row < seqlen_q:
            o_row = self._io_row(where, row, o_sb, o_ss, o_sh)
            do_row = self._io_row(where, row, do_sb, do_ss, do_sh)
            for i in cutlass.range_constexpr(d_v // vec // THREADS_PER_ROW):
                col = (part + i * THREADS_PER_ROW) * vec
                if col < columns:
                    o = cute.make_rmem_tensor((vec,), self.dtype)
                    do = cute.make_rmem_tensor((vec,), self.dtype)
                    cute.autovec_copy(self._chunk(o_ptr, o_row + col, self.dtype, vec), o)
                    cute.autovec_copy(self._chunk(do_ptr, do_row + col, self.dtype, vec), do)
                    total += (o.load().to(Float32) * do.load().to(Float32)).reduce(cute.ReductionOp.ADD,
                                                                                     Float32(0.0), 0)
            if const_expr(self.fragments is None):
                if clear:
                    zeros = cute.make_rmem_tensor((4,), Float32)
                    zeros.fill(0.0)
                    for copy in cutlass.range_constexpr(self.cfg.chains):
                        acc_row = self._acc_row(where, copy, row)
                        for i in cutlass.range_constexpr(d // 4 // THREADS_PER_ROW):
                            col = (part + i * THREADS_PER_ROW) * 4
                            cute.autovec_copy(zeros, self._chunk(dqacc_ptr, acc_row + col, Float32, 4))
        if const_expr(self.fragments is not None):
            if clear:
                # the whole tile, padding rows included (the reduces add into all of it)
                zeros = cute.make_rmem_tensor((4,), Float32)
                zeros.fill(0.0)
                tile_elems = self.cfg.tile_m * d
                for copy in cutlass.range_constexpr(self.cfg.chains):
                    ws_batch, ws_tiles, ws_tile = self._ws(where, cute.ceil_div(seqlen_q, self.cfg.tile_m), bidx)
                    base = frag_offset(ws_batch, copy, head, ws_tile, heads_q, ws_tiles, self.cfg.chains, tile_elems)
                    assert tile_elems % (4 * self.threads) == 0
                    for i in cutlass.range_constexpr(tile_elems // 4 // self.threads):
                        chunk_at = base + (i * self.threads + tidx) * 4
                        cute.autovec_copy(zeros, self._chunk(dqacc_ptr, chunk_at, Float32, 4))
        if const_expr(tail is not None):
            tail_ptr, linear = tail
            if batch == 0 and linear == 0:
                words = TAIL_MAX_TILES * TAIL_COUNTERS
                counters = cute.make_tensor(tail_ptr, cute.make_layout(words))
                for k in cutlass.range_constexpr(-(-words // self.threads)):
                    if tidx + k * self.threads < words:
                        counters[tidx + k * self.threads] = Int32(0)
        for offset in (1, 2):  # the row's THREADS_PER_ROW lanes are adjacent
            total += cute.arch.shuffle_sync_bfly(total, offset=offset)
        if part == 0:
            if row < seqlen_q:
                at = self._lse_at(where, row)
                lse = cute.make_tensor(lse_ptr, cute.make_layout(at + 1))
                value = lse[at]
                lse2_value = value * LOG2E
                if value == -Float32.inf:
                    lse2_value = Float32.inf
                self._store_stats(lse2_ptr, dsum_ptr, lse2_value, total, where, row)
                if const_expr(sink is not None):
                    sink_ptr, use_sink = sink
                    if use_sink != 0:
                        logit = cute.make_tensor(sink_ptr, cute.make_layout(heads_q))[head]
                        term = -cute.math.exp2(logit * LOG2E - lse2_value, fastmath=False) * total
                if row == 0:
                    done = cute.make_tensor(done_ptr, cute.make_layout(batch * heads_q + head + 1))
                    done[batch * heads_q + head] = Int32(0)
                if const_expr(not self.cfg.varlen):  # varlen: every word, by block (preprocess_varlen)
                    if row % self.cfg.tile_m == 0:
                        m_blocks = cute.ceil_div(seqlen_q, self.cfg.tile_m)
                        ws_batch, ws_tiles, ws_tile = self._ws(where, m_blocks, row // self.cfg.tile_m)
                        sem_at = semaphore_word(ws_batch, heads_q, head, ws_tiles, ws_tile, self.cfg.chains)
                        sem = cute.make_tensor(sem_ptr, cute.make_layout(sem_at + self.cfg.chains))
                        for copy in cutlass.range_constexpr(self.cfg.chains):
                            sem[sem_at + copy] = Int32(0)
            else:
                # the padding of the last query tile: P = exp2(s - inf) = 0 and D = 0
                self._store_stats(lse2_ptr, dsum_ptr, Float32.inf, Float32(0.0), where, row)
        return term

    def _sink(self, p):
        """Local: (the sinks, use_sink) of the preprocess's params, else None."""
        return (p.sink, p.use_sink) if const_expr(self.cfg.local) else None

    @cute.jit
    def _store_sink_partial(self, p, term, tidx, head, slot):
        """Local, where use_sink: the sum of each warp's rows' ``term`` at
        sink_partial[head, slot, warp], (heads_q, slots, tile_m // 8) in the workspace;
        ``sink_grad`` sums a head's in a fixed order."""
        if p.use_sink != 0:
            for offset in (1, 2, 4, 8, 16):
                term += cute.arch.shuffle_sync_bfly(term, offset=offset)
            warps = self.threads // 32
            at = (head * p.sink_slots + slot) * warps + tidx // 32
            if tidx % 32 == 0:
                cute.make_tensor(p.sink_partial, cute.make_layout(at + 1))[at] = term

    @cute.kernel
    def sink_grad(self, p: BWD_SINK.tuple_type):
        """Local, launched last where use_sink: dsink[h] = the sum of head h's
        sink_partial entries (slots * tile_m // 8 of them), one warp per head, in a fixed
        order (each lane four running sums over its strided entries, then a butterfly):
        the same bits on every run."""
        lane, _, _ = cute.arch.thread_idx()
        head, _, _ = cute.arch.block_idx()
        count = p.sink_slots * (self.threads // 32)
        base = head * count
        part = cute.make_tensor(p.sink_partial, cute.make_layout(base + count))
        sums = cute.make_rmem_tensor((4,), Float32)
        sums.fill(0.0)
        for i in cutlass.range(cute.ceil_div(count, 128), unroll=1):
            for j in cutlass.range_constexpr(4):
                at = i * 128 + j * 32 + lane
                if at < count:
                    sums[j] = sums[j] + part[base + at]
        total = (sums[0] + sums[1]) + (sums[2] + sums[3])
        for offset in (1, 2, 4, 8, 16):
            total += cute.arch.shuffle_sync_bfly(total, offset=offset)
        if lane == 0:
            cute.make_tensor(p.dsink, cute.make_layout(head + 1))[head] = total

    @cute.jit
    def _store_stats(self, lse2_ptr, dsum_ptr, lse2_value, dsum_value, where, row):
        """LSE2 and D rows are (b, h_q, padded s_q): whole query tiles, for the bulk copies
        (varlen: (h_q, ws_tiles tiles), the sequence's from its first workspace tile)."""
        if const_expr(self.cfg.varlen):
            at = (where.head * where.ws_tiles + where.ws_first) * self.cfg.tile_m + row
        else:
            padded = cute.ceil_div(where.seqlen_q, self.cfg.tile_m) * self.cfg.tile_m
            at = (where.batch * where.heads_q + where.head) * padded + row
        lse2 = cute.make_tensor(lse2_ptr, cute.make_layout(at + 1))
        dsum = cute.make_tensor(dsum_ptr, cute.make_layout(at + 1))
        lse2[at] = lse2_value
        dsum[at] = dsum_value

    # ------------------------------------------------------------------ postprocess
    @cute.kernel
    def postprocess(self, p: BWD_POSTPROCESS.tuple_type):
        """dQ = accumulator * scale in the input dtype; THREADS_PER_ROW threads per row.
        Launched programmatically after the main kernel (placed once all its CTAs have
        started): waits for its head's key tiles only, which each count themselves in
        ``done_ptr`` once their adds are complete (dq_writer.DqWriter)."""
        dqacc_ptr, sem_ptr, done_ptr, (dq_ptr, (dq_sb, dq_ss, dq_sh)) = p.dq_accum, p.dq_semaphore, p.dq_done, p.dq
        seqlen_q, seqlen_k, heads_q, scale, first_write = p.seqlen_q, p.seqlen_k, p.heads_q, p.scale, p.first_write
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        where = RowBlock(batch, head, bidx, seqlen_q, heads_q)
        self._postprocess_block(tidx, where, (dq_ptr, dq_sb, dq_ss, dq_sh, p.columns), dqacc_ptr,
                                (sem_ptr, seqlen_k, first_write, self._window(p)), done_ptr, scale)
        if bidx + head + batch == 0:
            # this grid must not end before the main kernel (its dK and dV stores) does: the
            # work after it on the stream waits for this grid only
            cute.arch.griddepcontrol_wait()

    @cute.kernel
    def postprocess_varlen(self, p: BWD_POSTPROCESS.tuple_type):
        """``postprocess`` of packed sequences, blocks as ``preprocess_varlen``'s; a
        sequence's head waits for its own key tiles (dq_done is (b, h_q)), or until every
        CTA of the main grid ((varlen_grid_x, heads_kv)) has ended (``ended_ptr``: lying
        metadata can leave key tiles past that grid, which nothing counts)."""
        dqacc_ptr, sem_ptr, done_ptr, ended_ptr = p.dq_accum, p.dq_semaphore, p.dq_done, p.ctas_done
        (dq_ptr, (dq_ss, dq_sh)), total_q, heads_q, scale, first_write = p.dq_rows, p.total_q, p.heads_q, p.scale, \
            p.first_write
        cu_q_ptr, used_q_ptr, use_used_q = p.cu_seqlens_q, p.seqused_q, p.use_seqused_q
        cu_k_ptr, used_k_ptr, use_used_k = p.cu_seqlens_k, p.seqused_k, p.use_seqused_k
        batches, total_k, heads_kv = p.batch, p.total_k, p.heads_kv
        tidx, _, _ = cute.arch.thread_idx()
        where = self._varlen_block(cu_q_ptr, used_q_ptr, use_used_q, batches, total_q, heads_q)
        if where.batch >= 0:
            seq_k = sequence(where.batch, cute.make_tensor(cu_k_ptr, cute.make_layout(batches + 1)),
                             cute.make_tensor(used_k_ptr, cute.make_layout(batches)), use_used_k, total_k)
            ctas = Int64(varlen_grid_x(total_k, batches, self.cfg.tile_n)) * Int64(heads_kv)
            self._postprocess_block(tidx, where, (dq_ptr, 0, dq_ss, dq_sh, p.columns), dqacc_ptr,
                                    (sem_ptr, seq_k.length, first_write, self._window(p)), done_ptr, scale,
                                    (ended_ptr, ctas))
        x, head, _ = cute.arch.block_idx()
        if x + head == 0:
            cute.arch.griddepcontrol_wait()  # as in postprocess

    def _window(self, p):
        """Local: the run-time (left, right) of the postprocess's params, else None."""
        return (p.window_left, p.window_right) if const_expr(self.cfg.local) else None

    @cute.jit
    def _postprocess_block(self, tidx, where, dq_out, dqacc_ptr, coverage, done_ptr, scale, ended=None):
        """The postprocess of one query tile of one head (``where``: a RowBlock);
        ``coverage``: (semaphores, seqlen_k, first_write, local: the run-time window or
        None), what _written reads; ``ended``:
        varlen, (the count of main-kernel CTAs ended, the grid's CTAs), else None."""
        dq_ptr, dq_sb, dq_ss, dq_sh, columns = dq_out  # dQ: its address, (b, s, h) strides and head dim
        batch, head, bidx, seqlen_q, heads_q = where.batch, where.head, where.tile, where.seqlen_q, where.heads_q
        seqlen_k = coverage[1]
        if tidx == 0:
            done = (done_ptr + batch * heads_q + head).llvm_ptr
            if const_expr(ended is None):
                while cute.arch.load(done, Int32, sem="acquire", scope="gpu") < cute.ceil_div(seqlen_k,
                                                                                               self.cfg.tile_n):
                    pass
            else:
                self._wait_for_keys(done, cute.ceil_div(seqlen_k, self.cfg.tile_n), ended)
        cute.arch.sync_threads()
        row = bidx * self.cfg.tile_m + tidx // THREADS_PER_ROW
        part = tidx % THREADS_PER_ROW
        vec = 8  # 8 outputs (16 bytes) from 8 fp32 (32 bytes) per chunk
        if const_expr(self.fragments is not None):
            self._post_fragments(tidx, where, row, part, dq_out, dqacc_ptr, scale, coverage)
        elif row < seqlen_q:
            d = self.cfg.head_dim
            dq_row = self._io_row(where, row, dq_sb, dq_ss, dq_sh)
            cols = [(part + i * THREADS_PER_ROW) * vec for i in range(d // vec // THREADS_PER_ROW)]
            # every chunk of every copy read first, whether or not the copy was written (in
            # bounds either way), so the loads and the tickets' are in flight together
            loaded = []
            for col in cols:
                for copy in cutlass.range_constexpr(self.cfg.chains):
                    more = cute.make_rmem_tensor((vec,), Float32)
                    cute.autovec_copy(self._chunk(dqacc_ptr, self._acc_row(where, copy, row) + col, Float32, vec),
                                      more)
                    loaded.append(more)
            written = self._written_copies(coverage, where, bidx)
            for i, col in enumerate(cols):
                acc = cute.make_rmem_tensor((vec,), Float32)
                self._sum_copies(acc, loaded[i * self.cfg.chains:(i + 1) * self.cfg.chains], written)
                dq = cute.make_rmem_tensor((vec,), self.dtype)
                dq.store((acc.load() * scale).to(self.dtype))
                if col < columns:
                    cute.autovec_copy(dq, self._chunk(dq_ptr, dq_row + col, self.dtype, vec))

    @cute.jit
    def _wait_for_keys(self, done, need, ended):
        """Varlen: until the head's count (``done``) reaches ``need`` key tiles, or every CTA
        of the main grid has ended (``ended``: the count's address, the grid's CTAs), each
        after its dq_done counts (dq_writer.DqWriter.count_ended). Honest metadata brings
        both together; lying metadata can give sequences more key tiles than the grid
        walks, and only the second ends the wait then (wrong numbers, never a hang). The
        grid's count is loaded relaxed beside the head's acquire load (both in flight at
        once); a wait it ends takes a fence, so the accumulator reads come after every
        CTA's adds either way."""
        ended_ptr, ctas = ended
        over = cute.arch.load(ended_ptr.llvm_ptr, Int64, sem="relaxed", scope="gpu")
        count = cute.arch.load(done, Int32, sem="acquire", scope="gpu")
        while (count < need) & (over < ctas):
            over = cute.arch.load(ended_ptr.llvm_ptr, Int64, sem="relaxed", scope="gpu")
            count = cute.arch.load(done, Int32, sem="acquire", scope="gpu")
        if count < need:
            cute.arch.fence_acq_rel_gpu()

    def _written_copies(self, coverage, where, m_block) -> list:
        """``_written`` for every accumulator copy of query tile m_block, in copy order."""
        return [self._written(coverage, copy, where, m_block) for copy in range(self.cfg.chains)]

    @cute.jit
    def _sum_copies(self, acc, copies: list, written: list):
        """acc = the sum of one chunk's ``copies`` (loaded, whether written or not) that the
        main kernel wrote, in copy order (so the bits are fixed: deterministic)."""
        acc.fill(0.0)
        for copy in cutlass.range_constexpr(self.cfg.chains):
            if written[copy]:
                acc.store(acc.load() + copies[copy].load())

    @cute.jit
    def _written(self, coverage, copy: int, where, m_block):
        """Whether the main kernel wrote query tile m_block of accumulator copy ``copy``:
        always, where the preprocess cleared it (first_write 0); else, not deterministic,
        once some CTA took the tile's ticket (its semaphore word is not 0); deterministic,
        where bwd_order.first_dq_key_tile names a key tile. Unwritten: causal rows that see
        no key, or a copy of more than the key tiles (its dQ there is 0, whatever the
        workspace held)."""
        sem_ptr, seqlen_k, first_write, window = coverage
        seqlen_q = where.seqlen_q
        result = cutlass.Boolean(True)
        if first_write != 0:
            m_blocks = cute.ceil_div(seqlen_q, self.cfg.tile_m)
            if const_expr(self.cfg.tickets):
                ws_batch, ws_tiles, ws_tile = self._ws(where, m_blocks, m_block)
                at = semaphore_word(ws_batch, where.heads_q, where.head, ws_tiles, ws_tile)
                result = cute.make_tensor(sem_ptr, cute.make_layout(at + 1))[at] != 0
            else:
                n_blocks = cute.ceil_div(seqlen_k, self.cfg.tile_n)
                if const_expr(self.cfg.local):
                    low, high = window_key_tiles(m_block, n_blocks, seqlen_q, seqlen_k, self.cfg.tile_m,
                                                 self.cfg.tile_n, Window.of(*window, seqlen_q, seqlen_k))
                    result = low <= high
                else:
                    key = first_dq_key_tile(m_block, copy, n_blocks, seqlen_q, seqlen_k, self.cfg.tile_m,
                                            self.cfg.tile_n, self.cfg.causal)
                    result = key >= 0
                    if key >= n_blocks:
                        result = cutlass.Boolean(False)
        return result

    @cute.jit
    def _post_fragments(self, tidx, where, row, part, dq_out, dqacc_ptr, scale, coverage):
        """Fragment order: thread t of warpgroup p reads what thread t of the main kernel's
        warpgroup p staged (16 bytes at a time, contiguous across the warp), sums the
        copies, scales, and puts each value at its place in a shared (tile_m, d) tile; then
        the rows go out 16 bytes per access as in the row layout."""
        dq_ptr, dq_sb, dq_ss, dq_sh, columns = dq_out  # dQ: its address, (b, s, h) strides and head dim
        frags = self.fragments
        d = self.cfg.head_dim
        s_out = cutlass.utils.SmemAllocator().allocate_tensor(
            self.dtype, cute.make_layout((self.cfg.tile_m, d), stride=(self.out_stride, 1)), byte_alignment=16)
        if tidx < frags.parts * WARPGROUP:  # the block's other threads (80-row tiles) only write rows
            self._scatter_fragments(tidx, where, dqacc_ptr, scale, coverage, s_out)
        cute.arch.sync_threads()
        vec = 8
        if row < where.seqlen_q:
            dq_row = self._io_row(where, row, dq_sb, dq_ss, dq_sh)
            for i in cutlass.range_constexpr(d // vec // THREADS_PER_ROW):
                col = (part + i * THREADS_PER_ROW) * vec
                if col < columns:
                    dq = cute.make_rmem_tensor((vec,), self.dtype)
                    cute.autovec_copy(cute.local_tile(s_out[tidx // THREADS_PER_ROW, None], (vec,), (col // vec,)),
                                      dq)
                    cute.autovec_copy(dq, self._chunk(dq_ptr, dq_row + col, self.dtype, vec))

    @cute.jit
    def _scatter_fragments(self, tidx, where, dqacc_ptr, scale, coverage, s_out):
        """Thread tidx (< parts * WARPGROUP) of the postprocess: its fragment values of every
        accumulator copy summed, scaled and put at their (query, head dim) in ``s_out``."""
        frags = self.fragments
        d = self.cfg.head_dim
        m_block = where.tile
        wg, t = tidx // WARPGROUP, tidx % WARPGROUP
        coords = frags.make_mma().get_slice(t).partition_C(cute.make_identity_tensor(frags.acc_shape))
        ws_batch, m_blocks, ws_tile = self._ws(where, cute.ceil_div(where.seqlen_q, self.cfg.tile_m), m_block)
        tile_elems = self.cfg.tile_m * d
        first = frag_offset(ws_batch, 0, where.head, ws_tile, where.heads_q, m_blocks, self.cfg.chains, tile_elems) \
            + wg * frags.part_elems + t * 4
        # every chunk read first, written or not (as in postprocess: one memory latency)
        loaded = []
        for i in cutlass.range_constexpr(frags.values // 4):
            for copy in cutlass.range_constexpr(self.cfg.chains):
                more = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(self._chunk(dqacc_ptr, first + copy * m_blocks * where.heads_q * tile_elems
                                              + i * 4 * WARPGROUP, Float32, 4), more)
                loaded.append(more)
        written = self._written_copies(coverage, where, m_block)
        for i in cutlass.range_constexpr(frags.values // 4):
            acc = cute.make_rmem_tensor((4,), Float32)
            self._sum_copies(acc, loaded[i * self.cfg.chains:(i + 1) * self.cfg.chains], written)
            for j in cutlass.range_constexpr(4):
                r, c = coords[4 * i + j]
                q, dim = frags.place(wg, r, c)
                s_out[q, dim] = (acc[j] * scale).to(self.dtype)


class RowBlock(NamedTuple):
    """Which query tile of which head a row-kernel block takes: its batch entry (varlen:
    its sequence, -1 past the last tile), head, tile, the entry's query rows and the query
    heads; varlen also the sequence's first packed row, the packed rows, the sequence's
    first workspace tile and the workspace's tiles per head (config.varlen_workspace_rule)."""

    batch: object
    head: object
    tile: object
    seqlen_q: object
    heads_q: object
    offset: object = None
    total: object = None
    ws_first: object = None
    ws_tiles: object = None
