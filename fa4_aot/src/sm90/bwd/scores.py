"""The backward's score arithmetic (sm_90a), shared by every consumer loop: P from the
scores and LSE2, with the padding and causal masks, and dS = P (dP - D), on wgmma
accumulator fragments viewed as (rows, cols): keys on rows (S^T, the layout of head dims
64-128) or queries on rows (S, head dims 192 and 256).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..fragments import acc_as_rows_cols
from ..primitives import select_f32
from ..softmax import cap_scores


class TileAt(NamedTuple):
    """Where a step's scores lie: its key tile and query tile, and (wide, masked) the
    query tile of its queries from tile_m on, which need not follow m_block (a pair of
    tiles that spans two query heads of a GQA group)."""

    n_block: object
    m_block: object
    m_upper: object = None


class ScoreMath:
    def __init__(self, cfg):
        self.cfg = cfg

    @cute.jit
    def probs(self, acc_s, s_coords, lse2, at: TileAt, prob, scalars,
               queries_on_rows: cutlass.Constexpr[bool] = False, by_query: cutlass.Constexpr[bool] = False):
        """S^T -> P^T (or, ``queries_on_rows``, S -> P) in place: exp2(S * scale * log2(e) -
        LSE2), 0 where masked; ``lse2`` holds this thread's queries' values (by column, or by
        row), or, ``by_query``, is the stage's shared (tile_m,) values, read where used (no
        registers held for them). Only the last key tile (padding) and, causal, tiles that
        cross the diagonal are masked; local, also tiles that cross either edge of
        ``prob.window``. ``scalars``: the exponent's scale ``scale_log2``; softcap, the
        scores first become tanh(S * softcap_scale) (softmax.cap_scores, as the forward's),
        and ``scale_log2`` is cap * log2(e).

        Keys on rows, the scores are masked (to -inf) before the exponentials, so that no
        branch stands between the exponentials and dS: ptxas then spreads the MUFU.EX2s among
        dS's arithmetic instead of issuing forty in a row (d128 causal +2.5%; docs/design.md,
        "Backward: keys on M"). Queries on rows (head_on_m), the exponentials come first and the mask
        after (to 0): there the other order let ptxas sink the exponentials behind dP's wait
        and the dS barrier (d256 -3 to -4%)."""
        s, scale_log2 = acc_as_rows_cols(acc_s), scalars.scale_log2
        if const_expr(self.cfg.softcap):
            cap_scores(acc_s, scalars.softcap_scale)
        if const_expr(not queries_on_rows):
            self.mask_scores(s, s_coords, at, prob, -Float32.inf, False)
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
            self.mask_scores(s, s_coords, at, prob, Float32(0.0), True)

    @cute.jit
    def mask_scores(self, s, s_coords, at: TileAt, prob, fill, queries_on_rows: cutlass.Constexpr[bool]):
        """``fill`` where a key lies past its query's limit, or local before its window's
        first key (``_probs``'s tiles, as rows and columns); a branch around the mask,
        taken only by the last key tile (padding) and, causal or local, tiles that cross
        the diagonal or a window's edge (keys on rows, one tile: a branch per edge)."""
        tm, tn = self.cfg.tile_m, self.cfg.tile_n
        n_block, m_block, m_upper = at
        seqlen_q, seqlen_k, window = prob.seqlen_q, prob.seqlen_k, prob.window
        # the last key the tile's first query may see (exclusive bound, as a count)
        visible = seqlen_k
        if const_expr(self.cfg.masked):
            first_tile = m_block if const_expr(m_upper is None) else cutlass.min(m_block, m_upper)
            reach = 0 if const_expr(not self.cfg.local) else window.right
            visible = cutlass.min(visible, first_tile * tm + 1 + seqlen_k - seqlen_q + reach)
        crosses = (n_block + 1) * tn > visible  # padding, the diagonal or the window's right edge
        if const_expr(not queries_on_rows and m_upper is None):
            # each edge behind its own branch: a narrow window's step mostly crosses one
            if crosses:
                self._mask_keys_on_rows(s, s_coords, n_block, m_block, prob, fill, True)
            if const_expr(self.cfg.local):
                # the first key the step's last query may see
                if n_block * tn < m_block * tm + self.cfg.step_rows - 1 + seqlen_k - seqlen_q - window.left:
                    self._mask_keys_on_rows(s, s_coords, n_block, m_block, prob, fill, False)
        else:
            if const_expr(self.cfg.local):
                # the first key the tile's last query may see
                last_tile = m_block if const_expr(m_upper is None) else cutlass.max(m_block, m_upper)
                crosses = crosses | (n_block * tn < (last_tile + 1) * tm - 1 + seqlen_k - seqlen_q - window.left)
            if crosses:
                self._mask_by_bounds(s, s_coords, at, prob, fill, queries_on_rows)

    @cute.jit
    def _mask_keys_on_rows(self, s, s_coords, n_block, m_block, prob, fill, right: cutlass.Constexpr[bool]):
        """mask_scores on S^T (keys on rows) of a step's query tiles (consecutive ones) at
        one edge: ``right``, padding and the diagonal (local: the window's right edge), else
        the window's left edge. As the forward's mask (sm90/mask.py), the bounds are taken
        relative to this thread's first query column, so that an element compares its
        constant column offset with a threshold of its row, instead of its column's key
        bounds, held or recomputed for every column (docs/design.md, "Backward: keys on M
        (d64/96/128)")."""
        tm, tn = self.cfg.tile_m, self.cfg.tile_n
        q0 = s_coords[0, 0][1]
        # key - query - (seqlen_k - seqlen_q) at row 0 and the first column, less its key
        diag = n_block * tn - m_block * tm - q0 - (prob.seqlen_k - prob.seqlen_q)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            # element (r, j) at column offset c lies rel - c keys right of its query's diagonal
            rel = diag + s_coords[r, 0][0]
            if const_expr(right):
                # columns c < past_right are hidden: keys right of the diagonal (local: past
                # its right edge), or every column of a padding row (c < step_rows always)
                past_right = rel if const_expr(self.cfg.masked) else Int32(-1)
                if const_expr(self.cfg.local and not self.cfg.causal):
                    past_right = rel - prob.window.right
                past_right = cutlass.select_(n_block * tn + s_coords[r, 0][0] >= prob.seqlen_k,
                                             Int32(self.cfg.step_rows), past_right)
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, j] = select_f32(s_coords[r, j][1] - q0 < past_right, fill, s[r, j])
            else:
                past_left = rel + prob.window.left  # columns c > past_left: keys left of the window
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, j] = select_f32(s_coords[r, j][1] - q0 > past_left, fill, s[r, j])

    @cute.jit
    def _mask_by_bounds(self, s, s_coords, at: TileAt, prob, fill, queries_on_rows: cutlass.Constexpr[bool]):
        """mask_scores by each element's key bounds: queries on rows, or a step of two
        query tiles (``at.m_upper``), whose columns' tiles differ."""
        tm, tn = self.cfg.tile_m, self.cfg.tile_n
        n_block, m_block, m_upper = at
        # what depends on the row alone (its key, or its query's bounds) computed once a row
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            if const_expr(queries_on_rows):
                row_low, row_limit = self.key_bounds(s_coords[r, 0][0], m_block, prob)
            else:
                row_key = n_block * tn + s_coords[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                if const_expr(queries_on_rows):
                    key, low, limit = n_block * tn + s_coords[r, j][1], row_low, row_limit
                else:
                    query, tile = s_coords[r, j][1], m_block
                    if const_expr(m_upper is not None):
                        # queries tile_m.. of the upper tile: row m_upper * tile_m + (query - tile_m)
                        tile = cutlass.select_(query < tm, m_block, m_upper - 1)
                    low, limit = self.key_bounds(query, tile, prob)
                    key = row_key
                if const_expr(self.cfg.local):
                    s[r, j] = select_f32(key < low, fill, select_f32(key >= limit, fill, s[r, j]))
                else:
                    s[r, j] = select_f32(key >= limit, fill, s[r, j])

    def key_bounds(self, query, m_block, prob):
        """[low, limit): the keys query ``query`` of tile m_block may see (low: local only,
        else None)."""
        seqlen_q, seqlen_k, window = prob.seqlen_q, prob.seqlen_k, prob.window
        limit, low = seqlen_k, None
        row = m_block * self.cfg.tile_m + query
        if const_expr(self.cfg.causal):
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q)
        if const_expr(self.cfg.local):
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q + window.right)
            low = row + seqlen_k - seqlen_q - window.left
        return low, limit

    @cute.jit
    def grads(self, acc_p, acc_dp, dsum, queries_on_rows: cutlass.Constexpr[bool] = False, s_coords=None,
               by_query: cutlass.Constexpr[bool] = False, lse2=None, scale_log2=None):
        """dP^T -> dS^T (or, ``queries_on_rows``, dP -> dS) in place: P (dP - D); ``dsum``
        holds this thread's queries' D values, as ``_probs`` takes LSE2 (``by_query``: the
        stage's shared values, at s_coords' queries). softcap: times tanh's derivative,
        1 - t^2, t recovered from P itself, t = (log2(P) + LSE2) / (cap log2(e)) (``lse2``
        as ``probs`` took it, ``scale_log2`` = cap log2(e)): no register holds t between
        the two (where P is 0, so is dS)."""
        p, dp = acc_as_rows_cols(acc_p), acc_as_rows_cols(acc_dp)
        inv = None
        if const_expr(self.cfg.softcap):
            inv = cute.arch.rcp_approx(scale_log2)
        if const_expr(by_query):
            for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                value = dsum[s_coords[0, j][1]]
                shift = lse2[s_coords[0, j][1]] if const_expr(self.cfg.softcap) else None
                for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                    dp[r, j] = p[r, j] * (dp[r, j] - value)
                    if const_expr(self.cfg.softcap):
                        dp[r, j] = dp[r, j] * self._dtanh(p[r, j], shift, inv)
        else:
            for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                    at = r if queries_on_rows else j
                    shift = lse2[at] if const_expr(self.cfg.softcap) else None
                    dp[r, j] = p[r, j] * (dp[r, j] - dsum[at])
                    if const_expr(self.cfg.softcap):
                        dp[r, j] = dp[r, j] * self._dtanh(p[r, j], shift, inv)

    def _dtanh(self, p, lse2_value, inv):
        """softcap: 1 - t^2 of the score whose probability is ``p`` (0 where p is 0: its dS
        is 0 whatever t was, and log2(0) would make it NaN)."""
        t = (cute.math.log2(p, fastmath=True) + lse2_value) * inv
        return select_f32(p > Float32(0.0), Float32(1.0) - t * t, Float32(0.0))
