"""The named barriers (bar.sync ids) of the sm_90a backward's main kernel, in one table so
that the roles' ids cannot overlap (id 0 is the CTA-wide barrier of the pipelines' setup)."""

EPILOGUE_BARRIER = 1  # both consumer warpgroups, before dK and dV are staged
DS_BARRIER = 2  # both consumer warpgroups: dS (and P) written before the GEMMs read them
# (staggered: 2 + w, warpgroup w alone, before it tells the other one through READY)
# Per dQ staging buffer b (at most four; which part of a step takes which: bwd_dq_handoff):
DQ_FULL_BARRIER = 4  # .. 7: warpgroup w has staged its dQ tile in buffer b for the writer
DQ_EMPTY_BARRIER = 8  # .. 11: the writer's reduce has read buffer b
READY_BARRIER = 12  # .. 15, 2 w + step parity (staggered): warpgroup w's dS of that step is in
# shared memory and its dQ GEMM of the step before is done
