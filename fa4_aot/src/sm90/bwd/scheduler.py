"""The backward's tile walk (sm_90a): which work items a CTA takes, in which order, and
which query tiles each item visits. Every role of the main kernel (producer, dQ writer,
consumers) asks ``TileWalk`` for its items, so they cannot disagree.

An item is one (key tile, KV head, batch): the key tile's K and V stay in shared memory
while its steps visit the query tiles of every query head of the KV head's group. The
order (docs/design.md, "Backward: launch order and head groups", "Backward: persistent
CTAs", "Backward: split last wave"):
- one CTA per item, launched as (key tile, KV head, batch), the key tiles of a causal
  deterministic head highest first (common/bwd_order.key_tile_of_launch), heads in
  L2-sized groups where ``head_groups`` (common/launch_order);
- ``persistent``: one CTA per SM takes items block, block + grid, ... in that order;
- ``tail_split``: a one-dimensional grid whose last blocks are pieces of the last partial
  wave's items, each a range of query tiles (common/bwd_order.tail_item, piece_tiles).
- ``varlen``: one CTA per (key tile of a sequence, KV head), the sequences' key tiles back
  to back (common/seqlen.packed_tile_of_cta), as the varlen forward walks query tiles, in
  the caller's order or (``lpt``) heaviest first, a sequence's (KV head, key tile) CTAs
  together; a CTA's problem is its sequence's (lengths, where its rows lie in the packed
  tensors and in the workspace: ``rows_of``, ``ws_tile``).
Within an item, not causal and not deterministic (``rotate``), a CTA starts at a query
tile of its own and wraps around, so a head's CTAs reduce into different dQ tiles.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ...common.bwd_order import first_query_tile, key_tile_of_launch, piece_tiles, tail_item, window_query_tiles
from ...common.launch_order import backward_head_group, launch_in_head_groups
from ...common.seqlen import packed_tile_of_cta, sequence
from ..mask import Window
from .config import ROTATION_TILES


def varlen_grid_x(total_k, batches, tile_n: int):
    """The varlen main grid's CTAs per KV head: ceil(total_k / tile_n) + batches, a bound on
    every sequence's key tiles while the clamped sequences do not overlap. Lying metadata
    that makes them overlap can leave the last sequences' tiles past it, unwalked (the
    postprocess then stops waiting once the grid has ended: dq_writer.DqWriter.run)."""
    return cute.ceil_div(total_k, tile_n) + batches


class Problem(NamedTuple):
    """The problem's sizes as the main kernel sees them (run-time values); varlen, the
    CTA's sequence's."""

    seqlen_q: object
    seqlen_k: object
    heads_q: object
    group: object  # query heads per KV head
    m_blocks: object  # query tiles per head
    n_tiles: object  # key tiles per head
    heads_kv: object
    # varlen only: the sequence's first query and key rows in the packed tensors, its first
    # query tile in the workspace, and the workspace's query tiles per head
    # (config.varlen_workspace_rule)
    q_offset: object = None
    k_offset: object = None
    ws_first: object = None
    ws_tiles: object = None
    window: object = None  # local: the mask.Window of these lengths


class Sequences(NamedTuple):
    """The varlen kernels' metadata: cu_seqlens_q, cu_seqlens_k (b + 1,), seqused_q,
    seqused_k (b,) as int32 tensors (seqused read only where its flag is not 0), and b."""

    cu_q: object
    cu_k: object
    used_q: object
    used_k: object
    use_used_q: object
    use_used_k: object
    batches: object


class Item(NamedTuple):
    """One work item: its key tile, KV head and batch, and the query steps it takes:
    ``steps`` over ``span`` query tiles per query head, from ``m_first``."""

    n_block: object
    head_kv: object
    batch: object
    m_first: object
    span: object
    steps: object


class Tail(NamedTuple):
    """A split-tail CTA's piece: the split tile it computes (-1: a whole item), the
    workspace's counters and partial sums, and the pieces per split tile."""

    split: object
    counters: cute.Pointer
    partial: cute.Pointer
    pieces: object


