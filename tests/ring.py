"""Ring attention's arithmetic in one process (issue 41): what torch's context parallelism
does across ranks, done here shard by shard with any block functions, so that a test can
check that our kernels' per-block results merge into the unsharded ones.

The sequence (dim 1 of (b, s, h, d) tensors) is cut into ``shards`` ranks' pieces. Causal,
load-balanced: 2 x shards chunks, rank r holding chunks r and 2 x shards - 1 - r, so every
rank has the same work. Rank i's queries meet rank j's keys as torch's ring does it:
- j == i: causal attention of the rank's own 2 chunks (the diagonal);
- j < i: all of rank i's queries against the first of rank j's chunks, not causal (its
  second chunk lies after both of rank i's);
- j > i: the second of rank i's chunks against both of rank j's, not causal (rank i's first
  chunk lies before both).
So the blocks have seqlen_q != seqlen_k (L x 2L, 2L x L). Not causal: one chunk a rank, every
block full. The blocks' (out, lse) merge by LSE; the backward takes each block with the
rank's merged out and LSE (D = rowsum(dout * out) of the whole row) and sums dq over the
key blocks, dk and dv over the query blocks.

``attend(q, k, v, causal) -> (out, lse (b, h, s) float32)`` and
``grad(q, k, v, out, dout, lse, causal) -> (dq, dk, dv)``: the block functions (our
kernels, or the float32 reference's).
"""

import torch


def chunks_of(rank: int, shards: int, causal: bool) -> list[int]:
    return [rank, 2 * shards - 1 - rank] if causal else [rank]


def _rows(chunks, length):
    return torch.cat([torch.arange(c * length, (c + 1) * length) for c in chunks])


def blocks(shards: int, causal: bool, seqlen: int):
    """(query rows, key rows, causal) of every block of the ring, as global positions."""
    pieces = 2 * shards if causal else shards
    assert seqlen % pieces == 0, (seqlen, pieces)
    length = seqlen // pieces
    for i in range(shards):
        mine = chunks_of(i, shards, causal)
        for j in range(shards):
            theirs = chunks_of(j, shards, causal)
            if not causal:
                yield _rows(mine, length), _rows(theirs, length), False
            elif j == i:
                yield _rows(mine, length), _rows(theirs, length), True
            elif j < i:
                yield _rows(mine, length), _rows(theirs[:1], length), False
            else:
                yield _rows(mine[1:], length), _rows(theirs, length), False


def merge(out, lse, part_out, part_lse):
    """(out, lse) with one more block's merged in, float32; out (b, s, h, d), lse (b, h, s)."""
    if out is None:
        return part_out.float(), part_lse.float()
    new = torch.logaddexp(lse, part_lse.float())
    w_old = torch.exp(lse - new).nan_to_num(0.0).transpose(1, 2)[..., None]  # (b, s, h, 1)
    w_new = torch.exp(part_lse.float() - new).nan_to_num(0.0).transpose(1, 2)[..., None]
    return out * w_old + part_out.float() * w_new, new


def ring_forward(q, k, v, shards, causal, attend):
    """(out in q's dtype, lse float32) of the whole sequence, merged from the ring's blocks."""
    seqlen = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], seqlen), float("-inf"), device=q.device)
    for rows, cols, block_causal in blocks(shards, causal, seqlen):
        rows, cols = rows.to(q.device), cols.to(q.device)
        part_out, part_lse = attend(q[:, rows].contiguous(), k[:, cols].contiguous(), v[:, cols].contiguous(),
                                    block_causal)
        o, l = merge(out[:, rows], lse[:, :, rows], part_out, part_lse)
        out[:, rows], lse[:, :, rows] = o, l
    return out.to(q.dtype), lse


def ring_backward(q, k, v, out, dout, lse, shards, causal, grad):
    """(dq, dk, dv) of the whole sequence, summed (float32) over the ring's blocks, each
    block given the merged out and lse of its query rows."""
    seqlen = q.shape[1]
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    for rows, cols, block_causal in blocks(shards, causal, seqlen):
        rows, cols = rows.to(q.device), cols.to(q.device)
        g = grad(q[:, rows].contiguous(), k[:, cols].contiguous(), v[:, cols].contiguous(),
                 out[:, rows].contiguous(), dout[:, rows].contiguous(), lse[:, :, rows].contiguous(), block_causal)
        dq[:, rows] += g[0].float()
        dk[:, cols] += g[1].float()
        dv[:, cols] += g[2].float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def reference_block_grad(q, k, v, out, dout, lse, causal, scale=None):
    """A block's gradients in float32 from the given (merged) out and lse: the recipe every
    flash backward follows (P = exp(s - lse), D = rowsum(dout * out), dS = P (dP - D));
    GQA: dk, dv summed over each KV head's query heads. Bottom-right causal."""
    q32, k32, v32, o32, do32 = (t.float() for t in (q, k, v, out, dout))
    group = q.shape[2] // k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kx, vx = k32.repeat_interleave(group, dim=2), v32.repeat_interleave(group, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q32, kx) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.arange(sk, device=s.device)[None, :] <= torch.arange(sq, device=s.device)[:, None] + sk - sq
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s - lse.float()[..., None]).nan_to_num(0.0)
    dvx = torch.einsum("bhst,bshd->bthd", p, do32)
    dp = torch.einsum("bshd,bthd->bhst", do32, vx)
    dsum = (do32 * o32).sum(-1).transpose(1, 2)[..., None]  # (b, h, s, 1)
    ds = p * (dp - dsum)
    dq = torch.einsum("bhst,bthd->bshd", ds, kx) * scale
    dkx = torch.einsum("bhst,bshd->bthd", ds, q32) * scale
    fold = lambda t: t.reshape(*t.shape[:2], k.shape[2], group, t.shape[-1]).sum(3)  # noqa: E731
    return dq, fold(dkx), fold(dvx)
