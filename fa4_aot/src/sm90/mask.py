"""Score masking for one (m_block, n_block) tile of a forward or backward pass.

Two masks, both by writing -inf into the scores this thread holds:
- key padding: columns at or past seqlen_k (only the last key tile has them);
- causal, aligned to the bottom-right corner: query row i may see key j iff
  j <= i + seqlen_k - seqlen_q, as FlashAttention-2 and later define it;
- local (a sliding window, ``Window``): i + seqlen_k - seqlen_q - left <= j <=
  i + seqlen_k - seqlen_q + right (flash-attn's window_size; causal is right = 0).
Coordinates come from an identity tensor partitioned exactly like the accumulator, so
the mask is right for any tiled MMA.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from typing import NamedTuple

from .fragments import acc_as_rows_cols
from .primitives import select_f32


class Window(NamedTuple):
    """A sliding window in keys either side of a query's diagonal, each in [0, the sequence's
    length] (``of``: -1, unbounded, is the widest that changes nothing)."""

    left: object  # Int32
    right: object  # Int32

    @staticmethod
    def of(left, right, seqlen_q, seqlen_k) -> "Window":
        """The window of run-time (left, right), -1 unbounded, for one sequence: left at most
        seqlen_k, right at most seqlen_q, so that every bound below stays in int32."""
        return Window(cutlass.select_(left < 0, seqlen_k, cutlass.min(left, seqlen_k)),
                      cutlass.select_(right < 0, seqlen_q, cutlass.min(right, seqlen_q)))


class TileMask:
    """Compile-time shape of the masking; run-time sizes are passed to ``apply``."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, local: bool = False, right: bool = True,
                 left: bool = True):
        """Local, one edge: ``right`` False for tiles wholly below the padding and every
        row's right edge (the forward's left-edge loop), masked at the window's left edge
        only; ``left`` False for tiles the caller masks at the left edge apart, where it
        crosses them."""
        assert (right and left) or (local and (right or left)), "one edge alone is a local mask's"
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal
        self.local = local
        self.right = right
        self.left = left

    @cute.jit
    def apply(
        self, acc_s: cute.Tensor, coords: cute.Tensor, m_block: Int32, n_block: Int32,
        seqlen_q: Int32, seqlen_k: Int32, window: Window = None,
    ):
        """coords: the thread's partition of an identity tensor (tile_m, tile_n); window:
        where local.

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
            if cutlass.const_expr(self.local):
                limit = cutlass.min(limit, diag + c[r, 0][0] + 1 + window.right)
                low = diag + c[r, 0][0] - window.left  # columns below it are left of the window
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    col = c[r, j][1] - col0
                    kept = s[r, j]
                    if cutlass.const_expr(self.right):
                        kept = select_f32(col >= limit, -Float32.inf, kept)
                    if cutlass.const_expr(self.left):
                        kept = select_f32(col < low, -Float32.inf, kept)
                    s[r, j] = kept
            else:
                for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, j] = select_f32(c[r, j][1] - col0 >= limit, -Float32.inf, s[r, j])
