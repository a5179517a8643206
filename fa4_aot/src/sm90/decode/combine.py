"""The split-KV combine (sm_90a): each (batch, query token, query head) row's splits,
merged by their LSEs into out and lse.

Split s wrote its O normalized by its own softmax sum, O_s, and LSE_s (decode/kernel.py).
The row's LSE is m + log(sum_s exp(LSE_s - m)) with m the largest LSE_s, and its O is
sum_s w_s O_s with w_s = exp(LSE_s - LSE): the weights of the splits' shares of the whole
softmax sum. Splits that saw no key have LSE_s = -inf and weight 0; a row none of whose
splits saw a key gets out 0 and lse -inf, as the one-split kernel writes it. The splits
are summed in order, so a given num_splits gives the same bits every run.

One warp per row: each lane holds the LSEs of splits lane, lane + 32, ... for the
maximum, the sum and the weights, and head_dim / 32 columns of O: the shares of a batch of
splits are loaded before they are summed (in split order; the first batch with the LSEs),
each split's weight from the lane that holds it; O is written within its own head dim
(``columns_v``).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ...common import symbols
from ...interfaces import COMBINE, COMBINE_INPUTS
from ..primitives import DTYPES
from ..softmax import exp2_mufu
from .config import MAX_SPLITS, CombineConfig

LOG2E = math.log2(math.e)
LANE_SPLITS = -(-MAX_SPLITS // 32)  # the LSEs a lane holds: every split a launch may take
SHARE_FLOATS = 64  # fp32 of the splits' O shares a lane has in flight at once


class CombineSm90:
    def __str__(self):
        return symbols.COMBINE_SM90  # the cubin's kernel name (common/symbols.py)

    def __init__(self, cfg: CombineConfig):
        assert cfg.head_dim % 32 == 0
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.batch_splits = max(1, SHARE_FLOATS // (cfg.head_dim // 32))  # splits' shares in flight a lane
        # a lane's share starts at a multiple of its head_dim / 32 floats of the workspace
        # (256-byte aligned, head dims multiples of 32): 16-byte loads where that allows
        lane_bytes = cfg.head_dim // 32 * 4
        self.share_align = min(16, lane_bytes & -lane_bytes)

    @cute.jit
    def __call__(self, x: COMBINE_INPUTS.tuple_type):
        """One launch (interfaces.COMBINE): a warp per (batch, query token, query head) row."""
        rows = x.batch * x.seqlen_q * x.heads_q
        self.kernel(COMBINE.bind(self.cfg, x)).launch(
            grid=(cute.ceil_div(rows, self.cfg.rows), 1, 1), block=[self.cfg.threads, 1, 1])

    @cute.kernel
    def kernel(self, p: COMBINE.tuple_type):
        """The split workspace (splits, b, s_q, h_q, d) and (splits, b, h_q, s_q) fp32 in; O
        (b, s_q, h_q, d) by address and strides and LSE (b, h_q, s_q) out."""
        o_part_ptr, lse_part_ptr, (o_ptr, (o_sb, o_ss, o_sh)), lse_ptr = p.o_partial, p.lse_partial, p.out, p.lse
        batch, seqlen_q, heads_q, splits, columns = p.batch, p.seqlen_q, p.heads_q, p.splits, p.columns_v
        per_lane = self.cfg.head_dim // 32
        batch_splits = self.batch_splits
        # launched programmatically (most decode kernels' CTAs trigger it as they start):
        # nothing is read before the decode grid is done and its writes are visible
        cute.arch.griddepcontrol_wait()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * self.cfg.rows + warp
        rows = batch * seqlen_q * heads_q
        if row < rows:
            head = row % heads_q
            token = (row // heads_q) % seqlen_q
            b = row // (heads_q * seqlen_q)
            plane = batch * heads_q * seqlen_q  # one split's LSEs
            lse_at = (b * heads_q + head) * seqlen_q + token
            lse_part = cute.make_tensor(lse_part_ptr, cute.make_layout(splits * plane))
            # every split's LSE read at once, lane l holding splits l, l + 32, ..., and the
            # first splits' shares with them (they do not wait for the weights): a row's
            # loads are one round trip up to a batch of splits, not one per split
            # (docs/design.md, "Decode": split-KV); a row that sees no key (top -inf
            # below: an empty sequence or window) has read its first batch for nothing,
            # in bounds of the workspace, and adds none of it
            held = cute.make_rmem_tensor((LANE_SPLITS,), Float32)
            for j in cutlass.range_constexpr(LANE_SPLITS):
                held[j] = -Float32.inf
                if lane + 32 * j < splits:
                    held[j] = lse_part[Int64(lane + 32 * j) * plane + lse_at]
            row_in_split = (Int64(b) * seqlen_q + token) * heads_q + head  # (b, s_q, h_q) order
            shares = [cute.make_rmem_tensor((per_lane,), Float32) for _ in range(batch_splits)]
            self.load_shares(shares, Int32(0), (splits, plane, row_in_split, lane), o_part_ptr)
            top = -Float32.inf
            for j in cutlass.range_constexpr(LANE_SPLITS):
                top = cute.arch.fmax(top, held[j])
            for offset in cutlass.range_constexpr(5):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << offset))
            base = Float32(cutlass.select_(top == -Float32.inf, Float32(0.0), top)) * LOG2E
            total = Float32(0.0)
            for j in cutlass.range_constexpr(LANE_SPLITS):
                if lane + 32 * j < splits:
                    total = total + exp2_mufu(held[j] * LOG2E - base)
            for offset in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
            # the row's LSE in the exp2 domain; a row of no key keeps -inf (weights 0)
            lse2 = base + cute.math.log2(total, fastmath=True)
            weights = cute.make_rmem_tensor((LANE_SPLITS,), Float32)
            for j in cutlass.range_constexpr(LANE_SPLITS):
                weights[j] = exp2_mufu(held[j] * LOG2E - lse2)
            acc = cute.make_rmem_tensor((per_lane,), Float32)
            acc.fill(0.0)
            if top != -Float32.inf:
                self.add_shares(acc, shares, Int32(0), splits, weights)
                for s0 in cutlass.range(batch_splits, splits, batch_splits, unroll=1):
                    self.load_shares(shares, s0, (splits, plane, row_in_split, lane), o_part_ptr)
                    self.add_shares(acc, shares, s0, splits, weights)
            out = cute.make_rmem_tensor((per_lane,), self.dtype)
            out.store(acc.load().to(self.dtype))
            at = Int64(b) * o_sb + Int64(token) * o_ss + Int64(head) * o_sh + lane * per_lane
            if (lane + 1) * per_lane <= columns:
                cute.autovec_copy(out, gmem(o_ptr, self.dtype, at, per_lane))
            if (lane + 1) * per_lane > columns:  # the lane O's head dim ends in (if any): its columns one by one
                for e in cutlass.range_constexpr(per_lane):
                    if lane * per_lane + e < columns:
                        cute.autovec_copy(cute.local_tile(out, (1,), (e,)), gmem(o_ptr, self.dtype, at + e, 1))
            if lane == 0:
                lse = cute.make_tensor(lse_ptr, cute.make_layout(plane))
                lse[lse_at] = Float32(cutlass.select_(top == -Float32.inf, -Float32.inf, lse2 / LOG2E))

    @cute.jit
    def load_shares(self, shares, s0, row, o_part_ptr):
        """This lane's columns of the O shares of splits s0, s0 + 1, ... (``len(shares)`` of
        them, those below ``splits``) into ``shares``. ``row``: (splits, one split's rows,
        the row's place in a split, the lane)."""
        splits, plane, row_in_split, lane = row
        per_lane = self.cfg.head_dim // 32
        for u in cutlass.range_constexpr(len(shares)):
            if s0 + u < splits:
                first = (Int64(s0 + u) * plane + row_in_split) * self.cfg.head_dim + lane * per_lane
                cute.autovec_copy(gmem(o_part_ptr, Float32, first, per_lane, self.share_align), shares[u])

    @cute.jit
    def add_shares(self, acc, shares, s0, splits, weights):
        """acc += w_s O_s over the splits s0, s0 + 1, ... that ``shares`` holds, in split
        order; split s's weight from the lane that holds it (lane s % 32, ``weights[s // 32]``)."""
        for u in cutlass.range_constexpr(len(shares)):
            s = s0 + u
            if s < splits:
                mine = weights[0]
                for j in cutlass.range_constexpr(1, LANE_SPLITS):
                    mine = cutlass.select_(s // 32 == j, weights[j], mine)
                weight = cute.arch.shuffle_sync(mine, s % 32)
                for e in cutlass.range_constexpr(cute.size(acc)):
                    acc[e] = acc[e] + weight * shares[u][e]


def gmem(ptr: cute.Pointer, dtype, offset, n: int, align: int = 0) -> cute.Tensor:
    """``n`` contiguous elements of global memory at element ``offset`` (64-bit) from ``ptr``,
    aligned to ``align`` bytes (default: one element's)."""
    at = ptr.toint() + offset * (dtype.width // 8)
    return cute.make_tensor(cute.make_ptr(dtype, at, cute.AddressSpace.gmem, assumed_align=align or dtype.width // 8),
                            cute.make_layout(n))