class CtaWork(NamedTuple):
    """What a CTA walks: ``item`` (and ``tail``, or None) for one item, or, persistent,
    the items ``first``, ``first + stride``, ... below ``items``."""

    item: object
    tail: object
    first: object
    items: object
    stride: object


class TileWalk:
    def __init__(self, cfg):
        self.cfg = cfg

    def problem(self, gQ, gK, window=None) -> Problem:
        """The sizes from the TMA coordinate tensors (s, d, h, b) of Q and K; local, the
        run-time (left, right)."""
        seqlen_q, seqlen_k = gQ.shape[0], gK.shape[0]
        heads_q = gQ.shape[2]
        group = heads_q // gK.shape[2]
        m_blocks = cute.ceil_div(seqlen_q, self.cfg.tile_m)
        prob = Problem(seqlen_q, seqlen_k, heads_q, group, m_blocks, None, None)
        if const_expr(self.cfg.local):
            prob = prob._replace(window=Window.of(*window, seqlen_q, seqlen_k))
        return prob

    def cta_work(self, prob: Problem, gK, tail_tiles, tail_pieces, tail_ptr, partial_ptr):
        """(the problem with its key tiles, this CTA's ``CtaWork``)."""
        cfg = self.cfg
        if const_expr(cfg.persistent):
            n_tiles, heads_kv = cute.ceil_div(prob.seqlen_k, cfg.tile_n), gK.shape[2]
            prob = prob._replace(n_tiles=n_tiles, heads_kv=heads_kv)
            items, first, stride = n_tiles * heads_kv * gK.shape[3], cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            return prob, CtaWork(None, None, first, items, stride)
        launch, head_kv, batch = cute.arch.block_idx()
        n_tiles, heads_kv = cute.ceil_div(prob.seqlen_k, cfg.tile_n), gK.shape[2]
        prob = prob._replace(n_tiles=n_tiles, heads_kv=heads_kv)
        tail = None
        if const_expr(cfg.tail_split):
            # one-dimensional grid: whole items in launch order, then the last tail_tiles in pieces
            whole, split, piece = tail_item(launch, n_tiles * heads_kv * gK.shape[3], tail_tiles, tail_pieces)
            tail = Tail(split, tail_ptr, partial_ptr, tail_pieces)
            item = self.item(whole, prob, (split, piece, tail_pieces))
        else:
            item = self.item_of_block(launch, head_kv, batch, prob)
        return prob, CtaWork(item, tail, None, None, None)

    def cta_work_varlen(self, gQ, gK, seqs: Sequences, order: cute.Tensor, lpt, window=None):
        """Varlen: (the CTA's sequence's problem, its CtaWork). lpt 0: block (x, KV head)
        takes the x-th key tile of all sequences in order; else the blocks in launch order
        take the sequences in ``order`` ((b,) int32, heaviest first), each sequence's KV
        heads one after another and a head's key tiles together (common/seqlen.
        packed_tile_of_cta). The t-th key tile of a (sequence, KV head) is key tile n_block
        = key_tile_of_launch(t) of the sequence, as the dense grid's block t would be: in
        either order a (sequence, KV head)'s CTAs are launched in the order of t, so a
        deterministic CTA waits only for CTAs launched before it (its turns count only
        CTAs of its sequence and KV head: the query heads of a semaphore word are the KV
        head's). A CTA past the last tile gets a sequence of no rows, batch -1 and no steps.
        Local: ``window``, the run-time (left, right), becomes the sequence's Window."""
        cfg = self.cfg
        launch, head_y, _ = cute.arch.block_idx()
        total_q, total_k, heads_q, heads_kv = gQ.shape[0], gK.shape[0], gQ.shape[2], gK.shape[2]
        found, tile, head_kv = packed_tile_of_cta(launch, head_y, cute.arch.grid_dim()[0], seqs.cu_k, seqs.used_k,
                                                  seqs.use_used_k, seqs.batches, total_k, cfg.tile_n, order, lpt,
                                                  heads_kv)
        live = found >= 0
        batch = cutlass.max(found, 0)
        seq_q = sequence(batch, seqs.cu_q, seqs.used_q, seqs.use_used_q, total_q)
        seq_k = sequence(batch, seqs.cu_k, seqs.used_k, seqs.use_used_k, total_k)
        seqlen_q = Int32(cutlass.select_(live, seq_q.length, 0))
        seqlen_k = Int32(cutlass.select_(live, seq_k.length, 0))
        prob = Problem(seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, cute.ceil_div(seqlen_q, cfg.tile_m),
                       cute.ceil_div(seqlen_k, cfg.tile_n), heads_kv, seq_q.offset, seq_k.offset,
                       seq_q.offset // cfg.tile_m + batch, cute.ceil_div(total_q, cfg.tile_m) + seqs.batches)
        if const_expr(cfg.local):
            prob = prob._replace(window=Window.of(*window, seqlen_q, seqlen_k))
        item = self.item_of_block(tile, head_kv, Int32(cutlass.select_(live, batch, -1)), prob)
        # no key tile (n_block -1 when deterministic causal): key tile 0 of no keys, nothing stored
        item = item._replace(n_block=cutlass.max(item.n_block, 0))
        return prob, CtaWork(item, None, None, None, None)

    def rows_of(self, g, prob: Problem, head, batch, keys: bool):
        """The (s, d) TMA coordinates of one head's rows of ``g`` (s, d, h, b): the batch
        entry's, or varlen the CTA's sequence's (its keys' if ``keys``, else its queries'),
        whose rows past the sequence are the next sequence's (or TMA's zeros)."""
        if const_expr(self.cfg.varlen):
            return cute.domain_offset((prob.k_offset if keys else prob.q_offset, 0), g[None, None, head, 0])
        return g[None, None, head, batch]

    def ws_tile(self, prob: Problem, batch, m_blocks, m_block):
        """(batch, query tiles per head, tile) of query tile m_block of ``batch`` in the
        workspace's statistics, accumulator and semaphores: as given, or varlen (one batch
        entry of ws_tiles tiles) the sequence's tile there."""
        if const_expr(self.cfg.varlen):
            return 0, prob.ws_tiles, prob.ws_first + m_block
        return batch, m_blocks, m_block

    @cute.jit
    def item(self, index, prob: Problem, piece=None) -> Item:
        """The index-th item in launch order (persistent, or the split tail's)."""
        n_tiles, heads_kv = prob.n_tiles, prob.heads_kv
        return self.item_of_block(index % n_tiles, (index // n_tiles) % heads_kv, index // (n_tiles * heads_kv),
                                  prob, piece)

    @cute.jit
    def item_of_block(self, launch, head_kv, batch, prob: Problem, piece=None) -> Item:
        """The item of the CTA launched at (launch, head_kv, batch) of a (n_tiles, heads_kv,
        batch) grid; ``piece``: (split tile or -1, piece, pieces) of the split tail, whose
        pieces take their own query tiles (the run time splits only where a CTA walks one
        query head's tiles, group 1)."""
        cfg = self.cfg
        seqlen_q, seqlen_k, m_blocks = prob.seqlen_q, prob.seqlen_k, prob.m_blocks
        if const_expr(cfg.head_groups):
            launch, head_kv = launch_in_head_groups(
                launch, head_kv, prob.n_tiles, prob.heads_kv,
                backward_head_group(seqlen_q, cfg.head_dim, prob.group, cfg.chains))
        n_block = key_tile_of_launch(launch, prob.n_tiles, cfg.masked, cfg.deterministic)
        if const_expr(cfg.local):
            m_first, m_end = window_query_tiles(n_block, m_blocks, seqlen_q, seqlen_k, cfg.tile_m, cfg.tile_n,
                                                prob.window)
            m_first = Int32(m_first)
            span = cutlass.max(m_end - m_first, 0)
        else:
            m_first = Int32(first_query_tile(n_block, seqlen_q, seqlen_k, cfg.tile_m, cfg.tile_n, cfg.causal))
            span = cutlass.max(m_blocks - m_first, 0)
        if const_expr(cfg.rotate):
            # every CTA of a head visits every query tile: each starts at its own tile
            # (spread over the head in steps of ROTATION_TILES) and wraps around
            runs = cute.ceil_div(m_blocks, ROTATION_TILES)
            m_first = (n_block * runs // cute.ceil_div(seqlen_k, cfg.tile_n)) * ROTATION_TILES
        steps = prob.group * span
        if const_expr(piece is not None):
            split, j, pieces = piece
            piece_first, piece_count = piece_tiles(j, pieces, m_blocks, cfg.step_rows // cfg.tile_m)
            m_first = cutlass.select_(split >= 0, piece_first, m_first)
            steps = cutlass.select_(split >= 0, piece_count, steps)
        return Item(n_block, head_kv, batch, m_first, span, steps)

    @cute.jit
    def m_block(self, step, m_first, span, m_blocks):
        """The query tile of ``step``: m_first, m_first + 1, ... over the span, wrapping
        past the last tile when ``rotate`` (m_first is then the CTA's rotation start)."""
        return self.m_block_at(step % span, m_first, m_blocks)

    @cute.jit
    def m_block_at(self, offset, m_first, m_blocks):
        """The query tile ``offset`` tiles into the CTA's span (as ``m_block``)."""
        m_block = m_first + offset
        if const_expr(self.cfg.rotate):
            if m_block >= m_blocks:
                m_block = m_block - m_blocks
        return m_block

    @cute.jit
    def turn(self, done, step):
        """The CTA's count of ``step`` over all its items (persistent: ``done`` steps came
        before this item; else the item's own step), by which the double-buffered dS and
        the dQ staging buffers are taken in turn."""
        if const_expr(self.cfg.persistent):
            return done + step
        return step

    @cute.jit
    def pair(self, step, head_off, tile_off, m_first, span, m_blocks, steps, head_kv, group):
        """Two query tiles per step: (query head, query tile) of each half of ``step`` and
        whether the second half is a real tile (1, else 0); a missing second half reads as
        the first's head and the tile past the end (m_blocks). ``head_off``, ``tile_off``:
        where the step's first tile (2 step) lies in the CTA's sequence, as (2 step) // span
        and % span, carried from step to step by ``next_pair`` (no division in the loop)."""
        real = Int32(cutlass.select_(2 * step + 1 < steps, 1, 0))
        wraps = tile_off + 1 >= span  # the second tile starts the next head's span
        head_b = head_off + Int32(cutlass.select_(wraps & (real == 1), 1, 0))
        off_b = tile_off + 1 - Int32(cutlass.select_(wraps, span, 0))
        m_a = self.m_block_at(tile_off, m_first, m_blocks)
        m_b = Int32(cutlass.select_(real == 1, self.m_block_at(off_b, m_first, m_blocks), m_blocks))
        return head_kv * group + head_off, m_a, head_kv * group + head_b, m_b, real

    @cute.jit
    def next_pair(self, head_off, tile_off, span):
        """``pair``'s position two tiles on (span >= 1: at most two wraps)."""
        tile_off = tile_off + 2
        for _ in cutlass.range_constexpr(2):
            wraps = tile_off >= span
            head_off = head_off + Int32(cutlass.select_(wraps, 1, 0))
            tile_off = tile_off - Int32(cutlass.select_(wraps, span, 0))
        return head_off, tile_off
