"""A decode CTA's work (kernel.py's DecodeSm90 takes it as a mixin): the row tile, split
and key tiles of one (row tile x split, KV head, sequence) item, and the walk of the
persistent (span-narrow) kernels over several items, the pipelines running on from one
into the next (docs/design.md, "Local attention, sinks, softcap": windowed decode)."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from ..mask import Window
from ..primitives import WARPGROUP
from .rows import Q_BARRIER


class DecodeWalk:
    """Work items of ``DecodeSm90`` (its ``cfg``; ``fetch_q``, ``load_in_turn`` and
    ``consume`` from the other roles)."""

    @cute.jit
    def _work(self, p, page_rows, bidx, b, shape):
        """One CTA's work, (row tile x split ``bidx``, sequence ``b``): its row tile and split,
        the sequence's keys, the window, the key tiles [n_begin, n_end), the keys its rows
        see and where in its range it starts. ``shape``: (group, packed rows, row tiles)."""
        cfg = self.cfg
        group, rows, m_tiles = shape
        seqlen_q, splits = p.seqlen_q, p.splits
        m_block, split = self._tile_split(bidx, m_tiles)
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
        m_tiles = shape[2]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        (q_ptr, q_strides), columns = p.q, p.columns
        parity = Int32(0)
        b, head_kv, bidx = self._item(first, per_seq, per_head)
        self.fetch_q(tidx, sQ[None, None, 0], q_ptr, q_strides,
                     self._q_place(p, b, head_kv, self._tile_split(bidx, m_tiles)[0], shape), columns)
        for item in cutlass.range(first, items, ctas, unroll=1):
            b, head_kv, bidx = self._item(item, per_seq, per_head)
            m_block, split, seqlen_k, window, n_begin, n_end, keys, turn = self._work(p, gK.shape[0], bidx, b, shape)
            place = self._q_place(p, b, head_kv, m_block, shape)
            work = (p, place, split, seqlen_k, n_begin, n_end, turn, window)
            # this item's Q arrived (and the zeros beside it), visible to the wgmma
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=Q_BARRIER, number_of_threads=WARPGROUP)
            after = item + ctas
            if after < items:  # the other buffer's last reader, the item before, is done
                # (the next item's row tile is worked out again at its turn: a division
                # only where m_tiles > 1, never for one-token decode)
                b_n, head_n, bidx_n = self._item(after, per_seq, per_head)
                self.fetch_q(tidx, sQ[None, None, 1 - parity], q_ptr, q_strides,
                             self._q_place(p, b_n, head_n, self._tile_split(bidx_n, m_tiles)[0], shape), columns)
            state = self.consume(tidx, sQ[None, None, parity], (sK, sV), pipes, work, state=state)
            parity = 1 - parity

    @staticmethod
    def _item(item, per_seq, per_head):
        """(sequence, KV head, row tile x split) of walk item ``item``."""
        b = item // per_seq
        head_kv = (item - b * per_seq) // per_head
        return b, head_kv, item - b * per_seq - head_kv * per_head

    def _q_place(self, p, b, head_kv, m_block, shape):
        """Where row tile ``m_block`` of (sequence ``b``, KV head ``head_kv``) takes its Q,
        as ``fetch_q`` and ``consume`` take it: (b, KV head, group, seqlen_q, heads_q, the
        tile's first packed row, packed rows)."""
        group, rows, _ = shape
        return (b, head_kv, group, p.seqlen_q, p.heads_q, m_block * self.cfg.tile_m, rows)

    @cute.jit
    def _tile_split(self, bidx, m_tiles):
        """(row tile, split) of ``bidx``; one row tile (seqlen_q x group up to tile_m: every
        one-token decode) takes no division."""
        m_block, split = Int32(0), bidx
        if m_tiles > 1:
            m_block, split = bidx % m_tiles, bidx // m_tiles
        return m_block, split

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
