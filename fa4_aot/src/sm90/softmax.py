"""Online softmax over wgmma accumulator rows, in the exp2 domain.

Scores arrive unscaled; ``scale_log2 = softmax_scale * log2(e)`` is folded into the single
FMA that feeds exp2, so each score costs one FMA and one MUFU.EX2. Row statistics live in
registers: each row of a 64-row warpgroup tile is spread over the four threads of a quad,
so the row max is reduced with two butterfly shuffles per tile, while the row sum stays
thread-local until ``finalize``.

Conditional rescaling: a row keeps its running maximum until a tile raises it by more
than ``RESCALE_THRESHOLD`` in the exp2 domain (a factor of 2^8). Until then the
exponentials are taken against the stale maximum, so P may exceed 1 by up to 2^8 (exact in
bf16/fp16 and fp32 sums), and the O accumulator needs no correction; a warp multiplies its
O rows only when one of its rows did move its maximum. LSE is taken against the same
maximum as the sum, so the final normalization is exact.

Rows whose every score so far is masked keep ``row_max = -inf``; the exponent offset then
uses 0 so that exp2(-inf - offset) is 0 rather than NaN. A row that ends with no unmasked
score gives O = 0 and LSE = -inf.
"""

import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .fragments import acc_as_rows_cols
from .primitives import select_f32

LN2 = math.log(2.0)
RESCALE_THRESHOLD = 8.0  # log2 units: P stays below 2^8 between rescales


@dsl_user_op
def exp2_mufu(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x by one MUFU.EX2 (flush-to-zero), kept in place by the compiler.

    Marked as having side effects on purpose: the pure ``cute.math.exp2(fastmath=True)``
    let the compiler move and duplicate exponentials in the forward's loop, which measured
    16% slower at head_dim 128 (docs/design.md, "Forward: exp2").
    """
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip,
    ))


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


def row_value(value, r: int):
    """Row r's entry of ``value``: a register tensor of one a row, or one scalar for every
    row (decided at trace time)."""
    return value[r] if isinstance(value, cute.Tensor) else value


class OnlineSoftmax:
    """Running max and sum for the rows this thread holds of one accumulator tile.

    ``scale_log2``: one scale for every row, or a register tensor of one a row (decode's
    FP8 pairs: each row's own head's K scale in it)."""

    def __init__(self, scale_log2, num_rows: int):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.row_max = cute.make_rmem_tensor((num_rows,), Float32)
        self.row_sum = cute.make_rmem_tensor((num_rows,), Float32)

    def _scale(self, r: int):
        """Row r's scale."""
        return row_value(self.scale_log2, r)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def step(self, acc_s: cute.Tensor, row_scale: cute.Tensor):
        """Exponentiate one score tile in place; write each row's O correction factor.

        The correction exp2(m_prev - m_new) is 1 unless a row's maximum moved (rare once
        the first tiles are seen: conditional rescaling keeps the stale maximum), so a warp
        takes those exponentials only when one of its rows moved: two MUFU.EX2 of the
        66 a thread issues per 64-column tile at head_dim 64, where that unit is busiest."""
        s = acc_as_rows_cols(acc_s)
        ncols = cute.size(s, mode=[1])
        offsets = cute.make_rmem_tensor((self.num_rows,), Float32)
        prevs = cute.make_rmem_tensor((self.num_rows,), Float32)
        moved = Float32(0.0)
        for r in cutlass.range_constexpr(self.num_rows):
            m_prev = self.row_max[r]
            m_cur = _tree_reduce([m_prev] + [s[r, c] for c in range(ncols)], cute.arch.fmax)
            m_cur = _quad_reduce(m_cur, cute.arch.fmax)
            # Keep the stale maximum unless it grew past the threshold (or was -inf: the
            # difference is then +inf; both -inf gives NaN, which compares false).
            m_cur = select_f32((m_cur - m_prev) * self._scale(r) <= RESCALE_THRESHOLD, m_prev, m_cur)
            offsets[r] = select_f32(m_cur == -Float32.inf, 0.0, m_cur * self._scale(r))
            # moved: some row's kept maximum changed (from -inf too: its correction is 1,
            # computed below as exp2(0))
            moved = select_f32(m_cur != m_prev, Float32(1.0), moved)
            row_scale[r] = Float32(1.0)
            self.row_max[r] = m_cur
            prevs[r] = m_prev
        if cute.arch.vote_any_sync(moved > Float32(0.0)):
            for r in cutlass.range_constexpr(self.num_rows):
                m_prev = prevs[r]
                prev_offset = select_f32(m_prev == -Float32.inf, offsets[r], m_prev * self._scale(r))
                row_scale[r] = exp2_mufu(prev_offset - offsets[r])
        for r in cutlass.range_constexpr(self.num_rows):
            for c in cutlass.range_constexpr(ncols):
                s[r, c] = exp2_mufu(s[r, c] * self._scale(r) - offsets[r])
            total = _tree_reduce([s[r, c] for c in range(ncols)], operator.add)
            self.row_sum[r] = self.row_sum[r] * row_scale[r] + total

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor, sink_log2=None):
        """1/rowsum (0 for an empty row) and the natural-log LSE (-inf for an empty row).

        ``sink_log2``: an attention sink's logit in the exp2 domain (-inf: none), or a
        register tensor of one per row, a term of every row's denominator that adds no value: O's factor exp2(m - top) / total and
        the LSE over the keys and the sink, where top, the larger of the row's maximum
        and the sink, keeps both exponentials at most 1; a row that saw no key gets O 0
        and the sink as its LSE."""
        for r in cutlass.range_constexpr(self.num_rows):
            total = _quad_reduce(self.row_sum[r], operator.add)
            m = self.row_max[r]
            if cutlass.const_expr(sink_log2 is None):
                if m == -Float32.inf:  # the row saw no key
                    inv_sum[r] = Float32(0.0)
                    lse[r] = -Float32.inf
                else:
                    inv_sum[r] = cute.arch.rcp_approx(total)
                    lse[r] = (m * self._scale(r) + cute.math.log2(total, fastmath=True)) * LN2
            else:
                sink = row_value(sink_log2, r)
                m_log2 = select_f32(m == -Float32.inf, -Float32.inf, m * self._scale(r))
                top = cute.arch.fmax(m_log2, sink)
                if top == -Float32.inf:  # no key and no sink
                    inv_sum[r] = Float32(0.0)
                    lse[r] = -Float32.inf
                else:
                    keys = cute.math.exp2(m_log2 - top, fastmath=True)  # 0 for a row that saw no key
                    total = total * keys + cute.math.exp2(sink - top, fastmath=True)
                    inv_sum[r] = keys * cute.arch.rcp_approx(total)
                    lse[r] = (top + cute.math.log2(total, fastmath=True)) * LN2


