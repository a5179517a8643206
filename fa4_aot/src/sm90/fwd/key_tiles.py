"""Which key tiles a forward query tile, and each of its consumer warpgroups, attend to:
integer functions of the tile, the sequence lengths and the window, shared by the producer
(what it loads), the consumers (what each computes, masks or passes over) and the head
split (fwd/head_split.py). Causal is bottom-right aligned; local adds the window's edges
(docs/design.md, "Forward: the key loop, overlap and ping-pong", "Local attention, sinks,
softcap")."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import const_expr


class KeyRange(NamedTuple):
    """A query tile's key tiles as a warpgroup takes them: the tile's [n_min, n_blocks),
    the warpgroup's own [n_low, n_own) (n_low None where not local), and the first that
    needs a mask at the right edge."""

    m_block: object
    n_min: object
    n_blocks: object
    n_low: object
    n_own: object
    first_masked: object


class KeyTiles:
    """Mixed into kernel.FlashFwdSm90 (its cfg: tile_m, tile_n, masks_right, local)."""

    def _key_tiles(self, m_block, seqlen_q, seqlen_k, window=None):
        """Key tiles query tile ``m_block`` attends to, one past the last (causal: up to
        its last row's diagonal; local: up to its last row's window)."""
        n_blocks = cute.ceil_div(seqlen_k, self.cfg.tile_n)
        if const_expr(self.cfg.masks_right):
            last_key = (m_block + 1) * self.cfg.tile_m + seqlen_k - seqlen_q  # exclusive
            if const_expr(self.cfg.local):
                last_key = last_key + window.right
            n_blocks = cutlass.min(n_blocks, cute.ceil_div(cutlass.max(last_key, 0), self.cfg.tile_n))
        return n_blocks

    def _first_key_tile(self, m_block, seqlen_q, seqlen_k, window=None):
        """The first key tile query tile ``m_block`` attends to: 0, or local the one of its
        first row's window (tiles below it are never loaded)."""
        if const_expr(not self.cfg.local):
            return 0
        first_key = m_block * self.cfg.tile_m + seqlen_k - seqlen_q - window.left
        return cutlass.max(first_key, 0) // self.cfg.tile_n

    def _less(self, count, n_min):
        """count - n_min: the count itself where n_min is always 0 (not local)."""
        return count - n_min if const_expr(self.cfg.local) else count

    def _wg_row(self, m_block, wg):
        """The first query row of warpgroup ``wg``'s 64 rows of query tile ``m_block``."""
        return m_block * self.cfg.tile_m + wg * 64

    def _own_first_key_tile(self, m_block, wg, seqlen_q, seqlen_k, window):
        """Local: the first key tile warpgroup ``wg``'s rows of tile m_block see (its first
        row's window); None otherwise (every warpgroup takes the tile's)."""
        if const_expr(not self.cfg.local):
            return None
        first_key = self._wg_row(m_block, wg) + seqlen_k - seqlen_q - window.left
        return cutlass.max(first_key, 0) // self.cfg.tile_n

    def _left_masked_end(self, m_block, wg, seqlen_q, seqlen_k, window):
        """Local: one past the last key tile that needs the window's left edge masked for
        warpgroup ``wg`` (some row of its starts its window inside or above it)."""
        lowest_last_row = self._wg_row(m_block, wg) + 63 + seqlen_k - seqlen_q - window.left
        return cute.ceil_div(cutlass.max(lowest_last_row, 0), self.cfg.tile_n)

    @cute.jit
    def _first_masked(self, m_block, seqlen_q, seqlen_k, window=None, wg=None):
        """The first key tile of query tile m_block that needs a mask (padding, the causal
        diagonal or the window's right edge): every one from it on. ``wg``: for that
        warpgroup's 64 rows alone (the local kernels: a later warpgroup's rows see further,
        so fewer of its tiles cross their right edge)."""
        first_masked = seqlen_k // self.cfg.tile_n
        if const_expr(self.cfg.masks_right):
            diag = m_block * self.cfg.tile_m + seqlen_k - seqlen_q
            if const_expr(wg is not None):
                diag = diag + wg * 64
            if const_expr(self.cfg.local):
                diag = diag + window.right
            first_unmasked_diag = diag // self.cfg.tile_n
            first_masked = cutlass.min(first_masked, cutlass.max(first_unmasked_diag, 0))
        return first_masked

    @cute.jit
    def _own_key_tiles(self, m_block, wg, n_blocks, seqlen_q, seqlen_k, window=None, n_low=None):
        """(one past the last key tile warpgroup ``wg``'s rows see, whether it idles: no row
        in the sequence or none that sees a key; local, ``n_low`` its first key tile)."""
        n_own = n_blocks
        if const_expr(self.cfg.masks_right):
            n_own = self._key_tiles_of_rows(m_block, wg, n_blocks, seqlen_q, seqlen_k, window)
        if const_expr(self.cfg.local):
            idle = self._wg_row(m_block, wg) >= seqlen_q or n_own <= n_low
        else:
            idle = self._wg_row(m_block, wg) >= seqlen_q or n_own == 0
        return n_own, idle

    def _key_tiles_of_rows(self, m_block, wg, n_blocks, seqlen_q, seqlen_k, window=None):
        """Causal or local: key tiles warpgroup ``wg``'s 64 rows of query tile ``m_block``
        see, up to the tile's n_blocks (at most one fewer: the warpgroups' rows are at most
        a key tile apart at every tile shape built)."""
        last_key = self._wg_row(m_block, wg) + 64 + seqlen_k - seqlen_q  # exclusive
        if const_expr(self.cfg.local):
            last_key = last_key + window.right
        return cutlass.min(n_blocks, cute.ceil_div(cutlass.max(last_key, 0), self.cfg.tile_n))
