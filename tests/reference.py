"""The attention reference the tests compare against (torch; float32 or low precision)."""

import json
import math
import os

import torch


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True, window=None, softcap=0.0, sink=None):
    """(out, lse) for q (b, s_q, h_q, d), k (b, s_k, h_kv, d), v (b, s_k, h_kv, d_v).

    upcast=True: float32 math, the reference. upcast=False: the same math in the inputs'
    precision, as a framework would do it; its error sets the tolerance.
    Causal is bottom-right aligned; rows that see no key give out 0 and lse -inf.
    ``window`` (left, right), -1 unbounded: query i sees keys i + s_k - s_q - left ..
    i + s_k - s_q + right; ``softcap`` > 0: scores softcap * tanh(s / softcap);
    ``sink`` (h_q,): a logit per head in every row's denominator (a row that sees no key:
    out 0, lse the sink).
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    h_q, h_kv, d = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(h_q // h_kv, dim=2)
    v = v.repeat_interleave(h_q // h_kv, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q * scale if not upcast else q, k)
    if upcast:
        scores = scores * scale
    scores = scores.float()
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        scores = _causal_masked(scores)
    if window is not None:
        scores = _window_masked(scores, *window)
    if sink is not None:
        column = sink.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sink is not None:
        p = p[..., :-1]
    out = torch.einsum("bhst,bthd->bshd", p.to(v.dtype), v)
    return out.to(dtype), lse


def _bmm32(x, y):
    """x (..., m, k) @ y (..., k, n) of 16-bit tensors into float32 on the tensor cores
    (cuBLAS with a float32 output: 16-bit products, float32 accumulation, as wgmma). Every
    dimension is padded with zeros to a multiple of 16, so that cuBLAS takes a tensor-core
    kernel for a one-key GEMM too, not a float32 FMA one (the zeros add nothing)."""
    lead, m, k, n = x.shape[:-2], x.shape[-2], x.shape[-1], y.shape[-1]
    up = lambda size: -size % 16  # noqa: E731
    x = torch.nn.functional.pad(x, (0, up(k), 0, up(m))).reshape(-1, m + up(m), k + up(k))
    y = torch.nn.functional.pad(y, (0, up(n), 0, up(k))).reshape(-1, k + up(k), n + up(n))
    out = torch.bmm(x, y, out_dtype=torch.float32)[:, :m, :n]
    return out.reshape(*lead, m, n)


def attention_bwd_tensor_cores(q, k, v, dout, out, causal=False, softmax_scale=None, window=None, sink=None,
                               softcap=0.0):
    """(dq, dk, dv) in float32 by the recipe of attention_bwd_from_out with P and dS rounded
    to the inputs' dtype, every GEMM on the tensor cores as a kernel's: 16-bit operands,
    float32 accumulation (``_bmm32``). The recipe's float32 GEMMs accumulate exactly
    rounded FMAs; the tensor cores do not, which shows where the exact gradient is 0 and
    every figure is rounding: a one-key sequence (P = 1, dS = dP - D). ``window``,
    ``sink``, ``softcap``: as attention_ref's (dS then times tanh's derivative)."""
    dtype = q.dtype
    s_k, h_q, h_kv, d = k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    heads = lambda x: x.transpose(1, 2)  # noqa: E731  (b, s, h, d) -> (b, h, s, d)
    qh, doh = heads(q), heads(dout)
    kh, vh = heads(k.repeat_interleave(group, dim=2)), heads(v.repeat_interleave(group, dim=2))
    scores, dtanh = _capped(_bmm32(qh, kh.transpose(-1, -2)) * scale, softcap)
    p = _probs(scores, causal, window, sink)
    dp = _bmm32(doh, vh.transpose(-1, -2))
    dsum = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    p16, ds16 = p.to(dtype), (p * (dp - dsum[..., None]) * dtanh).to(dtype)
    dv = _bmm32(p16.transpose(-1, -2), doh)
    dk = _bmm32(ds16.transpose(-1, -2), qh) * scale
    dq = _bmm32(ds16, kh) * scale
    by_group = lambda x: heads(x).reshape(x.shape[0], s_k, h_kv, group, x.shape[-1]).sum(3)  # noqa: E731
    return heads(dq), by_group(dk), by_group(dv)


def attention_bwd_from_out(q, k, v, dout, out, causal=False, softmax_scale=None, operands=None, window=None,
                           sink=None, softcap=0.0):
    """(dq, dk, dv) in float32 by the flash-attention backward recipe from a given ``out``:
    P from the exact LSE, D = rowsum(dO o out), dS = P o (dP - D). ``operands``: a dtype
    that P and dS are rounded to as GEMM operands (as a tensor-core backward's are; the
    GEMMs accumulate in float32), else they stay float32. From a backward's own 16-bit
    ``out`` and operands, the same math as its kernel; with the exact output rounded to
    16 bits, the cost of storing the output alone. ``window``, ``sink``, ``softcap``: as
    attention_ref's."""
    q, k, v, dout, out = (x.float() for x in (q, k, v, dout, out))
    s_k, h_q, h_kv, d = k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k_q, v_q = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores, dtanh = _capped(torch.einsum("bshd,bthd->bhst", q, k_q) * scale, softcap)
    p = _probs(scores, causal, window, sink)  # rows that see no key: 0
    dp = torch.einsum("bshd,bthd->bhst", dout, v_q)
    dsum = (dout * out).sum(-1).transpose(1, 2)  # (b, h, s_q)
    ds = p * (dp - dsum[..., None]) * dtanh
    if operands is not None:
        p, ds = p.to(operands).float(), ds.to(operands).float()
    dv = torch.einsum("bhst,bshd->bthd", p, dout)
    dk = torch.einsum("bhst,bshd->bthd", ds, q) * scale
    dq = torch.einsum("bhst,bthd->bshd", ds, k_q) * scale
    by_group = lambda x: x.view(x.shape[0], s_k, h_kv, group, x.shape[-1]).sum(3)  # noqa: E731
    return dq, by_group(dk), by_group(dv)


