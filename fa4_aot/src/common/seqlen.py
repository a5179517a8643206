"""Where a batch entry's rows are in packed (variable-length) tensors, and how many there
are: read once per CTA from the caller's device-side metadata.

``cu_seqlens`` (batch + 1 int32: the first row of each entry, then the total) and, where
given, ``seqused`` (batch int32: rows actually used, fewer than the packed ones) say
where a sequence lies. The host cannot check them without a sync, so a sequence's rows
are clamped to the packed tensor (offset in [0, total], length in [0, total - offset]):
a decreasing or lying cu_seqlens gives wrong numbers at worst, and every row a kernel
touches lies inside the tensor (docs/design.md, "Variable length").
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class Sequence(NamedTuple):
    offset: object  # first packed row of the entry (Int32, in [0, total])
    length: object  # rows (Int32, in [0, total - offset])


def sequence(batch, cu_seqlens: cute.Tensor, seqused: cute.Tensor, use_seqused, total) -> Sequence:
    """The rows of entry ``batch`` (cu_seqlens: (b + 1,), seqused: (b,), read only where
    ``use_seqused`` is not 0) in a packed tensor of ``total`` rows."""
    start = cu_seqlens[batch]
    # seqused is read either way (the run time passes cu_seqlens for it when not given:
    # at least batch entries, so the read is in bounds)
    length = cutlass.select_(use_seqused != 0, seqused[batch], cu_seqlens[batch + 1] - start)
    offset = cutlass.min(cutlass.max(start, Int32(0)), total)
    length = cutlass.min(cutlass.max(length, Int32(0)), total - offset)
    return Sequence(offset, length)


@cute.jit
def packed_tile(tile, cu_seqlens: cute.Tensor, seqused: cute.Tensor, use_seqused, batches, total, tile_rows: int,
                order=None, copies=1):
    """(batch, tile within the batch entry) of the ``tile``-th query tile of all entries
    in order (entry b having ceil(length_b / tile_rows) tiles), or (-1, 0) past the last
    one. Each warp scans the lengths 32 entries at a time (a warp prefix sum, then a ballot
    of the lanes at or before ``tile``), so a grid of ceil(total / tile_rows) + batches
    CTAs, which bounds the tiles of any lengths, covers every tile with at most
    ``batches`` CTAs to spare (docs/design.md, "Variable length").

    ``order`` ((batches,) int32, optional): the entries in the order order[0], order[1],
    ... (each clamped to [0, batches)) instead of the caller's; ``copies``: each entry's
    tiles counted that many times (its heads: the tile returned is then in [0, copies x
    its tiles))."""
    lane = cute.arch.lane_idx()
    found_batch, found_tile = Int32(-1), Int32(0)
    base, chunk = Int32(0), Int32(0)
    while chunk * 32 < batches and found_batch < 0:
        entry = chunk * 32 + lane
        tiles = Int32(0)
        if cutlass.const_expr(order is None):
            if entry < batches:
                tiles = cute.ceil_div(sequence(entry, cu_seqlens, seqused, use_seqused, total).length, tile_rows)
        else:
            if entry < batches:
                entry = cutlass.min(cutlass.max(order[entry], Int32(0)), batches - 1)
                tiles = cute.ceil_div(sequence(entry, cu_seqlens, seqused, use_seqused, total).length,
                                      tile_rows) * copies
        inclusive = tiles
        for offset in cutlass.range_constexpr(5):
            below = cute.arch.shuffle_sync_up(inclusive, 1 << offset)
            if lane >= (1 << offset):
                inclusive = inclusive + below
        chunk_tiles = cute.arch.shuffle_sync(inclusive, 31)
        if tile < base + chunk_tiles:
            # the entry is the first lane whose inclusive count passes the tile
            first = cute.arch.popc(cute.arch.vote_ballot_sync(base + inclusive <= tile))
            if cutlass.const_expr(order is None):
                found_batch = chunk * 32 + first
            else:
                found_batch = cute.arch.shuffle_sync(entry, first)
            found_tile = tile - base - cute.arch.shuffle_sync(inclusive - tiles, first)
        base = base + chunk_tiles
        chunk = chunk + 1
    return found_batch, found_tile


@cute.jit
def packed_tile_of_cta(x, y, grid_x, cu_seqlens: cute.Tensor, seqused: cute.Tensor, use_seqused, batches, total,
                       tile_rows: int, order: cute.Tensor, lpt, copies):
    """(batch or -1, tile within it, copy) of CTA (x, y) of a (grid_x, copies) grid over every
    entry's tiles in ``copies`` copies (heads), as ``packed_tile``. lpt 0: CTA (x, copy y)
    takes the x-th tile of the entries in the caller's order. Else the CTAs in launch order
    (x fastest, then y) take the entries in ``order`` (the heaviest-first sort's), each
    entry's copies one after another and a copy's tiles together, in the same relative
    order as lpt 0 gives them (docs/design.md, "Variable length")."""
    found, tile, copy = Int32(-1), Int32(0), y
    if lpt == 0:
        found, tile = packed_tile(x, cu_seqlens, seqused, use_seqused, batches, total, tile_rows)
    else:
        found, item = packed_tile(y * grid_x + x, cu_seqlens, seqused, use_seqused, batches, total, tile_rows,
                                  order=order, copies=copies)
        tiles = cute.ceil_div(sequence(cutlass.max(found, 0), cu_seqlens, seqused, use_seqused, total).length,
                              tile_rows)
        tiles = cutlass.max(tiles, 1)
        copy = item // tiles
        tile = item - copy * tiles
    return found, tile, copy
