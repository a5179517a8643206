"""FP8 (e4m3) tiles widened to 16-bit floats in shared memory, for wgmmas that read 16-bit
operands (docs/design.md, "Decode": FP8 cache).

e4m3 values are exact in fp16 and in bf16, so the widening loses nothing; the cache's
dequantization scales are applied to the scores and to O, not here.

- fp16: ``cvt.rn.f16x2.e4m3x2`` (sm_89 and later), one instruction per pair: what the
  decode kernel uses.
- bf16: sm_90 has no e4m3 -> bf16 conversion. Placed in a bf16's high bits (sign, then
  exponent and mantissa shifted right by 4), an e4m3 byte reads as its value times 2^-120
  (bias 7 against 127), subnormals included; one bf16x2 multiply by 2^120 then gives the
  value exactly (a power of two, every result a normal bf16). Five integer and float
  instructions a pair: measured slower than the fp16 route (docs/design.md).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# prmt selectors: bytes (0, e0, 0, e1) and (0, e2, 0, e3) of a word of four e4m3 values
_SPREAD = (0x1404, 0x3424)
_BF16_PAIR_2_POW_120 = 0x7B807B80


@dsl_user_op
def widen_pair(word, dtype, high: bool, *, loc=None, ip=None) -> Int32:
    """Two of the four e4m3 values in ``word`` (its bytes 0, 1, or 2, 3 where ``high``) as
    two 16-bit floats of ``dtype`` in one register (the first in the low half)."""
    if dtype is cutlass.Float16:
        half = "h" if high else "l"
        asm = f"{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.rn.f16x2.e4m3x2 $0, {half}; }}"
    else:
        asm = ("{ .reg .b32 z, t, u, m; mov.b32 z, 0; "
               f"prmt.b32 t, $1, z, {_SPREAD[high]:#x}; "
               "shr.b32 u, t, 4; and.b32 u, u, 0x07F007F0; and.b32 t, t, 0x80008000; or.b32 u, u, t; "
               f"mov.b32 m, {_BF16_PAIR_2_POW_120:#x}; mul.rn.bf16x2 $0, u, m; }}")
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(word).ir_value(loc=loc, ip=ip)], asm, "=r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


@cute.jit
def widen_tile(tidx, src: cute.Tensor, dst: cute.Tensor, threads: cutlass.Constexpr[int]):
    """dst (rows, cols) of 16-bit floats = src (rows, cols) of e4m3, both swizzled shared
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
            wide[2 * j] = widen_pair(words[j], dst.element_type, False)
            wide[2 * j + 1] = widen_pair(words[j], dst.element_type, True)
        halves = cute.recast_tensor(wide, dst.element_type)
        for k in cutlass.range_constexpr(2):
            cute.autovec_copy(cute.local_tile(halves, (8,), (k,)), cute.local_tile(dst[r, None], (8,), (2 * part + k,)))
