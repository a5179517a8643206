"""The deterministic backward's dQ order, checked on the integer functions the kernel runs.

Every CTA of a head adds its dQ tiles in turns counted by a semaphore per run of query
tiles. The order is safe only if, for every run, the turns of the CTAs touching it are
0, 1, ..., k-1 (no turn is skipped or taken twice) and each CTA waits only for CTAs
launched before it: then however few CTAs are resident, the earliest-launched waiting
CTA always has its predecessor done or running. A rotation of the query loops broke the
second rule once and hung a benchmark while every GPU test passed (docs/design.md,
"Backward: deterministic order (turns, chains, SPT)"); these checks run on every shape
class without a GPU.
"""

import itertools
import pytest

from fa4_aot.policy import PIECE_COST_STEPS, backward_tail_split, tail_split
from fa4_aot.variants import Variant

pytest.importorskip("cutlass", reason="the CuTe DSL is needed to import the kernel source")
try:
    from fa4_aot.src.common import bwd_order as bwd
    from fa4_aot.src.common import launch_order as order
except ImportError:  # the sources before they moved to fa4_aot/src/common
    from fa4_aot.src import bwd_order as bwd
    from fa4_aot.src import launch_order as order
from fa4_aot.src.sm90.bwd.config import TAIL_MAX_TILES, BwdConfig  # noqa: E402

SHAPES = [  # (seqlen_q, seqlen_k)
    (1, 1), (17, 17), (1000, 1000), (128, 700), (700, 128), (257, 513), (4096, 4096), (1300, 1300), (64, 8192),
]
TILES = [(64, 128), (80, 128), (64, 80), (64, 96)]  # (tile_m, tile_n): head_dim up to 128 (80 rows: 128 not causal), 256, 192


