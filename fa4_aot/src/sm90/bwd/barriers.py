"""The named barriers (bar.sync ids) of the sm_90a backward's main kernel, in one table so
that the roles' ids cannot overlap (id 0 is the CTA-wide barrier of the pipelines' setup)."""

EPILOGUE_BARRIER = 1  # both consumer warpgroups, before dK and dV are staged
DS_BARRIER = 2  # both consumer warpgroups: dS (and P) written before the GEMMs read them
# (staggered: 2 + w, warpgroup w alone, before it tells the other one through READY)
# Per dQ staging buffer b (which part of a step takes which: dq_writer.DqBuffers), FULL: warpgroup
# w has staged its dQ tile in buffer b for the writer; EMPTY: the writer's reduce has read
# buffer b. Ids 4 .. 11 for up to four buffers, 4 .. 15 for up to six (see dq_barriers).
DQ_FULL_BARRIER = 4
READY_BARRIER = 12  # .. 15, 2 w + step parity (staggered): warpgroup w's dS of that step is in
# shared memory and its dQ GEMM of the step before is done


def dq_barriers(slots: int, staggered: bool) -> tuple[int, int]:
    """The first FULL and first EMPTY id for ``slots`` staging buffers: FULL 4 .., EMPTY
    8 .. (up to four buffers) or 4 + slots .. (five or six: READY's ids, which only the
    staggered loop uses, are then taken)."""
    empty = DQ_FULL_BARRIER + max(4, slots)
    assert empty + slots <= (READY_BARRIER if staggered else 16), "named barrier ids overlap"
    return DQ_FULL_BARRIER, empty
