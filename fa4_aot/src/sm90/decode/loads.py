"""The decode kernel's loads (kernel.py's DecodeSm90 takes them as a mixin): K and V
tiles by TMA in pieces from their pages (the producer warp), Q's packed rows by the
consumer threads (by hand, or by cp.async a walk item ahead), and an FP8 cache's tiles
widened for the consumer's wgmmas (docs/design.md, "Decode")."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ..primitives import WARPGROUP
from ..widen import widen_tile
from .rows import Q_BARRIER, key_tile, pair_offset, token_head


class DecodeLoads:
    """Loads of ``DecodeSm90`` (its ``cfg``, ``dtype``, ``mma_type``)."""

    @cute.jit
    def load(self, k, v, pipes, p, head_kv, b, n_begin, n_end, turn, keys):
        """K and V of the CTA's key tiles in ``rows.key_tile`` order, K one tile ahead of V;
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
            place_next = self._piece_place(key_tile(0, n_end, steps, turn), pages, b, keys)
            pipe_k.producer_acquire(state)
            self._load_tile(tma_k, gK, sK, pipe_k, state, place_next, pages, head_kv)
            for i in cutlass.range(steps - 1, unroll=1):
                place = place_next
                place_next = self._piece_place(key_tile(i + 1, n_end, steps, turn), pages, b, keys)
                v_state = state.clone()
                state.advance()
                pipe_k.producer_acquire(state)
                self._load_tile(tma_k, gK, sK, pipe_k, state, place_next, pages, head_kv)
                pipe_v.producer_acquire(v_state)
                self._load_tile(tma_v, gV, sV, pipe_v, v_state, place, pages, head_kv)
            pipe_v.producer_acquire(state)
            self._load_tile(tma_v, gV, sV, pipe_v, state, place_next, pages, head_kv)

    @cute.jit
    def load_in_turn(self, kv, pipes, p, head_kv, b, tiles, state):
        """cfg.persistent: one item's K and V tiles (``tiles``: n_begin, n_end, the turn and
        the keys its rows see) in ``rows.key_tile`` order, each tile's K then its V, from
        pipeline ``state`` on; returns the state after them."""
        (tma_k, gK, sK), (tma_v, gV, sV) = kv
        n_begin, n_end, turn, keys = tiles
        table = cute.make_tensor(p.page_table, cute.make_layout(p.batch * p.max_pages))
        pages = (table, b * p.max_pages, p.max_pages, gK.shape[0], gK.shape[3], p.paged, p.piece_rows)
        pipe_k, pipe_v = pipes
        steps = n_end - n_begin
        for i in cutlass.range(steps, unroll=1):
            place = self._piece_place(key_tile(i, n_end, steps, turn), pages, b, keys)
            pipe_k.producer_acquire(state)
            self._load_tile(tma_k, gK, sK, pipe_k, state, place, pages, head_kv)
            pipe_v.producer_acquire(state)
            self._load_tile(tma_v, gV, sV, pipe_v, state, place, pages, head_kv)
            state.advance()
        return state

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
        own KV head's offset in the pair (``rows.pair_offset``), zeros elsewhere."""
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
                    token, head = token_head(p, group, seqlen_q, head_kv)
                    at = (Int64(b) * q_sb + Int64(token) * q_ss + Int64(head) * q_sh + part * vec) * (self.dtype.width // 8)
                    src = cute.make_ptr(self.dtype, q_ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
                    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(vec)), values)
            else:
                col = part * vec - pair_offset(p, group, pair, columns)  # q's column of this chunk
                if (p < rows) & (col >= 0) & (col < columns):
                    token, head = token_head(p, group, seqlen_q, head_kv)
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
                token, head = token_head(p, group, seqlen_q, head_kv)
                at = (Int64(b) * q_sb + Int64(token) * q_ss + Int64(head) * q_sh + part * vec) * (self.dtype.width // 8)
                src = cute.make_ptr(self.dtype, q_ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
                cute.copy(atom, cute.make_tensor(src, cute.make_layout(vec)), dst)
            else:
                zeros = cute.make_rmem_tensor((vec,), self.dtype)
                zeros.fill(0.0)
                cute.autovec_copy(zeros, dst)
        cute.arch.cp_async_commit_group()

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
