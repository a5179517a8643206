"""Which query tiles a backward CTA visits, and the deterministic order of the dQ reduces.

Integer functions of the CTA's key tile and the problem's sizes: the kernel
(``sm90/bwd``) calls them on Int32 values, the CPU tests (tests/cpu/test_order.py) on
Python ints, so the order that keeps the deterministic backward deadlock-free is checked
without a GPU.
"""

import cutlass
import cutlass.cute as cute


def key_tile_of_launch(x, n_blocks, causal: bool, deterministic: bool):
    """The key tile of the CTA launched x-th (block x) among the n_blocks of its head:
    causal (or local) deterministic ones highest key tile first (the fewest query tiles
    first; local: each waits only for higher key tiles, dq_turn)."""
    return n_blocks - 1 - x if causal and deterministic else x


# A sliding window (local variants): query row i sees keys j with
# i + dk - left <= j <= i + dk + right, dk = seqlen_k - seqlen_q, (left, right) as
# sm90.mask.Window.of clamps them (>= 0). A query tile m (rows [m tm, (m + 1) tm), its
# padding rows included) and a key tile n (keys [n tn, (n + 1) tn)) touch iff some row of
# one sees some key of the other; the two functions below are that one relation read from
# either side (every numerator kept >= 0, so integer division floors on Int32 too).
def window_key_tiles(m_block, n_blocks, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window):
    """(lowest, highest) key tile query tile m_block touches; empty when lowest > highest."""
    left, right = window
    dk = seqlen_k - seqlen_q
    low = cutlass.max(m_block * tile_m + dk - left, 0) // tile_n
    top = (m_block + 1) * tile_m - 1 + dk + right  # the last row's last key
    high = cutlass.min((cutlass.max(top, -tile_n) + tile_n) // tile_n - 1, n_blocks - 1)
    return low, high


def window_query_tiles(n_block, m_blocks, seqlen_q, seqlen_k, tile_m: int, tile_n: int, window):
    """[first, end) of the query tiles key tile n_block touches (end <= first: none)."""
    left, right = window
    dk = seqlen_k - seqlen_q
    first = cutlass.max(n_block * tile_n - dk - right, 0) // tile_m
    bottom = (n_block + 1) * tile_n - 1 - dk + left  # the last key's last row
    end = cutlass.min((cutlass.max(bottom, -tile_m) + tile_m) // tile_m, m_blocks)
    return first, end


def first_query_tile(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """The first query tile key tile n_block touches (query q sees key j iff
    j <= q + seqlen_k - seqlen_q when causal)."""
    if causal:
        return cutlass.max(n_block * tile_n - (seqlen_k - seqlen_q), 0) // tile_m
    return 0


def dq_chain(n_block, chains: int):
    """The accumulator copy (and semaphore) key tile n_block adds its dQ into."""
    return n_block % chains


def dq_turn(n_block, run, run_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k, tile_m: int, tile_n: int,
            causal: bool, chains: int = 1, window=None):
    """Key tile n_block's place in the order of the dQ reduces into query tiles
    [run * run_tiles, (run + 1) * run_tiles) of its chain (dq_chain). Not causal:
    ascending key tile within the chain. Causal (one chain):
    from the highest key tile touching the run (every one that touches it touches its
    last query tile) downward. Either way each CTA waits only for CTAs launched before it
    (key_tile_of_launch), so the order cannot deadlock however few CTAs are resident.
    Local (``window``, one chain): as causal, from the highest key tile touching the run's
    last tile down; the key tiles touching a run are contiguous (each tile's are, and
    neighbouring tiles' overlap or abut), so the turns are 0, 1, ... with no gap."""
    if window is not None:
        assert chains == 1
        run_last = cutlass.min((run + 1) * run_tiles, m_blocks) - 1
        return window_key_tiles(run_last, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n, window)[1] - n_block
    if causal:
        assert chains == 1
        run_last = cutlass.min((run + 1) * run_tiles, m_blocks) - 1
        last_key = cutlass.max((run_last + 1) * tile_m + seqlen_k - seqlen_q, 0)
        return cutlass.min(cute.ceil_div(last_key, tile_n), n_blocks) - 1 - n_block
    return n_block // chains


def first_dq_key_tile(m_block, chain, n_blocks, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool,
                      window=None):
    """Deterministic: the key tile whose dQ share reaches query tile m_block of accumulator
    copy ``chain`` first (stored; the later turns add theirs). A real key tile only if in
    [0, n_blocks): no key tile touches a causal query tile whose rows see no key (-1), and
    copy ``chain`` gets nothing when not causal with n_blocks <= chain. Not causal: the
    chain's lowest key tile, ``chain`` (turns ascend within a chain, and every key tile
    touches every query tile). Causal: the highest key tile touching m_block, which has
    the lowest turn of those touching it in its run (dq_turn). Local (``window``): the same,
    where some key tile touches m_block (window_key_tiles not empty; else meaningless)."""
    if window is not None:
        return window_key_tiles(m_block, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n, window)[1]
    if causal:
        last_key = cutlass.max((m_block + 1) * tile_m + seqlen_k - seqlen_q, 0)
        return cutlass.min(cute.ceil_div(last_key, tile_n), n_blocks) - 1
    return chain


def semaphore_word(batch, heads_q, head, m_blocks, tile, chains: int = 1, chain=0):
    """Index of the dQ semaphore word of (batch, query head, query tile or deterministic
    run ``tile``, accumulator copy ``chain``) in the workspace's int32 words, laid out
    (batch, head, tile, copy): the tickets of the non-deterministic kernel (one copy),
    the turns of the deterministic one (a run's word is its first tile's; runs < tiles)."""
    return ((batch * heads_q + head) * m_blocks + tile) * chains + chain


def tail_item(linear, items, tail_tiles, pieces):
    """(item, tail tile, piece) of block ``linear`` of a split-tail grid (fa4_aot.policy.tail_split):
    the first items - tail_tiles blocks take those items whole (tail tile -1, piece 0); the
    next tail_tiles * pieces blocks take the last tail_tiles items, tile by tile, in
    ``pieces`` pieces each. (Branch-free: the kernels call it on Int32 values.)"""
    at = cutlass.max(linear - (items - tail_tiles), -1)  # -1: a whole item
    split = cutlass.min(at + 1, 1)  # 1 for a piece
    t = cutlass.max(at, 0) // pieces
    return linear - split * (at - t), split * (t + 1) - 1, cutlass.max(at, 0) - t * pieces


def piece_tiles(piece, pieces, m_blocks, unit: int):
    """(first query tile, tiles) of piece ``piece`` of ``pieces`` of a key tile's query
    range (m_blocks tiles), cut at multiples of ``unit`` tiles (a step's)."""
    units = (m_blocks + unit - 1) // unit
    first = piece * units // pieces * unit
    last = cutlass.min((piece + 1) * units // pieces * unit, m_blocks)
    return first, last - first