def ceil_div(a, b):
    return -(-a // b)


def built_chains(causal: bool) -> int:
    """The deterministic backward's dQ accumulator copies, as its config builds them."""
    return BwdConfig.of(Variant("bwd", "sm90a", "bf16", 128, causal, deterministic=True)).chains


@pytest.mark.parametrize("causal,chains", [(False, None), (False, 1), (False, 3), (True, None)],
                         ids=["full-built", "full-1chain", "full-3chains", "causal"])
@pytest.mark.parametrize("run_tiles", [1, 2])
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}_k{s[1]}")
def test_turns_are_a_permutation_that_only_waits_for_earlier_launches(shape, tiles, run_tiles, causal, chains):
    """Per run and per accumulator copy (chain): the built number of chains (causal keeps
    one), and other counts."""
    chains = built_chains(causal) if chains is None else chains
    seqlen_q, seqlen_k = shape
    tile_m, tile_n = tiles
    m_blocks, n_blocks = ceil_div(seqlen_q, tile_m), ceil_div(seqlen_k, tile_n)
    by_run = {}  # (run, chain) -> [(turn, launch index)]
    for launch in range(n_blocks):
        n_block = bwd.key_tile_of_launch(launch, n_blocks, causal, True)
        first = bwd.first_query_tile(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)
        tiles_seen = range(first, m_blocks)
        for m in tiles_seen:
            assert not causal or n_block * tile_n <= m * tile_m + tile_m - 1 + seqlen_k - seqlen_q, \
                "a key tile is given a query tile none of whose rows sees it"
        for run in sorted({m // run_tiles for m in tiles_seen}):
            turn = bwd.dq_turn(n_block, run, run_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n,
                               causal, chains)
            by_run.setdefault((run, bwd.dq_chain(n_block, chains)), []).append((turn, launch))
    for run, entries in by_run.items():
        turns = sorted(t for t, _ in entries)
        assert turns == list(range(len(entries))), f"run {run}: turns {turns}"
        launches = [x for _, x in sorted(entries)]
        assert launches == sorted(launches), f"run {run}: a turn waits for a later launch ({launches})"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_causal_key_tiles_skip_no_visible_query_tile(causal):
    """A key tile's first query tile is the first one with a row that sees one of its keys."""
    tile_m, tile_n = 64, 128
    for seqlen_q, seqlen_k in SHAPES:
        for n_block in range(ceil_div(seqlen_k, tile_n)):
            first = bwd.first_query_tile(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)
            if first > 0:
                last_row_before = first * tile_m - 1
                assert last_row_before + seqlen_k - seqlen_q < n_block * tile_n, (seqlen_q, seqlen_k, n_block)


@pytest.mark.parametrize("heads", [1, 3, 4, 9])
def test_head_groups_map_the_grid_one_to_one_keeping_each_heads_order(heads):
    """The causal block -> (launch, head) map is a bijection, and each head's CTAs keep
    their launch order."""
    n_blocks, group = 5, 4
    seen = {}
    for y in range(heads):
        for x in range(n_blocks):
            launch, head = order.launch_in_head_groups(x, y, n_blocks, heads, group)
            assert 0 <= launch < n_blocks and 0 <= head < heads
            seen.setdefault(head, []).append((x + n_blocks * y, launch))
    assert sorted(seen) == list(range(heads))
    for head, launched in seen.items():
        launches = [launch for _, launch in sorted(launched)]
        assert launches == list(range(n_blocks)), (head, launches)


def test_backward_head_groups_keep_the_groups_query_side_within_the_l2_budget():
    for head_dim in (64, 96, 128, 192, 256):
        for seqlen_q in (1, 100, 1024, 4096, 16384, 65536, 1 << 20):
            for per_kv, copies in itertools.product((1, 4, 32), (1, 2)):
                group = order.backward_head_group(seqlen_q, head_dim, per_kv, copies)
                need = seqlen_q * per_kv * (4 + 4 * copies) * head_dim
                assert group & (group - 1) == 0 and 1 <= group <= order.BWD_MAX_HEAD_GROUP
                assert group == 1 or group * need <= order.BWD_L2_BYTES
                assert 2 * group > order.BWD_MAX_HEAD_GROUP or 2 * group * need > order.BWD_L2_BYTES


def test_forward_head_groups_keep_the_groups_k_and_v_within_the_l2_budget():
    for head_dim in (64, 96, 128, 192, 256):
        for seqlen_k in (1, 100, 1024, 4096, 16384, 65536, 1 << 20):
            group = order.forward_head_group(seqlen_k, head_dim)
            assert group & (group - 1) == 0 and 1 <= group <= order.FWD_MAX_HEAD_GROUP
            assert group == 1 or group * seqlen_k * 4 * head_dim <= order.FWD_L2_BYTES
            bigger = 2 * group
            assert bigger > order.FWD_MAX_HEAD_GROUP or bigger * seqlen_k * 4 * head_dim > order.FWD_L2_BYTES


@pytest.mark.parametrize("causal,chains", [(False, None), (False, 3), (True, None)],
                         ids=["full-built", "full-3chains", "causal"])
@pytest.mark.parametrize("run_tiles", [1, 2])
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}_k{s[1]}")
def test_first_dq_writer_has_the_lowest_turn_at_its_tile(shape, tiles, run_tiles, causal, chains):
    """The deterministic backward stores a tile's first dQ share instead of adding it into a
    cleared accumulator: the key tile first_dq_key_tile names must be the one with the
    lowest turn among those touching the tile in its copy, and must name none exactly
    where none touches it (the postprocess then writes zeros)."""
    chains = built_chains(causal) if chains is None else chains
    seqlen_q, seqlen_k = shape
    tile_m, tile_n = tiles
    m_blocks, n_blocks = ceil_div(seqlen_q, tile_m), ceil_div(seqlen_k, tile_n)
    touching = {}  # (m, chain) -> [(turn, n_block)]
    for n_block in range(n_blocks):
        for m in range(bwd.first_query_tile(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal), m_blocks):
            turn = bwd.dq_turn(n_block, m // run_tiles, run_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k, tile_m,
                               tile_n, causal, chains)
            touching.setdefault((m, bwd.dq_chain(n_block, chains)), []).append((turn, n_block))
    for m in range(m_blocks):
        for chain in range(chains):
            first = bwd.first_dq_key_tile(m, chain, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n, causal)
            if (m, chain) in touching:
                assert first == min(touching[(m, chain)])[1], (m, chain)
            else:
                assert not 0 <= first < n_blocks, (m, chain, first)


# (left, right) as given (-1 unbounded): a diagonal key, narrow, off the tiles, one side,
# causal with a window, wider than the sequences
WINDOWS = [(0, 0), (1, 1), (5, -1), (-1, 7), (100, 37), (128, 0), (200, 0), (5000, 5000), (-1, -1), (-1, 0)]


def clamped(window, seqlen_q, seqlen_k):
    """The window as the kernels clamp it (sm90.mask.Window.of)."""
    left, right = window
    return (seqlen_k if left < 0 else min(left, seqlen_k)), (seqlen_q if right < 0 else min(right, seqlen_q))


def touches(m, n, seqlen_q, seqlen_k, tile_m, tile_n, window):
    """Whether a row of query tile m (padding rows too) sees a key of key tile n."""
    left, right = window
    dk = seqlen_k - seqlen_q
    # rows i of the tile see keys [i + dk - left, i + dk + right]: their union is one range
    return m * tile_m + dk - left <= (n + 1) * tile_n - 1 and (m + 1) * tile_m - 1 + dk + right >= n * tile_n


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("run_tiles", [1, 2])
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_window_walk_turns_and_first_writers(tiles, run_tiles, window):
    """Local: each key tile visits exactly the query tiles a row of which sees one of its
    keys, read from either side (window_query_tiles, window_key_tiles); per run the turns
    of the key tiles touching it are 0, 1, ... in launch order (highest key tile first);
    the first writer of each tile is the one with its lowest turn."""
    tile_m, tile_n = tiles
    for seqlen_q, seqlen_k in SHAPES:
        w = clamped(window, seqlen_q, seqlen_k)
        m_blocks, n_blocks = ceil_div(seqlen_q, tile_m), ceil_div(seqlen_k, tile_n)
        by_run, touching = {}, {}
        for launch in range(n_blocks):
            n_block = bwd.key_tile_of_launch(launch, n_blocks, True, True)
            first, end = bwd.window_query_tiles(n_block, m_blocks, seqlen_q, seqlen_k, tile_m, tile_n, w)
            seen = [m for m in range(m_blocks) if touches(m, n_block, seqlen_q, seqlen_k, tile_m, tile_n, w)]
            assert list(range(first, end)) == seen, (seqlen_q, seqlen_k, n_block)
            for m in seen:
                turn = bwd.dq_turn(n_block, m // run_tiles, run_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k,
                                   tile_m, tile_n, False, 1, w)
                touching.setdefault(m, []).append((turn, n_block))
            for run in sorted({m // run_tiles for m in seen}):
                turn = bwd.dq_turn(n_block, run, run_tiles, m_blocks, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n,
                                   False, 1, w)
                by_run.setdefault(run, []).append((turn, launch))
        for run, entries in by_run.items():
            assert sorted(t for t, _ in entries) == list(range(len(entries))), (seqlen_q, seqlen_k, run)
            launches = [x for _, x in sorted(entries)]
            assert launches == sorted(launches), f"run {run}: a turn waits for a later launch ({launches})"
        for m in range(m_blocks):
            low, high = bwd.window_key_tiles(m, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n, w)
            assert [n for _, n in sorted(touching.get(m, []), key=lambda e: e[1])] == list(range(low, high + 1))
            if m in touching:
                assert bwd.first_dq_key_tile(m, 0, n_blocks, seqlen_q, seqlen_k, tile_m, tile_n, False, w) \
                    == min(touching[m])[1]


def test_semaphore_words_fill_the_workspace_region_once():
    """Every (batch, query head, query tile, accumulator copy) has its own semaphore word,
    and together they are exactly the region fa4_aot.dense sizes (b * h_q * tiles * copies)."""
    for b, hq, m_blocks, chains in ((1, 1, 1, 1), (2, 3, 5, 1), (3, 2, 4, 2)):
        words = [bwd.semaphore_word(i, hq, h, m_blocks, t, chains, c)
                 for i in range(b) for h in range(hq) for t in range(m_blocks) for c in range(chains)]
        assert sorted(words) == list(range(b * hq * m_blocks * chains))


@pytest.mark.parametrize("sm_count", [132, 148, 4, 7])
@pytest.mark.parametrize("items,seqlen_q,unit", [
    (4096, 16384, 2), (4096, 1024, 2), (4096, 16384, 1), (2048, 4096, 1), (133, 300, 1), (133, 64, 1),
    (140, 1000, 2), (9, 17, 1), (264, 4096, 1), (131, 4096, 1), (1, 100, 1)])
def test_split_tail_covers_every_query_tile_of_every_item_once(items, seqlen_q, unit, sm_count):
    """The split last wave (policy.tail_split, bwd_order.tail_item and piece_tiles):
    every block maps to one item; an unsplit item's block takes all its query tiles, a split
    item's pieces take disjoint, non-empty ranges cut at multiples of ``unit`` that cover
    them; the grid the loader launches has exactly these blocks; pieces fill at most one
    wave."""
    tile_m = 64
    m_blocks = ceil_div(seqlen_q, tile_m)
    tiles, pieces = tail_split(items, sm_count, ceil_div(m_blocks, unit), TAIL_MAX_TILES)
    assert (tiles, pieces) == (0, 1) or (1 <= tiles <= TAIL_MAX_TILES and pieces >= 2
                                         and tiles == items % sm_count and items >= sm_count)
    grid = items + tiles * (pieces - 1)  # loader.grid_of's "split_tail"
    seen = {}
    for block in range(grid):
        item, t, piece = bwd.tail_item(block, items, tiles, pieces)
        assert 0 <= item < items
        if t < 0:
            assert item < items - tiles and piece == 0
            first, count = 0, m_blocks
        else:
            assert item == items - tiles + t and 0 <= piece < pieces
            first, count = bwd.piece_tiles(piece, pieces, m_blocks, unit)
            assert count > 0 and first % unit == 0
        seen.setdefault(item, []).extend(range(first, first + count))
    assert sorted(seen) == list(range(items))
    assert all(sorted(v) == list(range(m_blocks)) for v in seen.values())


def test_split_tail_is_taken_where_it_shortens_the_last_wave():
    assert PIECE_COST_STEPS == 2 and TAIL_MAX_TILES == 96  # the figures below
    most = TAIL_MAX_TILES
    assert tail_split(4096, 132, 128, most) == (4, 32)  # 16k tokens x 2048, d64: 4 tiles left, 1 round
    assert tail_split(4096, 132, 8, most) == (4, 8)  # 1k queries: one step (two tiles) a piece
    assert tail_split(2048, 132, 205, most) == (68, 9)  # d128 (80-row steps) at 16k: 5 rounds
    assert tail_split(2048, 132, 13, most) == (0, 1)  # ... at 1k: no split pays for its pieces
    assert tail_split(2048 + 100, 2048, 64, most) == (0, 1)  # 100 left > TAIL_MAX_TILES
    assert tail_split(132 * 3, 132, 64, most) == (0, 1)  # whole waves
    assert tail_split(100, 132, 64, most) == (0, 1)  # less than one wave: every SM already busy


def test_backward_tail_split_by_problem():
    """fa4_aot.policy.backward_tail_split on the baselines grid (16k tokens, heads x
    head_dim = 2048) on 132 SMs, with each variant's config as the manifest carries it:
    what the backward launches; none causal, deterministic or GQA."""
    def split(d, s, causal=False, det=False, heads_kv=None, sm=132):
        h = 2048 // d
        sizes = {"batch": 16384 // s, "seqlen_q": s, "seqlen_k": s, "heads_q": h, "heads_kv": heads_kv or h,
                 "head_dim": d}
        config = BwdConfig.of(Variant("bwd", "sm90a", "bf16", d, causal, deterministic=det)).to_dict()
        return backward_tail_split(sizes, config, TAIL_MAX_TILES, sm)

    assert [split(64, s) for s in (1024, 4096, 16384)] == [(4, 8), (4, 32), (4, 32)]
    assert [split(128, s) for s in (1024, 4096, 16384)] == [(0, 1), (68, 5), (68, 9)]
    assert split(64, 4096, causal=True) == split(64, 4096, det=True) == split(256, 4096) == (0, 1)
    assert split(64, 4096, heads_kv=8) == (0, 1)
