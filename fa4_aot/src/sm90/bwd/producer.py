"""The backward's producer warp (sm_90a, warp 0): TMA loads of one item's K and V, then,
per step, its dO and Q tiles, each tile and its statistics (D with dO, LSE2 with Q) on one
mbarrier stage.

dO goes first: the consumers release it before Q. At an item's first step the
statistics follow both tiles, after griddepcontrol.wait: K, V and the first Q and dO are
inputs of the call, put in flight while the preprocess (whose output the statistics are)
may still run (docs/design.md, "Backward: programmatic launches"). With two query tiles
per step, each stage holds both tiles, each loaded by its own box into one half.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..primitives import bulk_copy_g2s


class Producer:
    def __init__(self, cfg, walk):
        self.cfg = cfg
        self.walk = walk

    @cute.jit
    def run(self, inputs, pipes, stats, prob, work):
        """The producer's items (``work``: the scheduler's CtaWork)."""
        cfg = self.cfg
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.kv_stages)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        if const_expr(cfg.persistent):
            for index in cutlass.range(work.first, work.items, work.stride, unroll=1):
                item = self.walk.item(index, prob)
                kv_state, state = self.load(inputs, pipes, stats, prob, kv_state, state, item)
        elif const_expr(cfg.two_query_tiles):
            self.load_two_tiles(inputs, pipes, stats, prob, kv_state, state, work.item)
        else:
            self.load(inputs, pipes, stats, prob, kv_state, state, work.item)

    @cute.jit
    def load(self, inputs, pipes, stats, prob, kv_state, state, item):
        """One item, one query tile per step. Returns the advanced pipeline states."""
        cfg = self.cfg
        whole = cute.make_layout(1)
        self.load_kv(inputs, pipes, kv_state, item, prob)
        for step in cutlass.range(item.steps, unroll=1):
            head_q = item.head_kv * prob.group + step // item.span
            m_block = self.walk.m_block(step, item.m_first, item.span, prob.m_blocks)
            ws_batch, ws_tiles, ws_m = self.walk.ws_tile(prob, item.batch, prob.m_blocks, m_block)
            stats_at = self.stats_at(ws_batch, prob.heads_q, head_q, ws_tiles, ws_m)
            loads = ((inputs.tma_do, inputs.gdO, inputs.sdO, pipes.do, stats.dsum_ptr, stats.sDsum, cfg.head_dim_v),
                     (inputs.tma_q, inputs.gQ, inputs.sQ, pipes.q, stats.lse2_ptr, stats.sLSE2, cfg.head_dim))
            for atom, g_all, s_all, pipe, stats_ptr, s_stats, width in loads:
                pipe.producer_acquire(state)
                q_tile = cute.local_tile(self.walk.rows_of(g_all, prob, head_q, item.batch, False),
                                         (cfg.tile_m, width), (m_block, 0))
                part_s, part_g = cpasync.tma_partition(
                    atom, 0, whole, cute.group_modes(s_all, 0, 2), cute.group_modes(q_tile, 0, 2))
                cute.copy(atom, part_g, part_s[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
                if step > 0:
                    self.load_stats(s_stats, stats_ptr + stats_at, pipe, state)
            if step == 0:
                cute.arch.griddepcontrol_wait()
                for _, _, _, pipe, stats_ptr, s_stats, _ in loads:
                    self.load_stats(s_stats, stats_ptr + stats_at, pipe, state)
            state.advance()
        return kv_state, state

    @cute.jit
    def load_two_tiles(self, inputs, pipes, stats, prob, kv_state, state, item):
        """One item, two query tiles per step (``walk.pair``), each with its statistics,
        onto one stage; a missing second half loads the first's statistics (finite: see
        two_query_tiles.py)."""
        cfg = self.cfg
        whole = cute.make_layout(1)
        tm, d = cfg.tile_m, cfg.head_dim
        m_blocks, heads_q, batch = prob.m_blocks, prob.heads_q, item.batch
        self.load_kv(inputs, pipes, kv_state, item, prob)
        head_off, tile_off = Int32(0), Int32(0)
        for step in cutlass.range(cute.ceil_div(item.steps, 2), unroll=1):
            head_a, m_a, head_b, m_b, real = self.walk.pair(step, head_off, tile_off, item.m_first, item.span, m_blocks,
                                                        item.steps, item.head_kv, prob.group)
            head_off, tile_off = self.walk.next_pair(head_off, tile_off, item.span)
            m_b_stats = Int32(cutlass.select_(real == 1, m_b, m_a))
            halves = ((head_a, m_a, m_a), (head_b, m_b, m_b_stats))
            loads = ((inputs.tma_do, inputs.gdO, inputs.sdO, pipes.do, stats.dsum_ptr, stats.sDsum),
                     (inputs.tma_q, inputs.gQ, inputs.sQ, pipes.q, stats.lse2_ptr, stats.sLSE2))
            for atom, g_all, s_all, pipe, stats_ptr, s_stats in loads:
                pipe.producer_acquire(state)
                for h in cutlass.range_constexpr(2):
                    head_q, m_load, m_stats = halves[h]
                    q_tile = cute.local_tile(g_all[None, None, head_q, batch], (tm, d), (m_load, 0))
                    s_half = cute.local_tile(s_all[None, None, state.index], (tm, d), (h, 0))
                    part_s, part_g = cpasync.tma_partition(
                        atom, 0, whole, cute.group_modes(s_half, 0, 2), cute.group_modes(q_tile, 0, 2))
                    cute.copy(atom, part_g, part_s, tma_bar_ptr=pipe.producer_get_barrier(state))
                    if step > 0:
                        at = self.stats_at(batch, heads_q, head_q, m_blocks, m_stats)
                        self.load_stats(s_stats, stats_ptr + at, pipe, state, h)
            if step == 0:
                cute.arch.griddepcontrol_wait()
                for _, _, _, pipe, stats_ptr, s_stats in loads:
                    for h in cutlass.range_constexpr(2):
                        head_q, _, m_stats = halves[h]
                        at = self.stats_at(batch, heads_q, head_q, m_blocks, m_stats)
                        self.load_stats(s_stats, stats_ptr + at, pipe, state, h)
            state.advance()
        return kv_state, state

    def load_kv(self, inputs, pipes, kv_state, item, prob):
        """The item's K and V tiles onto one mbarrier stage (persistent: the item's stage of
        two); advances kv_state."""
        cfg = self.cfg
        pipes.kv.producer_acquire(kv_state)
        for atom, g, s, width in ((inputs.tma_k, inputs.gK, inputs.sK, cfg.head_dim),
                                  (inputs.tma_v, inputs.gV, inputs.sV, cfg.head_dim_v)):
            tile = cute.local_tile(self.walk.rows_of(g, prob, item.head_kv, item.batch, True),
                                   (cfg.tile_n, width), (item.n_block, 0))
            t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                             cute.group_modes(tile, 0, 2))
            if const_expr(cfg.persistent):
                t_s = t_s[None, kv_state.index]
            cute.copy(atom, t_g, t_s, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
        kv_state.advance()

    def stats_at(self, batch, heads_q, head_q, m_blocks, m_block):
        """Element offset of query tile m_block's statistics in the LSE2 or D workspace
        ((b, h_q, s_q padded to whole tiles))."""
        return ((batch * heads_q + head_q) * m_blocks + m_block) * self.cfg.tile_m

    def load_stats(self, s_stats, src, pipe, state, half: int = 0):
        """A tile's tile_m statistics (LSE2 or D) onto its stage's mbarrier, at row
        half * tile_m of the stage (two query tiles: each stage holds two tiles')."""
        with cute.arch.elect_one():
            bulk_copy_g2s(s_stats[None, state.index].iterator + half * self.cfg.tile_m, src,
                          pipe.producer_get_barrier(state), 4 * self.cfg.tile_m)
