"""Score masking for one (m_block, n_block) tile of a forward or backward pass.

Two masks, both by writing -inf into the scores this thread holds:
- key padding: columns at or past seqlen_k (only the last key tile has them);
- causal, aligned to the bottom-right corner: query row i may see key j iff
  j <= i + seqlen_k - seqlen_q, as FlashAttention-2 and later define it.
Coordinates come from an identity tensor partitioned exactly like the accumulator, so
the mask is right for any tiled MMA.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .fragments import acc_as_rows_cols
from .primitives import select_f32


class TileMask:
    """Compile-time shape of the masking; run-time sizes are passed to ``apply``."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal

    @cute.jit
    def apply(
        self, acc_s: cute.Tensor, coords: cute.Tensor, m_block: Int32, n_block: Int32,
        seqlen_q: Int32, seqlen_k: Int32,
    ):
        """coords: the thread's partition of an identity tensor (tile_m, tile_n).

        Callers decide which tiles need it (the forward at compile time: its masked key
        tiles run in a loop of their own, so the other loop carries no mask code).
        """
        s = acc_as_rows_cols(acc_s)
        c = acc_as_rows_cols(coords)
        # Limits are taken relative to this thread's first column, so each element compares
        # a constant column offset (no column coordinates held in registers).
        col0 = c[0, 0][1]
        col_limit_base = seqlen_k - n_block * self.tile_n - col0
        diag = seqlen_k - seqlen_q + m_block * self.tile_m - n_block * self.tile_n - col0
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            limit = col_limit_base
            if cutlass.const_expr(self.causal):
                limit = cutlass.min(limit, diag + c[r, 0][0] + 1)
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, j] = select_f32(c[r, j][1] - col0 >= limit, -Float32.inf, s[r, j])
