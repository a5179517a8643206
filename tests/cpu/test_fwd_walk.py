"""The local forward's walk (fwd/key_tiles.py, and the three key loops of
fwd/kernel.py's _key_loop) against every (row, key) pair: each consumer warpgroup's key
tiles cover every key its rows see, the unmasked loop's tiles need no mask, and the
left-edge loop's tiles need none at the right edge (it masks the left edge alone), and
the right-edge tiles need the left edge only below _left_masked_end (its branch:
docs/design.md, "Local attention, sinks, softcap"). The key-tile functions run on Python
ints (the kernels run them on Int32); the loops' split is modelled as _key_loop computes it."""
import random
from types import SimpleNamespace

import pytest

from fa4_aot.src.sm90.fwd.key_tiles import KeyTiles
from fa4_aot.src.sm90.mask import Window

TILES = [(256, 64), (128, 64), (128, 128), (128, 112)]  # the local forwards' (tile_m, tile_n)
WINDOWS = [(0, 0), (1, 1), (5, -1), (-1, 7), (100, 37), (128, 0), (200, 0), (256, 0), (512, 0), (1024, 64),
           (63, 64), (-1, -1)]


def _walk(tile_m, tile_n):
    walk = KeyTiles()
    walk.cfg = SimpleNamespace(tile_m=tile_m, tile_n=tile_n, masks_right=True, local=True, causal=False)
    return walk


def _loops(walk, m_block, wg, seqlen_q, seqlen_k, window):
    """(first tile, right-edge loop, unmasked loop, left-edge loop) of warpgroup ``wg``, each a
    list of key tiles, or None where it computes nothing; as _key_loop splits n_low..n_own."""
    n_blocks = walk._key_tiles(m_block, seqlen_q, seqlen_k, window)
    n_min = walk._first_key_tile(m_block, seqlen_q, seqlen_k, window)
    n_low = walk._own_first_key_tile(m_block, wg, seqlen_q, seqlen_k, window)
    n_own, idle = KeyTiles._own_key_tiles.__wrapped__(walk, m_block, wg, n_blocks, seqlen_q, seqlen_k, window, n_low)
    if n_blocks <= n_min or idle:
        return None
    first_masked = KeyTiles._first_masked.__wrapped__(walk, m_block, seqlen_q, seqlen_k, window, wg)
    total = n_own - 1 - n_low
    right = min(max(n_own - 1 - first_masked, 0), total)
    left = min(max(walk._left_masked_end(m_block, wg, seqlen_q, seqlen_k, window) - n_low, 0), total - right)
    tiles = list(range(n_own - 2, n_low - 1, -1))
    return [n_own - 1], tiles[:right], tiles[right:total - left], tiles[total - left:]


def _needs(row, tile, tile_n, seqlen_q, seqlen_k, window):
    """(whether some key of ``tile`` lies left of row's window, whether some lies right of
    it or past the keys, whether some is visible)."""
    diag = row + seqlen_k - seqlen_q
    keys = range(tile * tile_n, (tile + 1) * tile_n)
    return (keys[0] < diag - window.left, keys[-1] > min(diag + window.right, seqlen_k - 1),
            max(keys[0], diag - window.left) <= min(keys[-1], diag + window.right, seqlen_k - 1))


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_local_forward_walk_masks_what_each_loop_needs(tiles):
    tile_m, tile_n = tiles
    walk, rng = _walk(tile_m, tile_n), random.Random(tile_m * 1000 + tile_n)
    shapes = [(s, s) for s in (1, 63, 64, 300, 1000)] + [(rng.randint(1, 900), rng.randint(1, 900)) for _ in range(12)]
    for seqlen_q, seqlen_k in shapes:
        for left, right in WINDOWS:
            window = Window(seqlen_k if left < 0 else min(left, seqlen_k), seqlen_q if right < 0 else min(right, seqlen_q))
            for m_block in range(-(-seqlen_q // tile_m)):
                for wg in range(tile_m // 64):
                    loops = _loops(walk, m_block, wg, seqlen_q, seqlen_k, window)
                    rows = range(m_block * tile_m + wg * 64, min(m_block * tile_m + wg * 64 + 64, seqlen_q))
                    seen = {t for r in rows for t in range(-(-max(seqlen_k, 1) // tile_n))
                            if _needs(r, t, tile_n, seqlen_q, seqlen_k, window)[2]}
                    where = f"s_q {seqlen_q} s_k {seqlen_k} window {window} m {m_block} wg {wg}"
                    if loops is None:
                        assert not seen, f"{where}: idle, yet its rows see key tiles {sorted(seen)}"
                        continue
                    first, at_right, plain, at_left = loops
                    assert seen <= set(first + at_right + plain + at_left), f"{where}: keys seen outside its tiles"
                    for t in plain:
                        assert not any(any(_needs(r, t, tile_n, seqlen_q, seqlen_k, window)[:2]) for r in rows), \
                            f"{where}: tile {t} in the unmasked loop needs a mask"
                    for t in at_left:
                        assert not any(_needs(r, t, tile_n, seqlen_q, seqlen_k, window)[1] for r in rows), \
                            f"{where}: tile {t} in the left-edge loop needs the right edge"
                    # the right-edge tiles take the left edge only below _left_masked_end
                    end = walk._left_masked_end(m_block, wg, seqlen_q, seqlen_k, window)
                    for t in first + at_right:
                        assert t < end or not any(_needs(r, t, tile_n, seqlen_q, seqlen_k, window)[0] for r in rows), \
                            f"{where}: right-edge tile {t} at or above the left-edge end {end} needs the left edge"
