"""Run-time policy: every choice the run time makes from a problem's sizes, in one place.

The manifest says what each kernel is (its row's ``config`` and ``workspace`` rule); this
module says which kernel a problem takes and the run-time values it is launched with.
Each threshold carries the measurement behind it (docs/design.md, "Run-time selection
policy"). What the build decided (the sort's width, decode's split limit, the persistent
keys) is read from the manifest row's ``limits``, not copied here. All of
these are speed choices: none changes what a kernel computes beyond the order of its fp32
sums (and not even that where the kernel is deterministic).

Standard library only.
"""

from __future__ import annotations

import functools

# Keys up to which the forward takes two query tiles per CTA (``q_tiles`` 2, where built):
# measured 1-13% faster at 1k and 4k keys, 2-3% slower at 16k.
TWO_TILES_MAX_SEQLEN_K = 4096

def forward_two_tiles(keys_seen: int) -> bool:
    """Whether the forward takes its two-query-tile kernel, where built: where the keys a
    query row sees (``keys_seen``: seqlen_k, or a window bounded on both sides,
    ScoreMods.keys_seen) are up to TWO_TILES_MAX_SEQLEN_K. A narrow window's tile is a few key tiles long, so the start
    and end that the second tile hides weigh most there (built for the local kernels at
    head_dim 64 only): window 128 (gpt-oss) 119-120 -> 143-145 TFLOP/s at 16k and 128k,
    256 189-192 -> 209-222, 512 271-277 -> 287-295 (docs/design.md, "Local attention,
    sinks, softcap")."""
    return keys_seen <= TWO_TILES_MAX_SEQLEN_K


def backward_two_tiles(seqlen_k: int, one_tile_persistent_keys: int) -> bool:
    """Whether the backward takes its two-query-tile kernel, where a variant has both
    (``q_tiles`` 2: head_dim 64 causal, not deterministic): past the keys up to which the
    one-tile kernel's CTAs are persistent (its row's ``limits``: 2048), where the two-tile
    one measured 5% slower (1k keys), and 2% faster at 4k and 16k."""
    return seqlen_k > one_tile_persistent_keys


def deterministic_turn_tiles(causal: bool, head_dim: int, seqlen_k: int) -> int:
    """Query tiles per ordered dQ turn of the deterministic backward: 2 where measured
    faster than 1 (up to head_dim 192, not causal, and 16k keys and more), else 1 (causal
    head_dim 256 below 16k keys: 2 measured 8-9% slower). Speed only: the bits of the
    results are the same either way."""
    return 2 if head_dim <= 192 or not causal or seqlen_k >= 16384 else 1


def first_write_dq(deterministic: bool, keys_seen: int) -> bool:
    """Whether the backward skips clearing its fp32 dQ accumulator, each query tile's first
    share being stored instead of added. It halves the preprocess's bytes. Deterministic,
    the first turn at a tile stores, and the turns order the rest anyway: +4% at 4k keys,
    +7-10% at 1k, 0 to +1.5% at 16k. Not deterministic, the first CTA to take a tile's
    ticket stores and the others wait for that store: +2-5% at 1k keys, +1-1.5% at 4k, but
    at 16k keys 0 to -0.5% not causal and 3-12% slower causal, where each CTA follows the
    one above it through the query tiles and waits for its stores. So the rule counts the
    keys a query row sees (``keys_seen``: seqlen_k, or a window bounded on both sides,
    ScoreMods.keys_seen): a narrow window's query tile takes its dQ from a few key tiles at
    any length (gpt-oss's backward at 16k: the clear is 1536 - 815 us of the preprocess in
    a 6.3 ms call). Speed only: the results are the same sums (bitwise so, deterministic)."""
    return deterministic or keys_seen <= 4096