def _capped(scores, softcap):
    """(cap * tanh(scores / cap), 1 - tanh^2: the cap's derivative) where softcap, else
    (scores, 1)."""
    if not softcap:
        return scores, 1.0
    t = torch.tanh(scores / softcap)
    return softcap * t, 1 - t * t


def _probs(scores, causal, window=None, sink=None):
    """softmax of float32 scores (b, h, s_q, s_k) under the masks, with the sinks (h,) in
    each row's denominator; 0 in rows that see nothing."""
    if causal:
        scores = _causal_masked(scores)
    if window is not None:
        scores = _window_masked(scores, *window)
    if sink is None:
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)
    column = sink.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)


def _causal_masked(scores):
    """Scores (..., s_q, s_k) with the keys past each query's diagonal (bottom-right
    aligned) at -inf."""
    s_q, s_k = scores.shape[-2:]
    row = torch.arange(s_q, device=scores.device)[:, None]
    col = torch.arange(s_k, device=scores.device)[None, :]
    return scores.masked_fill(col > row + s_k - s_q, float("-inf"))


def _window_masked(scores, left, right):
    """Scores (..., s_q, s_k) with the keys outside each query's window at -inf: query i
    sees keys i + s_k - s_q - left .. i + s_k - s_q + right (-1: unbounded)."""
    s_q, s_k = scores.shape[-2:]
    row = torch.arange(s_q, device=scores.device)[:, None] + s_k - s_q
    col = torch.arange(s_k, device=scores.device)[None, :]
    outside = torch.zeros_like(col > row)
    if right >= 0:
        outside |= col > row + right
    if left >= 0:
        outside |= col < row - left
    return scores.masked_fill(outside, float("-inf"))


FLOAT32_EPS = 2.0**-23
FLOOR = 1e-6  # rows whose reference and low-precision twin agree exactly (no key: 0)
BLOCK_ROWS = 64  # query rows per block of the block RMS rule
# where set, check_attention appends each call's worst ratio to each rule's tolerance as
# one JSON line (how near correct kernels come to the rules: docs/design.md, Tolerances)
MARGINS = os.environ.get("FA4_AOT_TEST_MARGINS")


def _record_margins(what, **ratios):
    if MARGINS:
        with open(MARGINS, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what, **ratios}) + "\n")


