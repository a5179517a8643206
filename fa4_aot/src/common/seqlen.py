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
