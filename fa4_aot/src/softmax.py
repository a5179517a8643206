"""Online softmax over wgmma accumulator rows, in the exp2 domain.

Scores arrive unscaled; ``scale_log2 = softmax_scale * log2(e)`` is folded into the single
FMA that feeds exp2, so each score costs one FMA and one MUFU.EX2. Row statistics live in
registers: each row of a 64-row warpgroup tile is spread over the four threads of a quad,
so the row max is reduced with two butterfly shuffles per tile, while the row sum stays
thread-local until ``finalize``.

Rows whose every score so far is masked keep ``row_max = -inf``; the exponent offset then
uses 0 so that exp2(-inf - offset) is 0 rather than NaN. A row that ends with no unmasked
score gives O = 0 and LSE = -inf.
"""

import math
import operator
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .layout import acc_as_rows_cols

LN2 = math.log(2.0)


# 2^f on [0, 1) by a degree-3 polynomial, p(0) = 1, fitted for least maximum relative error
# (8.6e-5: below the rounding of P to bf16 or fp16).
EXP2_POLY = (0.6951169287044434, 0.2276479730259341, 0.07706304667382112)


@dsl_user_op
def exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x on the FMA and integer pipes instead of the MUFU unit.

    floor(x) comes from one add rounded toward -inf against 1.5 * 2^23 (whose low mantissa
    bits then hold floor(x) as an integer), the fraction's 2^f from the polynomial, and
    2^floor(x) by adding floor(x) to the exponent field. x is clamped at -127, so -inf
    gives about 6e-39 rather than 0; callers decide emptiness by the row maximum.
    """
    c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .f32 x, t, r, f, p;\n"
        ".reg .b32 j, q;\n"
        "max.ftz.f32 x, $1, 0fC2FE0000;\n"  # -127
        "add.rm.ftz.f32 t, x, 0f4B400000;\n"  # floor(x) + 1.5 * 2^23
        "sub.ftz.f32 r, t, 0f4B400000;\n"
        "sub.ftz.f32 f, x, r;\n"
        f"fma.rn.ftz.f32 p, f, {c3}, {c2};\n"
        f"fma.rn.ftz.f32 p, p, f, {c1};\n"
        "fma.rn.ftz.f32 p, p, f, 0f3F800000;\n"  # 1.0
        "mov.b32 j, t;\n"
        "shl.b32 j, j, 23;\n"
        "mov.b32 q, p;\n"
        "add.s32 q, q, j;\n"
        "mov.b32 $0, q;\n"
        "}",
        "=f,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip,
    ))


@dsl_user_op
def exp2_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x by one MUFU.EX2 (flush-to-zero), kept in place by the compiler.

    Marked as having side effects on purpose: the pure ``cute.math.exp2(fastmath=True)``
    let the compiler move and duplicate exponentials in the forward's loop, which measured
    16% slower at head_dim 128 (docs/perf-notes.md).
    """
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


def _f32_hex(value: float) -> str:
    """PTX's spelling of a float32 constant."""
    return "0f" + struct.pack(">f", value).hex().upper()


def _tree_reduce(values: list, op):
    """Reduce a list pairwise: log2(n) dependent steps instead of n, so one warp keeps
    several independent instructions in flight (during ping-pong a scheduler often has
    a single softmax warp to issue from)."""
    while len(values) > 1:
        paired = [op(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = paired + values[len(values) - len(values) % 2:]
    return values[0]


def _quad_reduce(x: Float32, op) -> Float32:
    for offset in (1, 2):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x


class OnlineSoftmax:
    """Running max and sum for the rows this thread holds of one accumulator tile."""

    def __init__(self, scale_log2: Float32, num_rows: int, emulate_every: int = 0):
        """emulate_every = k > 0: every k-th column of a row takes exp2 on the FMA pipes
        (exp2_fma) instead of the MUFU unit, which softmax otherwise saturates."""
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.emulate_every = emulate_every
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_s: cute.Tensor, row_scale: cute.Tensor):
        """Exponentiate one score tile in place; write each row's O correction factor."""
        s = acc_as_rows_cols(acc_s)
        ncols = cute.size(s, mode=[1])
        for r in cutlass.range_constexpr(self.num_rows):
            m_prev = self.row_max[r]
            m_cur = _tree_reduce([m_prev] + [s[r, c] for c in range(ncols)], cute.arch.fmax)
            m_cur = _quad_reduce(m_cur, cute.arch.fmax)
            offset = m_cur * self.scale_log2
            if m_cur == -Float32.inf:
                offset = Float32(0.0)
            prev_offset = m_prev * self.scale_log2
            if m_prev == -Float32.inf:
                prev_offset = offset
            correction = exp2_mufu(prev_offset - offset)
            for c in cutlass.range_constexpr(ncols):
                x = s[r, c] * self.scale_log2 - offset
                if const_expr(c % max(self.emulate_every, 1) == self.emulate_every - 1):
                    s[r, c] = exp2_fma(x)
                else:
                    s[r, c] = exp2_mufu(x)
            total = _tree_reduce([s[r, c] for c in range(ncols)], operator.add)
            self.row_sum[r] = self.row_sum[r] * correction + total
            self.row_max[r] = m_cur
            row_scale[r] = correction

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor):
        """1/rowsum (0 for an empty row) and the natural-log LSE (-inf for an empty row)."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = _quad_reduce(self.row_sum[r], operator.add)
            m = self.row_max[r]
            if m == -Float32.inf:  # the row saw no key
                inv_sum[r] = Float32(0.0)
                lse[r] = -Float32.inf
            else:
                inv_sum[r] = cute.arch.rcp_approx(total)
                lse[r] = (m * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN2


@cute.jit
def scale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each accumulator row this thread holds by its factor."""
    o = acc_as_rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]
