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
    causal deterministic ones highest key tile first (the fewest query tiles first)."""
    return n_blocks - 1 - x if causal and deterministic else x


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
            causal: bool, chains: int = 1):
    """Key tile n_block's place in the order of the dQ reduces into query tiles
    [run * run_tiles, (run + 1) * run_tiles) of its chain (dq_chain). Not causal:
    ascending key tile within the chain. Causal (one chain):
    from the highest key tile touching the run (every one that touches it touches its
    last query tile) downward. Either way each CTA waits only for CTAs launched before it
    (key_tile_of_launch), so the order cannot deadlock however few CTAs are resident."""
    if causal:
        assert chains == 1
        run_last = cutlass.min((run + 1) * run_tiles, m_blocks) - 1
        last_key = cutlass.max((run_last + 1) * tile_m + seqlen_k - seqlen_q, 0)
        return cutlass.min(cute.ceil_div(last_key, tile_n), n_blocks) - 1 - n_block
    return n_block // chains


def first_dq_key_tile(m_block, chain, n_blocks, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """Deterministic: the key tile whose dQ share reaches query tile m_block of accumulator
    copy ``chain`` first (stored; the later turns add theirs). A real key tile only if in
    [0, n_blocks): no key tile touches a causal query tile whose rows see no key (-1), and
    copy ``chain`` gets nothing when not causal with n_blocks <= chain. Not causal: the
    chain's lowest key tile, ``chain`` (turns ascend within a chain, and every key tile
    touches every query tile). Causal: the highest key tile touching m_block, which has
    the lowest turn of those touching it in its run (dq_turn)."""
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
