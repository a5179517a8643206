"""What the decode kernel's roles (kernel.py, loads.py, walk.py) index alike: the packed
rows of a KV head (row p: token p // group, query head head_kv * group + p % group), the
key tiles in a CTA's order, and the named barrier at which the consumer's Q is ready."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

Q_BARRIER = 1  # the consumer warpgroup's Q tile written to shared memory (head_split: 1, 2 by warpgroup)


def key_tile(i, n_end, steps, turn):
    """The ``i``-th key tile a CTA takes of its ``steps`` ending at ``n_end``: from the
    last, downwards, starting ``turn`` tiles in and wrapping around. i and turn are both
    below steps, so the wrap is one compare, not a division (each tile, in the producer's
    and the consumer's loops)."""
    j = i + turn
    return n_end - 1 - cutlass.select_(j >= steps, j - steps, j)


def token_head(p, group, seqlen_q, head_kv):
    """(token, query head) of packed row ``p`` of KV head ``head_kv``."""
    token = token_of(p, group, seqlen_q)
    return token, head_kv * group + p - token * group


@cute.jit
def token_of(p, group, seqlen_q):
    """The token of packed row ``p`` (p // group). With one token every packed row in use
    is below group: 0, with no division (rows past them are neither read nor written)."""
    token = Int32(0)
    if seqlen_q > 1:
        token = p // group
    return token


def pair_offset(p, group, pair, columns):
    """cfg.pairs: the first column of packed row ``p``'s KV head within its pair (``pair``
    KV heads side by side, each ``columns`` wide; ``group``: query heads per pair), 0 where
    ``pair`` is 1."""
    return (p % group) // (group // pair) * columns
