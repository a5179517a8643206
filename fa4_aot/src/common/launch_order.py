"""The order in which a kernel's CTAs take their work: integer functions of the block
index, used by the kernels on Int32 values and by the CPU tests (tests/cpu/test_order.py)
on Python ints.

Blocks start in launch order, x fastest. With a grid of (tiles, heads, batch) a head's
tiles start together and share its K/V (forward) or Q/dO (backward) in L2, but the heads
run one after another: causal tiles differ in length, and the heaviest tiles of the last
heads start in the last wave and end the kernel in a tail. Read in groups of heads, a
wave holds the heaviest tiles of several heads, then their next ones, and so on.
"""

import cutlass

# Backward, causal and not deterministic, or deterministic and not causal: CTAs handed
# out in groups of KV heads whose Q, dO (16-bit) and fp32 dQ accumulator copies fit this
# much of L2, in powers of two up to BWD_MAX_HEAD_GROUP (causal: a fixed 4 measured best at
# 4k; sized to L2, 16k d256 +3% with 1, d128 equal with 2: docs/design.md, "Backward: launch
# order and head groups").
BWD_L2_BYTES = 40 * 1024 * 1024
BWD_MAX_HEAD_GROUP = 4
# Forward, causal: as many heads per group as keep their K and V in this much of L2 (the
# H200 has 50 MB), in powers of two up to FWD_MAX_HEAD_GROUP.
FWD_L2_BYTES = 40 * 1024 * 1024
FWD_MAX_HEAD_GROUP = 32


def launch_in_head_groups(x, y, n_blocks, heads, group):
    """(launch index within its head, head) of block (x, y) of a batch entry, when the
    blocks go to groups of ``group`` heads: the group's first CTA of each head, then the
    second of each, and so on. Within a head the launch order is unchanged (the
    deterministic backward's launched-before rule holds). Backward: d128 4k
    causal +4%, d64 +2%, 16k equal."""
    linear = x + n_blocks * y
    g = linear // (n_blocks * group)
    first = g * group
    size = cutlass.min(group, heads - first)
    r = linear - g * n_blocks * group
    return r // size, first + r % size


def forward_head_group(seqlen_k, head_dim: int):
    """Heads per launch group of the causal forward: the largest power of two whose K
    and V (seqlen_k x head_dim each, 16-bit) fit FWD_L2_BYTES, at least 1."""
    return _l2_head_group(seqlen_k, 4 * head_dim, FWD_L2_BYTES, FWD_MAX_HEAD_GROUP)


def backward_head_group(seqlen_q, head_dim: int, q_heads_per_kv, dq_copies: int = 1):
    """KV heads per launch group of the backward: the largest power of two whose query
    side (Q and dO, 16-bit, and the dq_copies fp32 dQ accumulators: 4 + 4 x dq_copies bytes
    per element, for each query head of the group's KV heads) fits BWD_L2_BYTES, at least
    1."""
    return _l2_head_group(seqlen_q * q_heads_per_kv, (4 + 4 * dq_copies) * head_dim, BWD_L2_BYTES,
                          BWD_MAX_HEAD_GROUP)


def _l2_head_group(rows, bytes_per_row: int, budget: int, cap: int):
    """The largest power of two g <= cap with g * rows * bytes_per_row <= budget, at least
    1. The bounds are compile-time constants, so nothing here can overflow (and no branch:
    the kernels call it on run-time sizes)."""
    group = 1
    for k in range(1, cap.bit_length()):  # unrolled: 2, 4, .., the cap
        g = 1 << k
        fits = cutlass.min(budget // (g * bytes_per_row) // cutlass.max(rows, 1), 1)  # 1 or 0
        group = cutlass.max(group, g * fits)
    return group
