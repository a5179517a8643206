#!/usr/bin/env python3
"""How fast the memory reads a decode window's K and V in the orders a kernel could take
them, with no attention math: is windowed decode bounded by its access pattern?

gpt-oss's sliding layers (head_dim 64, 8 KV heads, window 128 back: 129 keys, batch 256,
32k caches) keep each token's 8 heads side by side, so one KV head's keys are 128-byte rows
1 KB apart. A Triton kernel sums the window's K and V with one program per

- ``head``: (sequence, KV head): 128-byte rows, as the decode kernels' items read today;
- ``pair``: (sequence, two KV heads): 256-byte rows;
- ``seq``: (sequence): the whole 1 KB of every token, contiguous;
- ``dense``: the same bytes as ``seq`` packed together (the window's bytes copied out).
- ``attend``: one program per (sequence, KV head) as ``head``, doing the decode's work: the
  group's 8 query rows (padded to 16) against each chunk's keys, the online softmax and
  P V, the output stored: what a plain Triton kernel of today's order reaches with the
  attention in it (its output checked against a float32 reference before the timing).

Each program reads the window's keys in chunks of ``--chunk`` keys. Timed by the
benchmarks' timer (``timing.bench``: the L2 cleared by a read before each call; a clear
by a write leaves dirty lines that a 35 us call pays to write back). Beside them, the
same-size copy: a contiguous copy whose read and write together are the window's bytes.
Figures: GB/s of the window's bytes (K and V), each case's median and range over the
rounds, interleaved, and the ratio to a 2 GiB copy (``bench_decode.copy_bandwidth`` and
``same_size_copy``, as the decode benchmarks).

    PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/experiments/window_gather.py [--rounds 5] [--chunk 32] [--out DIR]
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

import timing  # noqa: E402 (run with benchmarks/ on the path)
from bench_decode import copy_bandwidth, same_size_copy  # noqa: E402


@triton.jit
def window_sum(k_ptr, v_ptr, out_ptr, lengths_ptr, stride_b, stride_t, window,
               HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    per_seq = HEADS // GROUP
    b = pid // per_seq
    g = pid % per_seq
    end = tl.load(lengths_ptr + b)
    start = tl.maximum(end - window, 0)
    cols = tl.arange(0, GROUP * D)
    acc = tl.zeros((CHUNK, GROUP * D), dtype=tl.float32)
    base = b.to(tl.int64) * stride_b + g * GROUP * D
    for c in tl.range(start, end, CHUNK, num_stages=STAGES):
        keys = c + tl.arange(0, CHUNK)
        offs = base + keys.to(tl.int64)[:, None] * stride_t + cols[None, :]
        mask = (keys < end)[:, None]
        acc += tl.load(k_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def window_attend(q_ptr, k_ptr, v_ptr, out_ptr, lengths_ptr, stride_b, stride_t, window, scale_log2,
                  HEADS: tl.constexpr, GROUP_Q: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                  CHUNK: tl.constexpr, STAGES: tl.constexpr):
    """One token's GQA decode over the window of KV head ``pid % HEADS`` of sequence
    ``pid // HEADS``: q and out (batch, HEADS * GROUP_Q, D), query heads of a KV head
    adjacent; the rows past GROUP_Q are padding (tl.dot takes 16 at least)."""
    pid = tl.program_id(0)
    b = pid // HEADS
    h = pid % HEADS
    end = tl.load(lengths_ptr + b)
    start = tl.maximum(end - window, 0)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    q_rows = (b * HEADS + h) * GROUP_Q + rows
    q_mask = (rows < GROUP_Q)[:, None]
    q = tl.load(q_ptr + q_rows.to(tl.int64)[:, None] * D + cols[None, :], mask=q_mask, other=0.0)
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    base = b.to(tl.int64) * stride_b + h * D
    for c in tl.range(start, end, CHUNK, num_stages=STAGES):
        keys = c + tl.arange(0, CHUNK)
        in_window = keys < end
        offs = base + keys.to(tl.int64)[:, None] * stride_t + cols[None, :]
        k = tl.load(k_ptr + offs, mask=in_window[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(in_window[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=in_window[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(out_ptr + q_rows.to(tl.int64)[:, None] * D + cols[None, :], (acc / l[:, None]).to(q.dtype),
             mask=q_mask)


def attend_reference(q, k, v, lengths, window, group_q, dtype=torch.float32):
    """window_attend's output, the math done in ``dtype``: q (batch, heads_q, d), k and v
    (batch, keys, heads, d)."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b, end in enumerate(lengths.tolist()):
        kb, vb = (t[b, max(end - window, 0):end].to(dtype).transpose(0, 1) for t in (k, v))  # heads, keys, d
        kb, vb = (t.repeat_interleave(group_q, dim=0) for t in (kb, vb))
        s = torch.einsum("hd,hkd->hk", q[b].to(dtype), kb) / q.shape[-1] ** 0.5
        out[b] = torch.einsum("hk,hkd->hd", s.softmax(-1), vb)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--window", type=int, default=129)
    ap.add_argument("--chunk", type=int, default=32, help="keys a program loads at once (a power of two)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, d = 8, 64
    B, S, W = args.batch, args.keys, args.window
    k, v = (torch.randn(B, S, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    full = torch.full((B,), S, dtype=torch.int32, device="cuda")
    ragged = torch.randint(W, S + 1, (B,), dtype=torch.int32, device="cuda")
    kd, vd = (t[:, S - W:].contiguous() for t in (k, v))
    dense_len = torch.full((B,), W, dtype=torch.int32, device="cuda")
    window_bytes = B * W * heads * d * 2 * 2

    def stages(columns):
        """The loop's stages for chunks of ``columns`` wide rows of K and V: their loads wait in
        (stages - 1) shared-memory buffers, at most 4 stages and as many as 192 KB holds (a
        sequence's 1 KB rows at 128 keys: 1)."""
        return max(1, min(4, 1 + (192 << 10) // (args.chunk * columns * 2 * 2)))

    def launcher(kt, vt, lengths, group):
        out = torch.empty(B * heads // group, device="cuda")

        def run():
            window_sum[(B * heads // group,)](kt, vt, out, lengths, kt.stride(0), kt.stride(1), W,
                                              HEADS=heads, GROUP=group, D=d, CHUNK=args.chunk, STAGES=stages(group * d),
                                              num_warps=4)
        return run

    cases = {"head": launcher(k, v, full, 1), "pair": launcher(k, v, full, 2), "seq": launcher(k, v, full, 8),
             "head ragged": launcher(k, v, ragged, 1), "seq ragged": launcher(k, v, ragged, 8),
             "dense": launcher(kd, vd, dense_len, 8), "dense head": launcher(kd, vd, dense_len, 1)}
    group_q = 8  # gpt-oss: 64 query heads on 8 KV heads
    q = torch.randn(B, heads * group_q, d, device="cuda", dtype=torch.bfloat16)
    attended = torch.full_like(q, float("nan"))

    def attend():
        window_attend[(B * heads,)](q, k, v, attended, ragged, k.stride(0), k.stride(1), W,
                                    math.log2(math.e) / math.sqrt(d), HEADS=heads, GROUP_Q=group_q,
                                    ROWS=16, D=d, CHUNK=args.chunk, STAGES=stages(d), num_warps=4)
    attend()
    some = slice(0, min(B, 8))
    ref = attend_reference(q[some], k[some], v[some], ragged[some], W, group_q)
    err = (attended[some].float() - ref).abs().max().item()
    low = (attend_reference(q[some], k[some], v[some], ragged[some], W, group_q, torch.bfloat16).float()
           - ref).abs().max().item()
    print(f"attend: largest error {err:.2e} against float32 over {some.stop} sequences "
          f"(the same math in bf16 by torch: {low:.2e})")
    if err <= 2 * low:
        cases["attend"] = attend
    else:
        print("attend: wrong by more than twice that; not timed")
    cases["same-size copy"], _buffers = same_size_copy(window_bytes)  # read + write: the window's bytes
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    gbs = {name: [] for name in cases}
    copies = []
    for _ in range(args.rounds):
        copies.append(copy_bandwidth(timing.bench) / 1e9)
        for name, fn in cases.items():
            gbs[name].append(window_bytes / (timing.bench(fn) * 1e-3) / 1e9)
    copy = statistics.median(copies)
    print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  batch {B}  window {W} keys  "
          f"{window_bytes / 1e6:.1f} MB")
    print("| order | GB/s (median, range) | of the copy |\n|---|---|---|")
    rows = {}
    for name, xs in gbs.items():
        med = statistics.median(xs)
        rows[name] = {"median": med, "min": min(xs), "max": max(xs), "of_copy": med / copy}
        print(f"| {name} | {med:.0f} ({min(xs):.0f}-{max(xs):.0f}) | {med / copy:.2f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "window-gather.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
