"""Pieces the sm90 forward and backward kernels share: shared-memory layouts, warpgroup
GEMM issue, and staging a register tile through shared memory to a TMA store."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.experimental.primitives import cp_async_bulk_shared_cluster_global
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

WARPGROUP = 128
# the variants' dtype names (fa4_aot.variants.DTYPES) as the DSL's types
DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def smem_layout(dtype, rows: int, cols: int, stages=None, col_parts: int = 1):
    """Row-major (rows, cols[, stages]) tile, swizzled for wgmma and TMA (cols contiguous).

    ``col_parts``: the columns are also used as that many equal slices (one per warpgroup,
    as wgmma operands), so the swizzle atom must divide ``cols // col_parts``: head_dim 192
    halves (96 columns) take the 64-byte swizzle instead of the 128-byte one.
    """
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols // col_parts), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def sdhb(t: cute.Tensor) -> cute.Tensor:
    """A (b, s, h, d) tensor viewed as (s, d, h, b), the order TMA and the MMAs work in:
    rows, then the contiguous head dim."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def bulk_copy_g2s(smem_dst, gmem_src, barrier, size: int):
    """Copy ``size`` bytes (a multiple of 16, both ends 16-byte aligned) from global to
    shared memory without a tensor map, completing on ``barrier``'s transaction count.
    One thread issues it."""
    cp_async_bulk_shared_cluster_global(smem_dst, gmem_src, barrier, size)


def smem_buffer(layout, dtype):
    """A shared-storage field holding ``layout``'s elements, 1024-byte aligned (swizzle atoms)."""
    return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]


def tma_pipeline(barriers, stages: int, consumer_warpgroups: int, tx_count: int):
    """An mbarrier pipeline filled by TMA: one producer thread arms each stage with
    ``tx_count`` bytes; every warp of the consumer warpgroups releases it."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(), num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warpgroups * WARPGROUP // 32),
        tx_count=tx_count, defer_sync=True,
    )


def tiled_mma(dtype, a_major, b_major, atoms_mnk, tile_n: int, a_in_registers: bool = False):
    mode = {"K": warpgroup.OperandMajorMode.K, "MN": warpgroup.OperandMajorMode.MN}
    return sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, mode[a_major], mode[b_major], cutlass.Float32,
        atom_layout_mnk=atoms_mnk, tiler_mn=(64, tile_n),
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM,
    )


@cute.jit
def wgmma(tiled, acc, frag_a, frag_b, accumulate: cutlass.Constexpr[bool], wait: cutlass.Constexpr[bool]):
    """Issue one warpgroup GEMM over every k-block as a commit group; wait only if ``wait``."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for kb in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, kb], frag_b[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait):
        warpgroup.wait_group(0)


@dsl_user_op
def _round_pair(lo, hi, dtype, *, loc=None, ip=None) -> cutlass.Int32:
    """Two fp32 values rounded to nearest into one register of two 16-bit floats (lo in
    the low half): one cvt instruction."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [cutlass.Float32(hi).ir_value(loc=loc, ip=ip), cutlass.Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@cute.jit
def convert_into(src: cute.Tensor, dst: cute.Tensor):
    """dst (16-bit floats, compact registers) = src (fp32, same shape), a register pair at a time.

    ``dst.store(src.load().to(dtype))`` converts bf16 one element at a time when a row
    holds 80 or 112 columns (the forward's P at head_dim 256 and 192), then packs the
    halves with extra moves; ptxas then fences every k-block of the P V wgmma that reads
    them (a WARPGROUP.ARRIVE before each, C7519/C7520), serializing it.
    """
    words = cute.recast_tensor(dst, cutlass.Int32)
    for j in cutlass.range_constexpr(cute.size(words)):
        words[j] = _round_pair(src[2 * j], src[2 * j + 1], dst.element_type)


def select_f32(cond, if_true, if_false) -> cutlass.Float32:
    """A float select without an `if`: an `if` per element makes the DSL carry every value
    written so far through each branch (quadratic code), and gives ptxas branches."""
    return cutlass.Float32(cutlass.select_(cond, if_true, if_false))


@cute.jit
def wait_after(values, barrier_id, threads: int):
    """``wgmma.wait_group 0``, kept after the instructions that compute ``values``.

    ptxas hoists a wgmma wait to the top of the code between it and the preceding wait
    (measured: to before the first exponential of the forward's softmax, at every head
    dim), which serializes the softmax behind the P V GEMM it is meant to overlap. A
    named-barrier arrive whose thread count depends on ``values`` (always ``threads`` at run
    time) cannot move above them, and ptxas does not move the wait above the arrive.
    Every one of ``threads`` threads calls this with its own barrier (arrive-only, so the
    barrier completes with no waiter).
    """
    total = values[0]
    for i in cutlass.range_constexpr(1, len(values)):
        total = total + values[i]
    extra = cutlass.Int32(cutlass.select_(total < cutlass.Float32(0.0), 32, 0))  # sums: never < 0
    cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=threads + extra)
    warpgroup.wait_group(0)


def stage(tidx, acc, dtype, tiled, smem):
    """acc (fp32 fragment of ``tiled``) -> dtype in ``smem`` (this thread's part; stmatrix:
    one instruction per four 8x8 blocks of the fragment)."""
    staged = cute.make_rmem_tensor_like(acc, dtype)
    staged.store(acc.load().to(dtype))
    atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
    copy = cute.make_tiled_copy_C(atom, tiled)
    thr = copy.get_slice(tidx)
    cute.copy(copy, thr.retile(staged), thr.partition_D(smem))


@cute.jit
def stage_and_store(tidx, acc, dtype, tiled, smem, tma_atom, gmem_tile, barrier_id: int, threads: int,
                    wait_read: cutlass.Constexpr[bool] = True):
    """acc (fp32 fragment of ``tiled``) -> dtype in ``smem`` -> one TMA store to ``gmem_tile``.

    Every one of ``threads`` threads calls this; warp 0 issues the store (the TMA copy elects
    one lane itself, so a whole warp must reach it) and, if ``wait_read``, waits until shared
    memory has been read, so the buffer may be reused after a later barrier.
    """
    stage(tidx, acc, dtype, tiled, smem)
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if cute.arch.make_warp_uniform(tidx // 32) == 0:
        s_part, g_part = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), cute.group_modes(gmem_tile, 0, 2)
        )
        cute.copy(tma_atom, s_part, g_part)
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(wait_read):
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def sum_halves(acc_s, sS, wg, tidx, barriers):
    """Head split (two warpgroups owning halves of the head dim): S's two partial sums
    added in both, this warpgroup's written to ``sS`` (warpgroup, fragment element,
    thread), the other's read back (the same element of the same thread: both GEMMs have
    one layout; IEEE addition commutes, so both hold the same S). ``barriers``: (both
    have read the last tile's halves, both have written this tile's), 256 threads each."""
    read, written = barriers
    cute.arch.barrier(barrier_id=read, number_of_threads=2 * WARPGROUP)
    for e in cutlass.range_constexpr(cute.size(acc_s)):
        sS[wg, e, tidx] = acc_s[e]
    cute.arch.barrier(barrier_id=written, number_of_threads=2 * WARPGROUP)
    for e in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[e] = acc_s[e] + sS[1 - wg, e, tidx]