def _block_rows(s, device):
    """(blocks, 1): the query rows of each block of BLOCK_ROWS (the last holds what remain)."""
    blocks = -(-s // BLOCK_ROWS)
    return (s - torch.arange(blocks, device=device) * BLOCK_ROWS).clamp(max=BLOCK_ROWS)[:, None]


def _block_rms(err):
    """(b, s, h, d) -> (b, blocks, h): the RMS over each block of BLOCK_ROWS query rows
    and the head dim (the last block holds what rows remain)."""
    b, s, h, d = err.shape
    pad = -s % BLOCK_ROWS
    sq = torch.nn.functional.pad(err.square(), (0, 0, 0, 0, 0, pad)).reshape(b, -1, BLOCK_ROWS, h, d)
    return (sq.sum((2, 4)) / (_block_rows(s, err.device) * d)).sqrt()


def check_attention(out, lse, q, k, v, causal, scale=None, what="", **mods):
    """A forward's ``out`` and ``lse`` (b, h_q, s_q) against the references of the same
    16-bit inputs (docs/design.md, Tolerances). out, against the float32 reference: the
    largest element within twice the low-precision twin's (PyTorch in the inputs' dtype);
    each query row's RMS over the head dim within twice the twin's plus two roundings of
    the dtype (P and the output are rounded to 16 bits: a row that one key dominates has
    that error where the twin has almost none); each block of BLOCK_ROWS rows within twice
    the twin's RMS, so that an error confined to one tile shows (a block of one row is
    held by the row rule alone). lse: the kernel's is float32 math on the 16-bit inputs,
    so its own rule: within twice the error of PyTorch's float32 LSE against float64 (over
    the tensor) plus 8 float32 ulps of its magnitude; -inf exactly where a row sees no key."""
    # the float32 reference stays float32: rounded to 16 bits, a correct row and the
    # twin's would both often round to it exactly, and the per-row ratio would compare
    # one-ulp flips (docs/design.md, Tolerances)
    ref, lse32 = attention_ref(q.float(), k.float(), v.float(), causal, scale, upcast=True, **mods)
    # the twin in q's dtype (an FP8 cache's dequantized float32 K and V rounded to it)
    low, _ = attention_ref(q, k.to(q.dtype), v.to(q.dtype), causal, scale, upcast=False, **mods)
    _, lse64 = attention_ref(q.double(), k.double(), v.double(), causal,
                             scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), upcast=False,
                             **{n: (m.double() if n == "sink" and m is not None else m) for n, m in mods.items()})
    assert not out.isnan().any(), f"{what}unwritten or NaN output elements"
    err, err_low = out.float() - ref.float(), low.float() - ref.float()
    whole, whole_tol = err.abs().max().item(), 2 * err_low.abs().max().item() + 1e-5
    rms, rms_low, rms_ref = (e.square().mean(-1).sqrt() for e in (err, err_low, ref))
    row_tol = 2 * rms_low + torch.finfo(q.dtype).eps * rms_ref + FLOOR  # eps: two unit roundoffs of the inputs' dtype
    # a block of one row is that row, held by the row rule (with its two roundings: the
    # twin can be near exact in one row); decode's blocks are seqlen_q rows (docs/design.md,
    # Tolerances)
    one_row = _block_rows(out.shape[1], out.device) == 1
    blocks, block_tol = _block_rms(err), (2 * _block_rms(err_low) + FLOOR).masked_fill(one_row, math.inf)
    finite = torch.isfinite(lse64)
    lse_err = (lse.double() - lse64)[finite].abs()
    lse_tol = 2 * (lse32.double() - lse64)[finite].abs().max() + 8 * FLOAT32_EPS * (lse64[finite].abs() + 1) \
        if finite.any() else lse_err
    _record_margins(what, whole=whole / whole_tol, row=(rms / row_tol).max().item(),
                    block=(blocks / block_tol).max().item(),
                    lse=(lse_err / lse_tol).max().item() if finite.any() else 0.0)
    assert whole <= whole_tol, f"{what}out max error {whole:.3e} > {whole_tol:.3e}"
    over = rms > row_tol
    assert not over.any(), (f"{what}out: {int(over.sum())} rows past twice the low-precision RMS error plus two "
                            f"roundings, the worst {(rms / row_tol).max().item():.2f}x at row {over.nonzero()[0].tolist()}")
    over = blocks > block_tol
    assert not over.any(), (f"{what}out: {int(over.sum())} blocks of {BLOCK_ROWS} rows past twice the low-precision "
                            f"RMS error, the worst {(blocks / block_tol).max().item():.2f}x at "
                            f"(batch, block, head) {over.nonzero()[0].tolist()}")
    assert not lse.isnan().any(), f"{what}unwritten or NaN LSE elements"
    assert torch.equal(torch.isfinite(lse), finite), f"{what}LSE is -inf exactly where a row sees no key"
    if finite.any():
        assert (lse_err <= lse_tol).all(), (f"{what}lse error {lse_err.max().item():.3e} past its float32 rule "
                                            f"(worst ratio {(lse_err / lse_tol).max().item():.2f})")