# tanh's Taylor series, x^1 .. x^15 (odd powers): below TANH_SERIES_BELOW the next term
# is under 5e-8 of tanh (one float32 ulp)
TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075, -929569 / 638512875)
TANH_SERIES_BELOW = 0.55


@cute.jit
def cap_scores(acc_s: cute.Tensor, softcap_scale: Float32):
    """Scores s -> tanh(s * softcap_scale) in place, softcap_scale = softmax_scale / cap
    (the softmax then takes cap * log2(e) as its scale: cap * tanh(s * scale / cap)).

    Within a float32 ulp or two of tanh: its series below 0.55, above it 1 - 2 / (1 +
    e^2|x|) (an exponential and a reciprocal) with x's sign; a warp whose scores all lie
    below takes the series alone (Gemma's cap of 50 keeps |x| below 0.55 for |s * scale| <
    27). tanh.approx is off by up to 2^-11 of the value, and 1 - 2 / (1 + e^2x) alone by
    ~1e-7 absolute near 0: times the cap, 50 float32 ulps of a score of 1 (docs/design.md,
    "Local attention, sinks, softcap")."""
    largest = Float32(0.0)
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        largest = cute.arch.fmax(largest, cute.arch.fmax(acc_s[i], -acc_s[i]))
    if cute.arch.vote_any_sync(largest * cute.arch.fmax(softcap_scale, -softcap_scale) >= Float32(TANH_SERIES_BELOW)):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            x = acc_s[i] * softcap_scale
            magnitude = cute.arch.fmax(x, -x)
            far = Float32(1.0) - Float32(2.0) * cute.arch.rcp_approx(
                Float32(1.0) + exp2_mufu(magnitude * Float32(2.0 * math.log2(math.e))))
            acc_s[i] = select_f32(magnitude < Float32(TANH_SERIES_BELOW), _tanh_series(x),
                                  select_f32(x < 0.0, -far, far))
    else:
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = _tanh_series(acc_s[i] * softcap_scale)


def _tanh_series(x):
    x2 = x * x
    series = Float32(TANH_SERIES[-1])
    for c in TANH_SERIES[-2::-1]:
        series = series * x2 + Float32(c)
    return x * series


@cute.jit
def rescale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """``scale_rows`` for the rows of ``OnlineSoftmax.step``: skipped by a whole warp when
    none of its rows moved its maximum (every factor is then exactly 1)."""
    smallest = _tree_reduce([row_scale[r] for r in range(cute.size(row_scale))], cute.arch.fmin)
    if cute.arch.vote_any_sync(smallest < Float32(1.0)):
        scale_rows(acc_o, row_scale)


@cute.jit
def scale_rows(acc_o: cute.Tensor, row_scale: cute.Tensor):
    """Multiply each accumulator row this thread holds by its factor."""
    o = acc_as_rows_cols(acc_o)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * row_scale[r]
