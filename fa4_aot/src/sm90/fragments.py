"""Register-fragment views shared by the sm90 kernels.

A Hopper wgmma accumulator fragment has layout ((2, 2, V), MMA_M, MMA_N): per thread, two
adjacent columns, two rows eight apart, and V column groups eight wide. Softmax wants the
same registers indexed as (rows, cols); the PV GEMM wants them as the A operand of an
RS-wgmma, ((2, 2, 2), MMA_M, (V / 2, MMA_N)). Both are views: no register moves.
"""

import cutlass.cute as cute


def acc_as_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator as (rows, cols) of this thread's elements."""
    flat = cute.make_layout(acc.layout.shape)  # compact column-major over the same shape
    rows = cute.make_layout(
        (flat.shape[0][1], flat.shape[1]), stride=(flat.stride[0][1], flat.stride[1])
    )
    cols = cute.make_layout(
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
        stride=(flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    view = cute.make_layout((rows.shape, cols.shape), stride=(rows.stride, cols.stride))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View a 16-bit-destined accumulator as the A fragment of the next RS-wgmma.

    Each k-block of 16 columns takes two of the accumulator's eight-wide column groups.
    """
    v = acc.layout.shape[0][2]
    assert v % 2 == 0, "the P tile width must be a multiple of 16"
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    shape = (
        (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
        split.shape[1],
        (split.shape[0][2][1], split.shape[2]),
    )
    stride = (
        (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
        split.stride[1],
        (split.stride[0][2][1], split.stride[2]),
    )
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly staged) shared-memory tensor."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))
