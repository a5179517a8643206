"""Row stores of packed (varlen) outputs (sm_90a): the varlen forward's O and the varlen
backward's dK and dV. A tile's last rows may belong to the next packed sequence, which a TMA
store's box would overwrite, so the consumers stage the tile in shared memory as for the TMA
store and write only the sequence's rows and the tensor's columns, 16 bytes per access,
every consumer thread taking every ``threads``-th chunk (docs/design.md, "Variable length",
"Head dims")."""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int64


class PackedRows(NamedTuple):
    """A packed (total, h, d) output: its address, row and head strides (elements) and d
    (columns: at most the tile's); ``at`` adds the sequence's first row, its rows and the
    head a CTA writes."""

    ptr: object
    row_stride: object
    head_stride: object
    columns: object
    offset: object = None
    length: object = None
    head: object = None

    def at(self, offset, length, head) -> "PackedRows":
        return self._replace(offset=offset, length=length, head=head)


@cute.jit
def store_rows(tidx, threads: cutlass.Constexpr[int], s_tile, rows: PackedRows, first_row):
    """Rows [first_row, first_row + tile rows) of the sequence, staged in ``s_tile`` (tile
    rows, head_dim), written where they are the sequence's (row < rows.length), their first
    rows.columns only; ``tidx`` in [0, threads)."""
    dtype = s_tile.element_type
    tile_rows, head_dim = cute.size(s_tile, mode=[0]), cute.size(s_tile, mode=[1])
    vec = 16 // (dtype.width // 8)  # elements per 16-byte access
    per_row = head_dim // vec
    assert tile_rows * per_row % threads == 0
    for i in cutlass.range_constexpr(tile_rows * per_row // threads):
        chunk = i * threads + tidx
        row, part = chunk // per_row, chunk % per_row
        if (first_row + row < rows.length) & (part * vec < rows.columns):
            values = cute.make_rmem_tensor((vec,), dtype)
            cute.autovec_copy(cute.local_tile(s_tile[row, None], (vec,), (part,)), values)
            at = (Int64(rows.offset + first_row + row) * rows.row_stride + Int64(rows.head) * rows.head_stride
                  + part * vec) * (dtype.width // 8)
            dst = cute.make_ptr(dtype, rows.ptr.toint() + at, cute.AddressSpace.gmem, assumed_align=16)
            cute.autovec_copy(values, cute.make_tensor(dst, cute.make_layout(vec)))
