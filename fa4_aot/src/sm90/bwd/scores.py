"""The backward's score arithmetic (sm_90a), shared by every consumer loop: P from the
scores and LSE2, with the padding and causal masks, and dS = P (dP - D), on wgmma
accumulator fragments viewed as (rows, cols): keys on rows (S^T, the layout of head dims
64-128) or queries on rows (S, head dims 192 and 256).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..fragments import acc_as_rows_cols
from ..primitives import select_f32


class ScoreMath:
    def __init__(self, cfg):
        self.cfg = cfg

    @cute.jit
    def probs(self, acc_s, s_coords, lse2, n_block, m_block, seqlen_q, seqlen_k, scale_log2,
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
        dS's arithmetic instead of issuing forty in a row (d128 causal +2.5%; docs/design.md,
        "Backward: keys on M"). Queries on rows (head_on_m), the exponentials come first and the mask
        after (to 0): there the other order let ptxas sink the exponentials behind dP's wait
        and the dS barrier (d256 -3 to -4%)."""
        s = acc_as_rows_cols(acc_s)
        if const_expr(not queries_on_rows):
            self.mask_scores(s, s_coords, n_block, m_block, seqlen_q, seqlen_k, -Float32.inf, False, m_upper)
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
            self.mask_scores(s, s_coords, n_block, m_block, seqlen_q, seqlen_k, Float32(0.0), True, m_upper)

    @cute.jit
    def mask_scores(self, s, s_coords, n_block, m_block, seqlen_q, seqlen_k, fill,
                     queries_on_rows: cutlass.Constexpr[bool], m_upper):
        """``fill`` where a key lies past its query's limit (``_probs``'s tiles, as rows and
        columns); a branch around it all, taken only by the last key tile (padding) and,
        causal, tiles that cross the diagonal."""
        # the last key the tile's first query may see (exclusive bound, as a count)
        visible = seqlen_k
        if const_expr(self.cfg.causal):
            first_tile = m_block if const_expr(m_upper is None) else cutlass.min(m_block, m_upper)
            visible = cutlass.min(visible, first_tile * self.cfg.tile_m + 1 + seqlen_k - seqlen_q)
        if (n_block + 1) * self.cfg.tile_n > visible:
            # what depends on the row alone (its key, or its query's limit) computed once a row
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                if const_expr(queries_on_rows):
                    row_limit = self.key_limit(s_coords[r, 0][0], m_block, seqlen_q, seqlen_k)
                else:
                    row_key = n_block * self.cfg.tile_n + s_coords[r, 0][0]
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    if const_expr(queries_on_rows):
                        key, limit = n_block * self.cfg.tile_n + s_coords[r, j][1], row_limit
                    else:
                        query, tile = s_coords[r, j][1], m_block
                        if const_expr(m_upper is not None):
                            # queries tile_m.. of the upper tile: row m_upper * tile_m + (query - tile_m)
                            tile = cutlass.select_(query < self.cfg.tile_m, m_block, m_upper - 1)
                        key, limit = row_key, self.key_limit(query, tile, seqlen_q, seqlen_k)
                    s[r, j] = select_f32(key >= limit, fill, s[r, j])

    def key_limit(self, query, m_block, seqlen_q, seqlen_k):
        """The keys query ``query`` of tile m_block may see (an exclusive bound)."""
        limit = seqlen_k
        if const_expr(self.cfg.causal):
            limit = cutlass.min(limit, m_block * self.cfg.tile_m + query + 1 + seqlen_k - seqlen_q)
        return limit

    @cute.jit
    def grads(self, acc_p, acc_dp, dsum, queries_on_rows: cutlass.Constexpr[bool] = False, s_coords=None,
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