# The backward's split last wave (variants whose config has ``tail_split``: not causal, not
# deterministic, head_dim 64, 96, 128): when the key tiles (one CTA each, all the same
# length) leave a last partial wave of at most ``tail_max_tiles`` CTAs (the workspace
# rule's constant), those tiles are each split by query range into pieces that spread
# over all the SMs; their dK, dV partial sums meet in an fp32 workspace region. 4096 key
# tiles on 132 SMs are 31.03 waves: the 32nd, 4 CTAs long, cost 2.6-2.8% of every such
# backward.
# A piece's own cost (K, V loads, the partial sums, its start and end), in steps: what
# splitting finer pays per piece (the per-CTA timelines: 3-5 us, ~2 steps).
PIECE_COST_STEPS = 2


@functools.lru_cache(maxsize=1024)
def tail_split(items: int, sm_count: int, units: int, max_tiles: int) -> tuple[int, int]:
    """(tiles, pieces): the last ``tiles`` of ``items`` equal CTAs of ``units`` steps each
    are split into ``pieces`` each, or (0, 1). The pieces run in rounds of ``sm_count``;
    taken where rounds x (steps a piece + PIECE_COST_STEPS) is least and under ``units``
    (the last wave unsplit), after at least one full wave and for at most ``max_tiles``
    tiles (what the workspace holds partial sums for)."""
    waves, tail = divmod(items, sm_count)
    if waves == 0 or tail == 0 or tail > max_tiles:
        return 0, 1
    best, cost = 1, units
    for pieces in range(2, units + 1):
        rounds = -(-tail * pieces // sm_count)
        split_cost = rounds * (-(-units // pieces) + PIECE_COST_STEPS)
        if split_cost < cost:
            best, cost = pieces, split_cost
    return (tail, best) if best > 1 else (0, 1)


def splittable_items(sizes: dict, key_tile: int) -> int:
    """The backward's (key tile, KV head, batch) items a split last wave takes its tiles
    from, for a problem's ``sizes`` (batch, seqlen_k, heads_q, heads_kv): none with GQA (a
    piece walks one query head's tiles)."""
    if sizes["heads_q"] != sizes["heads_kv"]:
        return 0
    return -(-sizes["seqlen_k"] // key_tile) * sizes["heads_kv"] * sizes["batch"]


def partial_tiles(sizes: dict, config: dict, tail_max_tiles: int) -> int:
    """Bound on the key tiles the problem's split last wave can take (what the workspace's
    partial sums are sized for): its key tiles, at most ``tail_max_tiles``."""
    return min(tail_max_tiles, splittable_items(sizes, config["tile_n"]))


def backward_tail_split(sizes: dict, config: dict, tail_max_tiles: int, sm_count: int) -> tuple[int, int]:
    """(tiles, pieces) of the backward's split last wave for a problem's ``sizes`` (batch,
    seqlen_q, seqlen_k, heads_q, heads_kv) with the kernel of manifest ``config``
    (tail_split, tile_n, step_rows) on ``sm_count`` SMs: ``tail_split`` where the kernel
    splits and a CTA walks one query head's tiles (not GQA), else (0, 1)."""
    items = splittable_items(sizes, config["tile_n"])
    if not config["tail_split"] or items == 0:
        return 0, 1
    return tail_split(items, sm_count, -(-sizes["seqlen_q"] // config["step_rows"]), tail_max_tiles)


# Dense forwards of decode shapes (fa4_aot.forward, and the torch layer and SDPA hook over
# it): the decode kernel (GQA-packed rows, split over the keys) where it measured faster
# than the prefill kernel (docs/design.md, "Run-time selection policy";
# benchmarks/bench_dense_decode.py --sweep [--local], H200: head_dim 64-256, groups 1-8,
# 1-128 query tokens, 512-32k keys, batch 2 and 16, plain, causal, and the local layers of
# gpt-oss and Gemma). Two regimes:
# - KV reuse: the prefill kernel reads each K/V tile once per query head, decode once per
#   64 packed rows (group x seqlen_q) of a KV head, at about 1.25x a prefill tile's time;
#   so decode wins where its row tiles are at most half the group. Measured with the GPU
#   full: 1.13-1.3x at group 2 (one tile), 1.2-4.4x at groups 4 and 8; one tile past that
#   rule loses (group 4 x 64 tokens 0.75-0.88, group 2 x 64 0.75-0.88, MHA 0.85-1.0). With
#   the GPU not full the splits' combine costs more than a short key range gains (batch 2,
#   512 keys: 0.65-0.93; gpt-oss's 128-key window 0.65-0.84): from 2048 keys 1.0-6.2x.
# - An underfilled GPU: where the prefill kernel's CTAs (batch x heads_q x query tiles) are
#   fewer than the SMs, the decode kernel splits the keys over them: at one packed tile
#   1.3-2.6x from 8192 keys (MHA, group 2); 0.88-1.25 at 2048.
# A local call counts the keys its windows cover (left + right + seqlen_q), not seqlen_k.
DENSE_DECODE_TILE_ROWS = 64  # the decode kernel's packed rows per CTA
# the most query tokens either regime takes (reuse: group x seqlen_q <= 32 x group; an
# underfilled GPU: one tile): callers ask no more for longer queries (a training step's)
DENSE_DECODE_MAX_SEQLEN_Q = DENSE_DECODE_TILE_ROWS
DENSE_DECODE_MIN_KEYS = 2048  # KV reuse below a full GPU
DENSE_DECODE_FEW_CTAS_MIN_KEYS = 4096


def dense_decode(batch: int, seqlen_q: int, heads_q: int, heads_kv: int, keys: int, sm_count: int | None) -> bool:
    """Whether a dense forward takes the decode kernel (where built for its options): from
    the shapes, the ``keys`` a query tile's windows cover (seqlen_k, or fewer where local)
    and the GPU's ``sm_count`` (None: whether it could on some GPU)."""
    group = heads_q // heads_kv
    rows = group * seqlen_q
    reuse = 2 * -(-rows // DENSE_DECODE_TILE_ROWS) <= group
    few = rows <= DENSE_DECODE_TILE_ROWS and keys >= DENSE_DECODE_FEW_CTAS_MIN_KEYS
    if sm_count is None:  # a GPU small enough is full, one large enough is not
        return reuse or few
    if batch * heads_q * -(-seqlen_q // 128) >= sm_count:
        return reuse
    return (reuse and keys >= DENSE_DECODE_MIN_KEYS) or few


# Decode (fa4_aot.decode): what a split costs beyond its key tiles: its start, its partial
# O write and its share of the combine, in key tiles' time (docs/design.md, "Decode").
SPLIT_COST_TILES = 1
# What splitting at all costs once, in key tiles' time: the combine's launch and its pass
# over the partials. Fitted to the dense-decode sweeps (bench_dense_decode.py --sweep
# [--local], 828 cells each timed split as this policy chose and unsplit): with 0, the
# policy's choice was 2.5% slower than the better of the two on average and 10% or more in
# 75 cells (512 keys, gpt-oss's 128-key window: 1.2-1.5x); with 3, 0.45% and 5 cells
# (worst 1.14x); 2 and 4 within 0.1% of 3.
COMBINE_COST_TILES = 3
# Decode with a bounded window (left >= 0): the span-narrow kernels (32-key tiles, four CTAs
# an SM: decode/config.NARROW_SPAN), where built (head_dim 64, no cap), where a row tile's
# windows cover at most DECODE_NARROW_MAX_SPAN keys and one split's CTAs are at least
# DECODE_NARROW_MIN_CTAS_PER_SM a multiprocessor (the span-any kernel's resident CTAs: a
# wave at least). Measured (bench_decode_local.py --windows --batch, H100, 32k caches, GQA
# 64:8, sinks, against the span-any kernel in one process; docs/design.md, "Local
# attention, sinks, softcap": windowed decode): batch 64-256 (512-2048 CTAs), window 128
# +15-17%, 1024 +2-17%, 4096 +3-6%; batch 32 -1.5 to +8%; batch 8-16 (64-128 CTAs, both
# split) -4 to -27%; the whole cache at batch 8 -2.5%.
DECODE_NARROW_MAX_SPAN = 8192
DECODE_NARROW_MIN_CTAS_PER_SM = 3


def decode_narrow(left: int, right: int, seqlen_q: int, ctas: int, sm_count: int) -> bool:
    """Whether a decode with window (``left``, ``right``; -1 unbounded) of ``seqlen_q``
    query tokens a sequence, ``ctas`` CTAs a split, on ``sm_count`` SMs takes the
    span-narrow kernels. The span: the keys its row tiles' windows cover (the queries end
    the cache, so a right reach past the last query adds nothing)."""
    if left < 0 or ctas < DECODE_NARROW_MIN_CTAS_PER_SM * sm_count:
        return False
    reach = min(right, seqlen_q) if right >= 0 else seqlen_q
    return left + reach + seqlen_q <= DECODE_NARROW_MAX_SPAN


# Key tiles between the starting points of consecutive (sequence, split) CTAs in their key
# ranges (the KV heads of one start together: they read the same cache rows).
DECODE_TURN_STRIDE = 11


@functools.lru_cache(maxsize=1024)
def decode_splits(ctas: int, key_tiles: int, sm_count: int, max_splits: int) -> int:
    """Splits of each (row tile, KV head, sequence)'s ``key_tiles`` key tiles over CTAs,
    one CTA per SM at a time, at most ``max_splits`` (the row's ``limits``): the fewest
    that minimize waves x (tiles per split + SPLIT_COST_TILES), plus COMBINE_COST_TILES
    where split, e.g. 8 sequences x 8 KV
    heads x 256 tiles on 132 SMs: 2 splits (one wave of 128 CTAs of 128 tiles); 1 x 8 x
    1024: 16; 64 x 8 x 32: 1 (512 CTAs already fill the SMs). From the shapes only, so the
    same launch serves a CUDA graph's replays."""
    best, cost = 1, -(-ctas // sm_count) * key_tiles
    for splits in range(2, min(max_splits, max(key_tiles, 1)) + 1):
        waves = -(-ctas * splits // sm_count)
        split_cost = waves * (-(-key_tiles // splits) + SPLIT_COST_TILES) + COMBINE_COST_TILES
        if split_cost < cost:
            best, cost = splits, split_cost
    return best


# Decode of a cache whose heads are at most this wide: pairs of adjacent KV heads read as
# one head of twice the width by the kernels built for it (decode/config.PAIRED_HEAD_DIMS)
# where a pair's packed rows still fit one row tile. A head of <= 64 columns is a 128-byte
# row, and a CTA that reads one head's half of each 256 bytes leaves the rest of each DRAM
# burst to another CTA at another time: issue 38's 32 x 16k GQA 16:2 d64 case ran at
# 0.73-0.75 of the copy (cuDNN 0.80) and d64 8 x 32k GQA 32:8 at 0.84-0.90, where 256-byte
# rows (d128) run at 0.99. Paired, ncu's kernel durations: d64 8 x 32k 125.5-126.5 us
# against 140.3-140.7 (0.99 of the copy in the kernel), the 16:2 case 66.7-68.0 against
# 71.4-71.5 (docs/design.md, "Decode"): pairing wherever it applies.
DECODE_PAIR_MAX_HEAD_DIM = 64
# the decode kernel's packed rows per CTA (decode/config.ROWS): the runtime does not import
# the kernel sources; tests/cpu/test_build.py holds it to the manifest's tile_m
DECODE_PAIR_TILE_ROWS = 64


def decode_pairs(head_dim: int, heads_q: int, heads_kv: int, seqlen_q: int, local: tuple | None = None) -> bool:
    """Whether a decode of these sizes (``head_dim``: the wider of the cache's K and V)
    reads pairs of adjacent KV heads as one head (the cache's layout permitting). ``local``:
    a call with sinks or a window, (its window's left, the cache's keys): paired only where
    no window bounds the keys behind and the cache holds at least DECODE_LOCAL_PAIR_MIN_KEYS."""
    if local is not None and (local[0] >= 0 or local[1] < DECODE_LOCAL_PAIR_MIN_KEYS):
        return False
    return (head_dim <= DECODE_PAIR_MAX_HEAD_DIM and heads_kv % 2 == 0
            and 2 * (heads_q // heads_kv) * seqlen_q <= DECODE_PAIR_TILE_ROWS)


# The local kernels built for pairs have the deep tiles (128 keys, one CTA an SM). Measured
# (gpt-oss, d64, GQA 64:8, sinks; bench_decode_local.py, paired against the local d64
# kernels in one process): its whole cache at batch 8, H100 32k 2771 against 2757 GB/s,
# 128k 2981 against 2780 (+7%); H200 32k 3930 against 4107 (-4%, paged -6%), 64k 4205
# against 4361 (-4%, paged -5%), 128k 4356 against 4178 (+4%); its 128-key window at batch
# 8-256 (H100) 167-953 against 212-1689. So pairs with sinks from 128k keys, no window.
DECODE_LOCAL_PAIR_MIN_KEYS = 131072


# The varlen forward's sequence order (docs/design.md, "Variable length"): "lpt" sorts the
# sequences heaviest first in a one-CTA launch before the attention kernel (up to the
# row's ``limits.lpt_max_batch`` sequences, the sort's width in shared memory);
# "plain" takes them in the caller's order. VARLEN_LPT: the default where the
# caller gives a workspace (forward_varlen) or lets the adapter allocate one: LPT, which
# measured faster on every mix (benchmarks/bench_varlen.py --order plain,lpt, H200, same
# rounds): +0.8-2.1% with the long sequence first or last at 16 heads, +1.6-3.3% on 256
# GQA prompts, +7.6% long-last causal at 4 heads.
VARLEN_LPT = True
VARLEN_ORDERS = ("plain", "lpt")


def varlen_order(batch: int, max_batch: int) -> str:
    """The varlen forward's default order for ``batch`` sequences (the sort takes at most
    ``max_batch``): "lpt" or "plain"."""
    return "lpt" if VARLEN_LPT and 2 <= batch <= max_batch else "plain"


# The varlen backward's default order (backward_varlen with order None, where its workspace
# has room for the order): heaviest first where causal and one sequence holds at least
# this share of the keys (max_seqlen_k, the caller's, against total_k: all the host knows
# without a sync), else the plain order. Heaviest first (the same sort, by the (key tile,
# query tile) pairs of each sequence's key tiles) won exactly the causal mixes with one
# long sequence, +1.1 to +5.3% (1 x 16384 + 63 x 256, first, last and at 4 heads), was
# even on the same mixes not causal and lost 2.3-3.3% on 16 x U(1, 8191) (longest 12%
# of the keys) and 256 GQA prompts (H200, bench_varlen.py --bwd --order plain,lpt --rounds
# 2; docs/design.md "Variable length"); order="lpt" or "plain" forces either.
VARLEN_BWD_LPT_KEY_SHARE = 0.5


def varlen_backward_order(batch: int, causal: bool, max_seqlen_k: int, total_k: int, max_batch: int) -> str:
    """The varlen backward's default order for ``batch`` sequences of ``total_k`` keys, the
    longest ``max_seqlen_k`` (the sort takes at most ``max_batch``): "lpt" or "plain"."""
    one_long = max_seqlen_k >= VARLEN_BWD_LPT_KEY_SHARE * total_k
    return "lpt" if causal and one_long and 2 <= batch <= max_batch else "plain"
