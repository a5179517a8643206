"""The varlen kernels' heaviest-first order, mirrored in Python from the device code
(common/lpt.py: the costs and the bitonic sort; common/seqlen.py: packed_tile
with ``order`` and ``copies``, packed_tile_of_cta: the CTA's sequence, head and tile): the
sort is a permutation heaviest first, and the grid's CTAs take every (sequence, head,
query tile) of the forward, every (sequence, KV head, key tile) of the backward, exactly
once, in both orders, whatever the lengths (lying ones only within bounds). The backward's
order keeps each (sequence, KV head)'s key tiles in the plain order's launch order, which
its deterministic turns rely on."""

import itertools
import random

import pytest

MAX_BATCH = 8192  # lpt.MAX_BATCH, as the built rows' limits give it (checked below)
INDEX_BITS = MAX_BATCH.bit_length() - 1
COST_MAX = (1 << (62 - INDEX_BITS)) - 1


def ceil_div(a, b):
    return -(-a // b)


def sequence(b, cu, used, total):
    """seqlen.sequence: (offset, length) clamped to the packed rows."""
    start = cu[b]
    length = used[b] if used is not None else cu[b + 1] - start
    offset = min(max(start, 0), total)
    return offset, min(max(length, 0), total - offset)


def cost(b, lq, lk, tile_m, tile_n, causal, keys_outer=False):
    """lpt.sequence_cost (``keys_outer``: the backward's)."""
    len_q, len_k = sequence(b, *lq)[1], sequence(b, *lk)[1]
    tq, tk = ceil_div(len_q, tile_m), ceil_div(len_k, tile_n)
    visits = tq * tk
    if keys_outer:
        if causal:
            shift = len_k - len_q
            full = min(shift // tile_n + 1, tk) if shift >= 0 else 0
            rest, first = tk - full, full * tile_n - shift
            visits = max(visits - (rest * first + tile_n * (rest * (rest - 1) // 2)) // tile_m, 0)
        return min(visits + tk, COST_MAX)
    if causal:
        visits = tq * (tk - tq) + tq * (tq + 1) // 2 if tq <= tk else tk * (tk + 1) // 2
    return min(visits + tq, COST_MAX)


def lpt_order(batches, lq, lk, tile_m, tile_n, causal, keys_outer=False):
    """lpt.lpt_order: the bitonic network as the threads run it."""
    if batches > MAX_BATCH:
        return list(range(batches))
    width = 2
    while width < batches:
        width *= 2
    keys = [(cost(i, lq, lk, tile_m, tile_n, causal, keys_outer) << INDEX_BITS) | (MAX_BATCH - 1 - i)
            if i < batches else -1
            for i in range(width)]
    size = 2
    while size <= width:
        stride = size // 2
        while stride > 0:
            for i in range(width):
                partner = i ^ stride
                if partner > i:
                    a, b = keys[i], keys[partner]
                    descending = (i & size) == 0
                    keys[i], keys[partner] = (max(a, b), min(a, b)) if descending else (min(a, b), max(a, b))
            stride //= 2
        size *= 2
    return [MAX_BATCH - 1 - (keys[r] & (MAX_BATCH - 1)) for r in range(batches)]


def packed_tile(tile, lq, batches, tile_rows, order=None, copies=1):
    """seqlen.packed_tile, 32 lanes at a time."""
    base, chunk = 0, 0
    while chunk * 32 < batches:
        entries = [chunk * 32 + lane for lane in range(32)]
        seqs = [min(max(order[e], 0), batches - 1) if order is not None and e < batches else e for e in entries]
        tiles = [ceil_div(sequence(s, *lq)[1], tile_rows) * copies if e < batches else 0
                 for e, s in zip(entries, seqs)]
        inclusive = [sum(tiles[:lane + 1]) for lane in range(32)]
        if tile < base + inclusive[31]:
            first = sum(base + x <= tile for x in inclusive)
            return seqs[first], tile - base - (inclusive[first] - tiles[first])
        base += inclusive[31]
        chunk += 1
    return -1, 0


def cta_item(x, y, grid_x, lq, batches, heads, tile_m, order):
    """seqlen.packed_tile_of_cta: (sequence or -1, tile, head) of CTA (x, y)."""
    if order is None:
        found, tile = packed_tile(x, lq, batches, tile_m)
        return found, tile, y
    found, item = packed_tile(y * grid_x + x, lq, batches, tile_m, order=order, copies=heads)
    tiles = max(ceil_div(sequence(max(found, 0), *lq)[1], tile_m), 1)
    return found, item % tiles, item // tiles


def walk(lengths_q, lengths_k, heads, tile_m, tile_n, causal, lpt, used=None, cu_q=None):
    """Every CTA's (sequence, tile, head) in launch order, and the order walked."""
    cu_q = cu_q or [sum(lengths_q[:i]) for i in range(len(lengths_q) + 1)]
    cu_k = [sum(lengths_k[:i]) for i in range(len(lengths_k) + 1)]
    batches, total_q = len(cu_q) - 1, sum(lengths_q)
    lq, lk = (cu_q, used, total_q), (cu_k, None, sum(lengths_k))
    order = lpt_order(batches, lq, lk, tile_m, tile_n, causal) if lpt else None
    grid_x = ceil_div(total_q, tile_m) + batches
    items = [cta_item(x, y, grid_x, lq, batches, heads, tile_m, order) for y in range(heads) for x in range(grid_x)]
    return items, order, lq


MIXES = [
    ([256] * 63 + [16384], 4),  # the long sequence last
    ([1, 0, 130, 257, 64, 0, 0], 3),  # one-token, empty, tile +-1
    ([0, 0, 0], 2),  # nothing to compute
    ([5000], 2),  # one sequence
    *[([random.Random(s).randint(0, 900) for _ in range(70)], 2) for s in range(3)],  # more than 2 chunks of 32
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"{len(m[0])}seqs_h{m[1]}")
def test_every_tile_is_taken_once(mix, lpt, causal):
    lengths, heads = mix
    tile_m, tile_n = 128, 176
    items, order, lq = walk(lengths, lengths[::-1], heads, tile_m, tile_n, causal, lpt)
    live = [item for item in items if item[0] >= 0]
    want = {(b, t, h) for b, n in enumerate(lengths) for t in range(ceil_div(n, tile_m)) for h in range(heads)}
    assert len(live) == len(set(live)) and set(live) == want
    if lpt:
        assert sorted(order) == list(range(len(lengths)))
        # launch order: the sequences' CTAs in the sorted order, a head's tiles together
        firsts = [b for i, (b, t, h) in enumerate(live) if i == 0 or live[i - 1][0] != b]
        assert firsts == [b for b in order if lengths[b]]


@pytest.mark.parametrize("causal", [False, True])
def test_the_order_is_heaviest_first_ties_in_the_callers_order(causal):
    rng = random.Random(7)
    for batch in (1, 2, 3, 31, 32, 33, 100, 257):
        lq = [rng.choice([0, 1, 128, 129, 700, 4000]) for _ in range(batch)]
        lk = [rng.choice([0, 5, 128, 3000]) for _ in range(batch)]
        cu = lambda ls: [sum(ls[:i]) for i in range(len(ls) + 1)]  # noqa: E731
        q, k = (cu(lq), None, sum(lq)), (cu(lk), None, sum(lk))
        order = lpt_order(batch, q, k, 128, 128, causal)
        costs = [cost(b, q, k, 128, 128, causal) for b in range(batch)]
        assert order == sorted(range(batch), key=lambda b: (-costs[b], b))


def test_causal_cost_counts_the_key_tiles_each_query_tile_sees():
    for tq in range(0, 9):
        for tk in range(0, 9):
            seen = sum(min(tk, max(0, i + 1 + tk - tq)) for i in range(tq))
            lq, lk = ([0, tq * 128], None, tq * 128), ([0, tk * 128], None, tk * 128)
            assert cost(0, lq, lk, 128, 128, True) == seen + tq


def test_lying_metadata_stays_in_bounds():
    """Decreasing, negative and past-the-total offsets, seqused past the rows: every CTA's
    sequence, head and rows lie inside the tensors (tiles may be missed: wrong numbers)."""
    rng = random.Random(3)
    for _ in range(20):
        batch, heads, total = rng.randint(1, 40), rng.randint(1, 3), rng.randint(0, 3000)
        cu = [rng.randint(-500, total + 500) for _ in range(batch + 1)]
        used = [rng.randint(-100, 5000) for _ in range(batch)] if rng.random() < 0.5 else None
        lengths = [total] + [0] * (batch - 1)  # the packed rows: total_q = total
        for lpt in (False, True):
            items, order, lq = walk(lengths, lengths, heads, 128, 128, True, lpt, used=used, cu_q=cu)
            if lpt:
                assert sorted(order) == list(range(batch))
            for b, t, h in items:
                assert -1 <= b < batch and 0 <= h < heads
                if b >= 0:
                    offset, length = sequence(b, *lq)
                    assert 0 <= t < ceil_div(length, 128) and offset + length <= total


# ---------------------------------------------------------------- the backward
def key_tile_of_launch(t, n_tiles, causal, deterministic):
    """bwd_order.key_tile_of_launch."""
    return n_tiles - 1 - t if causal and deterministic else t


def bwd_walk(lengths_q, lengths_k, heads_kv, tile_m, tile_n, causal, deterministic, lpt, used_k=None, cu_k=None):
    """TileWalk.cta_work_varlen: every CTA's (sequence or -1, KV head, key tile) in launch
    order (x fastest, then y), and the order walked."""
    cu_q = [sum(lengths_q[:i]) for i in range(len(lengths_q) + 1)]
    cu_k = cu_k or [sum(lengths_k[:i]) for i in range(len(lengths_k) + 1)]
    batches = len(cu_k) - 1
    lq, lk = (cu_q, None, sum(lengths_q)), (cu_k, used_k, sum(lengths_k))
    order = lpt_order(batches, lq, lk, tile_m, tile_n, causal, keys_outer=True) if lpt else None
    grid_x = ceil_div(sum(lengths_k), tile_n) + batches
    items = []
    for y in range(heads_kv):
        for x in range(grid_x):
            found, tile, head = cta_item(x, y, grid_x, lk, batches, heads_kv, tile_n, order)
            n_tiles = ceil_div(sequence(max(found, 0), *lk)[1], tile_n)
            items.append((found, head, max(key_tile_of_launch(tile, n_tiles, causal, deterministic), 0)))
    return items, order, lk


BWD_MIXES = [  # (query lengths, key lengths, KV heads)
    ([256] * 63 + [16384], [256] * 63 + [16384], 4),  # the long sequence last
    ([1, 0, 130, 257, 64, 0, 0], [1, 5, 130, 300, 1000, 0, 3], 3),  # one-token, empty, sq != sk
    ([129, 40], [20, 511], 1),  # causal rows that see no key (sq > sk)
    ([0, 0, 0], [0, 0, 0], 2),  # nothing to compute
    *[([random.Random(s).randint(0, 900) for _ in range(70)], [random.Random(s + 9).randint(0, 900) for _ in range(70)],
       2) for s in range(3)],  # more than 2 chunks of 32
]


@pytest.mark.parametrize("causal, deterministic", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("mix", BWD_MIXES, ids=lambda m: f"{len(m[0])}seqs_h{m[2]}")
def test_backward_takes_every_key_tile_once_in_the_plain_orders_order_within_a_sequence(mix, causal, deterministic):
    lq, lk, heads = mix
    tile_m, tile_n = 64, 128
    walks = {}
    for lpt in (False, True):
        items, order, _ = bwd_walk(lq, lk, heads, tile_m, tile_n, causal, deterministic, lpt)
        live = [item for item in items if item[0] >= 0]
        want = {(b, h, n) for b, length in enumerate(lk) for n in range(ceil_div(length, tile_n)) for h in range(heads)}
        assert len(live) == len(set(live)) and set(live) == want
        # each (sequence, KV head)'s key tiles in launch order: the dense grid's (key_tile_of_launch)
        per_head = {}
        for b, h, n in live:
            per_head.setdefault((b, h), []).append(n)
        for (b, h), tiles in per_head.items():
            count = ceil_div(lk[b], tile_n)
            assert tiles == [key_tile_of_launch(t, count, causal, deterministic) for t in range(count)]
        walks[lpt] = per_head
        if lpt:
            assert sorted(order) == list(range(len(lk)))
            # a sequence's CTAs (every KV head's) consecutive, the sequences in the sorted order
            firsts = [b for i, (b, h, n) in enumerate(live) if i == 0 or live[i - 1][0] != b]
            assert firsts == [b for b in order if lk[b]]
    assert walks[False] == walks[True]


@pytest.mark.parametrize("causal", [False, True])
def test_backward_turns_wait_only_for_ctas_launched_before(causal):
    """Deterministic: in either order, every CTA's turn at a (sequence, query head, run,
    chain) word counts only CTAs launched before it (bwd_order.dq_turn, run on Python ints),
    and the turns there are 0, 1, ...: so no order deadlocks however few CTAs are resident."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to import the kernel source")
    from fa4_aot.src.common import bwd_order as bwd

    tile_m, tile_n, run_tiles, chains, group = 64, 128, 2, 1 if causal else 2, 2
    lq, lk = [700, 3, 0, 191, 1300, 64], [700, 3, 0, 193, 1000, 513]
    for lpt in (False, True):
        items, _, lk_meta = bwd_walk(lq, lk, 2, tile_m, tile_n, causal, True, lpt)
        words = {}  # (sequence, query head, run, chain) -> [(turn, launch index)]
        for launch, (b, h, n) in enumerate(items):
            if b < 0:
                continue
            m_blocks, n_blocks = ceil_div(lq[b], tile_m), ceil_div(lk[b], tile_n)
            first = bwd.first_query_tile(n, lq[b], lk[b], tile_m, tile_n, causal)
            for head_q in range(h * group, (h + 1) * group):
                for run in sorted({m // run_tiles for m in range(first, m_blocks)}):
                    turn = bwd.dq_turn(n, run, run_tiles, m_blocks, n_blocks, lq[b], lk[b], tile_m, tile_n, causal,
                                       chains)
                    words.setdefault((b, head_q, run, bwd.dq_chain(n, chains)), []).append((turn, launch))
        for taken in words.values():
            assert sorted(turn for turn, _ in taken) == list(range(len(taken)))
            assert [turn for turn, _ in sorted(taken, key=lambda t: t[1])] == list(range(len(taken)))


def test_backward_cost_counts_the_query_tiles_each_key_tile_visits():
    """The backward's causal cost: the key tiles' visits (bwd_order.first_query_tile on) plus
    the key tiles, exact for aligned lengths, at most one visit short per key tile else."""
    for tile_m, tile_n in ((64, 128), (80, 128), (64, 96), (64, 80)):
        for len_q in range(0, 700, 37):
            for len_k in range(0, 700, 41):
                tq, tk = ceil_div(len_q, tile_m), ceil_div(len_k, tile_n)
                visits = sum(max(tq - max(n * tile_n - (len_k - len_q), 0) // tile_m, 0) for n in range(tk))
                lq, lk = ([0, len_q], None, len_q), ([0, len_k], None, len_k)
                got = cost(0, lq, lk, tile_m, tile_n, True, keys_outer=True) - tk
                assert visits - tk <= got <= visits, (tile_m, tile_n, len_q, len_k)
                if len_q % tile_m == 0 and len_k % tile_n == 0 and tile_n % tile_m == 0:
                    assert got == visits
                assert cost(0, lq, lk, tile_m, tile_n, False, keys_outer=True) == tq * tk + tk


def test_backward_lying_metadata_stays_in_bounds():
    """Lying key metadata: every CTA's sequence, KV head and key tile lie inside the
    tensors in both orders (tiles may be missed: wrong numbers)."""
    rng = random.Random(11)
    for _ in range(20):
        batch, heads, total = rng.randint(1, 40), rng.randint(1, 3), rng.randint(0, 3000)
        cu = [rng.randint(-500, total + 500) for _ in range(batch + 1)]
        used = [rng.randint(-100, 5000) for _ in range(batch)] if rng.random() < 0.5 else None
        lengths = [total] + [0] * (batch - 1)
        for lpt in (False, True):
            items, order, lk = bwd_walk([rng.randint(0, 300) for _ in range(batch)], lengths, heads, 64, 128, True,
                                        True, lpt, used_k=used, cu_k=cu)
            if lpt:
                assert sorted(order) == list(range(batch))
            for b, h, n in items:
                assert -1 <= b < batch and 0 <= h < heads
                if b >= 0:
                    offset, length = sequence(b, *lk)
                    assert 0 <= n < ceil_div(length, 128) and offset + length <= total


# ------------------------------------------------- the backward's waits on lying metadata
JUNK = 0x80808080 - (1 << 32)  # a word as a poisoned workspace holds it: negative, FIRST_STORED clear
FIRST_STORED = 1 << 24  # dq_writer.FIRST_STORED


def bwd_cta_programs(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, turn_tiles, state):
    """The main grid's CTAs in launch order, each a generator mirroring the dQ writer's waits
    (dq_writer.DqWriter.add_item): it yields a test that is true once the CTA may go on,
    and counts its turns (deterministic) or takes its tickets a step ahead and marks its
    first stores (not deterministic, first_write) in ``state``; at its end, its dq_done
    counts (a CTA of a sequence) and one more CTA ended (count_ended)."""
    from fa4_aot.src.common import bwd_order as bwd

    batches = len(lk[0]) - 1
    order = lpt_order(batches, lq, lk, tile_m, tile_n, causal, keys_outer=True) if lpt else None
    grid_x = ceil_div(lk[2], tile_n) + batches
    chains = 2 if deterministic and not causal else 1
    words = state["words"]

    def program(b, head_kv, n_block):
        if b >= 0:
            (q_off, len_q), len_k = sequence(b, *lq), sequence(b, *lk)[1]
            m_blocks, n_tiles = ceil_div(len_q, tile_m), ceil_div(len_k, tile_n)
            ws_first, chain = q_off // tile_m + b, bwd.dq_chain(n_block, chains)
            m_first = bwd.first_query_tile(n_block, len_q, len_k, tile_m, tile_n, causal)
            span = max(m_blocks - m_first, 0)
            if not causal and not deterministic:  # rotate: each CTA's own start, wrapping
                m_first = (n_block * ceil_div(m_blocks, 2) // n_tiles) * 2
            at = [(head_kv * group + s // span, (m_first + s % span) % max(m_blocks, 1)) for s in range(group * span)]
            tickets = {}

            def take(s):
                word = (at[s][0], ws_first + at[s][1], 0)
                tickets[s] = words.get(word, JUNK)
                words[word] = tickets[s] + 1
            if not deterministic and at:
                take(0)
            for s, (head_q, m) in enumerate(at):
                if deterministic:
                    run = m // turn_tiles
                    word = (head_q, ws_first + run, chain)
                    if m % turn_tiles == 0 or s % span == 0:
                        turn = bwd.dq_turn(n_block, run, turn_tiles, m_blocks, n_tiles, len_q, len_k, tile_m, tile_n,
                                           causal, chains)
                        yield lambda word=word, turn=turn: words.get(word, JUNK) >= turn  # `<` waits: the varlen's
                    if m % turn_tiles == turn_tiles - 1 or m == m_blocks - 1:
                        words[word] = words.get(word, JUNK) + 1
                else:
                    if s + 1 < len(at):
                        take(s + 1)
                    word = (head_q, ws_first + m, 0)
                    if tickets[s] != 0 and tickets[s] & FIRST_STORED == 0:
                        yield lambda word=word: words.get(word, JUNK) & FIRST_STORED != 0
                    if tickets[s] == 0:
                        words[word] += FIRST_STORED
            for g in range(group):
                key = (b, head_kv * group + g)
                state["done"][key] = state["done"].get(key, JUNK) + 1
        state["ended"] += 1

    return [program(*(lambda f, t, h: (f, h, key_tile_of_launch(t, ceil_div(sequence(max(f, 0), *lk)[1], tile_n),
                                                                 causal, deterministic)))(
                *cta_item(x, y, grid_x, lk, batches, heads_kv, tile_n, order)))
            for y in range(heads_kv) for x in range(grid_x)]


def bwd_waits_end(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, fixed, resident=3,
                  turn_tiles=2):
    """Whether every wait of a varlen backward ends: the preprocess clears the semaphore
    words (``fixed``: every workspace tile's, preprocess_varlen; else those of the query
    tiles its blocks walk, as before) and the walked sequences' dq_done; the main grid's
    CTAs run ``resident`` at a time in launch order (a CTA is placed once every earlier one
    is, as blocks are dispatched); then each postprocess block waits for its head's key
    tiles, or (``fixed``) for every main CTA to have ended (_wait_for_keys)."""
    batches, heads_q = len(lq[0]) - 1, heads_kv * group
    grid_q, chains = ceil_div(lq[2], tile_m) + batches, 2 if deterministic and not causal else 1
    state = {"words": {}, "done": {}, "ended": 0}
    blocks = [packed_tile(x, lq, batches, tile_m) for x in range(grid_q)]
    for x, (b, t) in enumerate(blocks):
        tiles = [x] if fixed else [sequence(b, *lq)[0] // tile_m + b + t] if b >= 0 else []
        for h in range(heads_q):
            state["words"].update({(h, w, c): 0 for w in tiles for c in range(chains)})
            if b >= 0 and t == 0:
                state["done"][(b, h)] = 0
    ctas = bwd_cta_programs(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, turn_tiles, state)
    waiting, live, placed = [], [], 0
    while placed < len(ctas) or live:
        while placed < len(ctas) and len(live) < resident:
            live.append([ctas[placed], lambda: True])
            placed += 1
        moved = False
        for cta in list(live):
            while cta[1]():
                moved = True
                try:
                    cta[1] = next(cta[0])
                except StopIteration:
                    live.remove(cta)
                    break
        if not moved:
            return False  # every resident CTA waits
    for b, t in blocks:
        if b >= 0:
            need = ceil_div(sequence(b, *lk)[1], tile_n)
            waiting += [h for h in range(heads_q) if state["done"].get((b, h), JUNK) < need]
    return not waiting or (fixed and state["ended"] == len(ctas))


def lying_backward_cases():
    """(query metadata, key metadata) as (cu_seqlens, seqused or None, total): each makes the
    clamped sequences overlap so that their tiles pass a grid's bound."""
    honest = lambda lengths: ([sum(lengths[:i]) for i in range(len(lengths) + 1)], None, sum(lengths))  # noqa: E731
    flip = lambda n, total: ([0, total] * (n // 2) + [0], None, total)  # noqa: E731  decreasing: [0, T, 0, T, ..., 0]
    return [
        (honest([30] * 8), flip(8, 512)),  # key tiles past the main grid
        (honest([30] * 8), (honest([64] * 8)[0], [512] * 8, 512)),  # seqused_k = total_k: the same
        # query tiles past the row grid: words no walked block clears (the turns' words too:
        # a run's word is tile ws_first + run, past the last walked sequence's tiles)
        (flip(16, 256), honest([64] * 16)),
        (flip(16, 300), flip(16, 700)),  # both
    ]


@pytest.mark.parametrize("causal, deterministic", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("lpt", [False, True])
def test_backward_waits_end_on_lying_metadata(lpt, causal, deterministic):
    """Lying metadata that overlaps sequences past the grids: every turn, ticket and
    postprocess wait ends (wrong numbers, never a hang), in both orders, while the
    mechanism before it (words cleared by the walked query tiles, the postprocess waiting
    for its count alone) hangs on each of these cases; random lying metadata too."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to import the kernel source")
    tile_m, tile_n, heads_kv, group = 64, 128, 2, 2
    for lq, lk in lying_backward_cases():
        assert bwd_waits_end(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, fixed=True)
        assert not bwd_waits_end(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, fixed=False)
    rng = random.Random(5)
    for _ in range(12):
        batch, total_q, total_k = rng.randint(1, 12), rng.randint(0, 600), rng.randint(0, 900)
        lq = ([rng.randint(-50, total_q + 50) for _ in range(batch + 1)],
              [rng.randint(-9, 700) for _ in range(batch)] if rng.random() < 0.5 else None, total_q)
        lk = ([rng.randint(-50, total_k + 50) for _ in range(batch + 1)],
              [rng.randint(-9, 1000) for _ in range(batch)] if rng.random() < 0.5 else None, total_k)
        assert bwd_waits_end(lq, lk, heads_kv, group, tile_m, tile_n, causal, deterministic, lpt, fixed=True)


def test_backward_waits_end_on_honest_metadata_by_their_counts():
    """Honest lengths: every postprocess block's count is reached by the walk itself (the
    grid's end is only a fallback), and nothing is left to the cleared words' junk."""
    pytest.importorskip("cutlass", reason="the CuTe DSL is needed to import the kernel source")
    for lengths_q, lengths_k, _ in BWD_MIXES[1:4]:  # the small mixes: each CTA is stepped through
        lq = ([sum(lengths_q[:i]) for i in range(len(lengths_q) + 1)], None, sum(lengths_q))
        lk = ([sum(lengths_k[:i]) for i in range(len(lengths_k) + 1)], None, sum(lengths_k))
        for lpt, causal, det in itertools.product((False, True), repeat=3):
            assert bwd_waits_end(lq, lk, 2, 2, 64, 128, causal, det, lpt, fixed=False)


def test_the_mirrors_width_is_the_built_sorts(built):
    from fa4_aot.launch.manifest import Manifest

    rows = Manifest(built[0]).rows
    assert {rows[n]["limits"]["lpt_max_batch"] for n in rows if ".varlen" in n} == {MAX_BATCH}
