"""gpt-oss's local backward (128k tokens, GQA 64:8, d64, window 128, sinks) with the
dQ accumulator cleared by the preprocess (the policy before: first_write off past 4096 keys)
against first shares stored (first_write on), one process, interleaved rounds; the gradients
compared. Dense at 16k and 64k a sequence, and varlen (4 x 16k, 4 x 8k, 8 x 4k). PYTHONPATH=$PWD python benchmarks/experiments/local_first_write_ab.py ROUNDS OUT_JSON"""
import json
import sys

import torch
import triton.testing

import fa4_aot
import fa4_aot.policy as policy
from fa4_aot.torch import as_device_array, flash_attn_fwd, flash_attn_varlen_fwd

TOKENS, D, HQ, HKV, WINDOW = 131072, 64, 64, 8, 128
VARLEN = [16384] * 4 + [8192] * 4 + [4096] * 8
ORIGINAL = policy.first_write_dq


def seq_flops(seqlen):
    full = min(seqlen, WINDOW + 1)
    seen = full * (full + 1) // 2 + (seqlen - full) * (WINDOW + 1)
    return 2.5 * 4 * D * HQ * seen


def flops(seqlen):
    return seq_flops(seqlen) * (TOKENS // seqlen) if seqlen else sum(seq_flops(n) for n in VARLEN)


def dense_case(seqlen, g, s):
    """(the dense backward as a closure, its gradients, the tensors behind its arrays)."""
    b = TOKENS // seqlen
    mk = lambda h: torch.randn(b, seqlen, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(HQ), mk(HKV), mk(HKV), mk(HQ)
    sink = torch.randn(HQ, device="cuda", generator=g)
    out, lse = flash_attn_fwd(q, k, v, window_size=(WINDOW, 0), learnable_sink=sink)
    ws = torch.empty(fa4_aot.backward_workspace_bytes(b, seqlen, HQ, D, local=True), dtype=torch.uint8,
                     device="cuda")
    grads = [torch.empty_like(t) for t in (q, k, v)] + [torch.empty(HQ, device="cuda")]
    arrays = [as_device_array(t) for t in (q, k, v, out, dout, lse, *grads[:3], ws)]
    extra = {"learnable_sink": as_device_array(sink), "dsink": as_device_array(grads[3])}
    keep = (q, k, v, dout, sink, out, lse, ws)
    return (lambda: fa4_aot.backward(*arrays, window_size=(WINDOW, 0), stream=s, **extra)), grads, keep


def varlen_case(g, s):
    """varlen_case: the varlen backward over VARLEN's sequences."""
    cu = torch.tensor([0] + VARLEN, device="cuda").cumsum(0).to(torch.int32)
    mk = lambda h: torch.randn(TOKENS, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = mk(HQ), mk(HKV), mk(HKV), mk(HQ)
    sink = torch.randn(HQ, device="cuda", generator=g)
    mx = max(VARLEN)
    out, lse = flash_attn_varlen_fwd(q, k, v, cu, cu, mx, mx, window_size=(WINDOW, 0), learnable_sink=sink)
    ws = torch.empty(fa4_aot.backward_varlen_workspace_bytes(TOKENS, len(VARLEN), HQ, D, local=True),
                     dtype=torch.uint8, device="cuda")
    grads = [torch.empty_like(t) for t in (q, k, v)] + [torch.empty(HQ, device="cuda")]
    arrays = [as_device_array(t) for t in (q, k, v, out, dout, lse, *grads[:3], cu, cu)]
    space = as_device_array(ws)
    extra = {"learnable_sink": as_device_array(sink), "dsink": as_device_array(grads[3])}
    keep = (q, k, v, dout, sink, out, lse, ws, cu)
    return (lambda: fa4_aot.backward_varlen(*arrays, mx, mx, space, window_size=(WINDOW, 0), stream=s, **extra)), \
        grads, keep


def main(rounds, out_json):
    res = {"gpu": torch.cuda.get_device_name(), "tflops": {}, "rel": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.cuda.current_stream().cuda_stream
    for seqlen in (16384, 65536, 0):  # 0: varlen
        fns, grads, keep = {}, {}, []
        for name, fw in (("cleared", False), ("first_write", True)):
            policy.first_write_dq = (lambda *a, fw=fw: fw)
            g.manual_seed(seqlen)  # the same inputs for both
            fns[name], grads[name], kept = dense_case(seqlen, g, s) if seqlen else varlen_case(g, s)
            keep.append(kept)
            fns[name]()  # the launch cached under its arrays, with this first_write
            torch.cuda.synchronize()
        policy.first_write_dq = ORIGINAL
        res["rel"][str(seqlen)] = [((a.float() - c.float()).abs().max() / c.float().abs().max()).item()
                                   for a, c in zip(grads["first_write"], grads["cleared"])]
        for r in range(rounds):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            line = []
            for name in order:
                ms = triton.testing.do_bench(fns[name], warmup=50, rep=200, return_mode="median")
                res["tflops"].setdefault(f"{seqlen}|{name}", []).append(flops(seqlen) / ms / 1e9)
                line.append(f"{name} {flops(seqlen) / ms / 1e9:.0f}")
            print(f"r{r} {seqlen}: " + "  ".join(line), flush=True)
        print(seqlen, "first_write vs cleared, max rel:", [f"{x:.1e}" for x in res["rel"][str(seqlen)]], flush=True)
    for key, vals in res["tflops"].items():
        print(f"{key}: median {sorted(vals)[len(vals) // 2]:.0f} ({min(vals):.0f}-{max(vals):.0f})")
    json.dump(res, open(out_json, "w"), indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
