"""FP8 (e4m3) tiles widened to fp16 in shared memory, for wgmmas that read 16-bit operands
(docs/design.md, "Decode": FP8 cache).

e4m3 values are exact in fp16, so the widening loses nothing; the cache's dequantization
scales are applied to the scores and to O, not here. ``cvt.rn.f16x2.e4m3x2`` (sm_89 and
later) converts a pair in one instruction; sm_90 has none to bf16 (a bit-placement route
to bf16, five instructions a pair, measured slower: docs/design.md).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def widen_pair(word, high: bool, *, loc=None, ip=None) -> Int32:
    """Two of the four e4m3 values in ``word`` (its bytes 0, 1, or 2, 3 where ``high``) as
    two fp16 in one register (the first in the low half)."""
    half = "h" if high else "l"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.rn.f16x2.e4m3x2 $0, {half}; }}", "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@cute.jit
def widen_tile(tidx, src: cute.Tensor, dst: cute.Tensor, threads: cutlass.Constexpr[int]):
    """dst (rows, cols) of fp16 = src (rows, cols) of e4m3, both swizzled shared
    memory; each of ``threads`` threads takes 16 columns of a row at a time (one 16-byte
    load, two 16-byte stores)."""
    rows, cols = cute.size(src, mode=[0]), cute.size(src, mode=[1])
    per_row = cols // 16
    for i in cutlass.range_constexpr(rows * per_row // threads):
        chunk = i * threads + tidx
        r, part = chunk // per_row, chunk % per_row
        raw = cute.make_rmem_tensor((16,), src.element_type)
        cute.autovec_copy(cute.local_tile(src[r, None], (16,), (part,)), raw)
        words = cute.recast_tensor(raw, Int32)
        wide = cute.make_rmem_tensor((8,), Int32)
        for j in cutlass.range_constexpr(4):
            wide[2 * j] = widen_pair(words[j], False)
            wide[2 * j + 1] = widen_pair(words[j], True)
        halves = cute.recast_tensor(wide, dst.element_type)
        for k in cutlass.range_constexpr(2):
            cute.autovec_copy(cute.local_tile(halves, (8,), (k,)), cute.local_tile(dst[r, None], (8,), (2 * part + k,)))
