"""fa4_aot's local backward (sliding window, sinks and their gradient) beside FA4 upstream's
sm90 backward with the same (compile.py's ``local_bwd`` exports), timed in one process on
the H200: same_run_local.py's layers: gpt-oss-like (head_dim 64, GQA 64:8, window 128
back, sinks) and Gemma-like (head_dim 256 and 128, GQA 16:8, windows 1024 and 4096 back,
capped at 50, and uncapped), bf16, batch x seqlen = 128k
tokens, interleaved rounds (the order turns each round), do_bench 50/200 ms medians.
TFLOP/s count only the keys each query sees: 2.5 times the forward's (10 * head_dim *
heads * keys seen). cuDNN (torch SDPA) takes no window: not timed. The first round
compares FA4's gradients with ours.

    PYTHONPATH=$PWD python benchmarks/fa4_upstream/same_run_local_bwd.py DIR ROUNDS OUT_JSON [LAYER ...]

Ours: fa4_aot.backward on DeviceArrays made once, window_size=(window, 0), with sinks the
sinks' gradient too. FA4 as its interface runs it: the GQA dK / dV accumulators zeroed,
the preprocess, the main kernel (window at run time), the dQ postprocess (with sinks, the
sinks' gradient in it), the dK and dV postprocess.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402
import local_cells  # noqa: E402
from same_run_local import TOKENS, seen_keys  # noqa: E402

SEQLENS = (4096, 16384, 65536)
# (name, head_dim, heads_q, heads_kv, window back, sinks, softcap)
LAYERS = [("gpt-oss", 64, 64, 8, 128, True, 0.0)] + [
    (f"gemma-d{d}-w{w}{'' if cap else '-nocap'}", d, 16, 8, w, False, cap)
    for cap in (50.0, 0.0) for d in (256, 128) for w in (1024, 4096)]


def flops(layer, seqlen):
    _, d, hq, _, window, _, _ = layer
    return 10 * d * hq * (TOKENS // seqlen) * seen_keys(seqlen, window)


def setup(layer, seqlen, seed=0):
    """Inputs, our forward's out and lse (both backwards take them), and each peer's outputs."""
    import fa4_aot
    from fa4_aot.torch import flash_attn_fwd

    _, d, hq, hkv, window, sinks, cap = layer
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = TOKENS // seqlen
    mk = lambda s, h: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    t = {"q": mk(seqlen, hq), "k": mk(seqlen, hkv), "v": mk(seqlen, hkv), "dout": mk(seqlen, hq),
         "sink": torch.randn(hq, device="cuda", generator=g) if sinks else None}
    t["out"], t["lse"] = flash_attn_fwd(t["q"], t["k"], t["v"], window_size=(window, 0), learnable_sink=t["sink"],
                                        softcap=cap)
    for who in ("ours", "fa4"):
        t[f"dq_{who}"], t[f"dk_{who}"], t[f"dv_{who}"] = (torch.empty_like(t[n]) for n in ("q", "k", "v"))
        t[f"dsink_{who}"] = torch.empty(hq, device="cuda") if sinks else None
    size = fa4_aot.backward_workspace_bytes(b, seqlen, hq, d, local=True)
    t["workspace"] = torch.empty(size, dtype=torch.uint8, device="cuda")
    return t


def ours_launch(layer, t):
    import fa4_aot
    from fa4_aot.torch import as_device_array

    window, sinks, cap = layer[4], layer[5], layer[6]
    names = ("q", "k", "v", "out", "dout", "lse", "dq_ours", "dk_ours", "dv_ours", "workspace")
    arrays = [as_device_array(t[n]) for n in names]
    sink = {"learnable_sink": as_device_array(t["sink"]), "dsink": as_device_array(t["dsink_ours"])} if sinks else {}
    s = torch.cuda.current_stream().cuda_stream

    def ours():
        fa4_aot.backward(*arrays, window_size=(window, 0), softcap=cap, stream=s, **sink)
    ours.keep = (arrays, sink)
    return ours


def fa4_launch(layer, t):
    _, d, hq, hkv, window, sinks, cap = layer
    spec = ffi.spec["exports"]
    m = int(next(n for n in spec if n.startswith(f"fa4_pre_d{d}_m")).rsplit("_m", 1)[1])
    n_tile = int(next(n for n in spec if n.startswith(f"fa4_postkv_d{d}_n")).rsplit("_n", 1)[1])
    b, s = t["q"].shape[:2]
    sr, skr = -(-s // m) * m, -(-s // n_tile) * n_tile
    dpsum, lse2 = torch.empty(b, hq, sr, device="cuda"), torch.empty(b, hq, sr, device="cuda")
    dqacc = torch.empty(b, hq, sr * d, device="cuda")
    dkacc, dvacc = (torch.zeros(b, hkv, skr * d, device="cuda") for _ in range(2))
    scale, stream = 1 / math.sqrt(d), torch.cuda.current_stream().cuda_stream
    pre = ffi.ex(f"fa4_pre_d{d}_m{m}").launcher(t["out"], t["dout"], dpsum, t["lse"], lse2, dqacc, stream)
    main = ffi.ex(f"fa4_lbwd_d{d}_g{hq // hkv}{f'_cap{int(cap)}' if cap else ''}").launcher(t["q"], t["k"], t["v"], t["dout"], lse2, dpsum, dqacc,
                                                         dkacc, dvacc, scale, window, 0, stream)
    if sinks:
        post = ffi.ex(f"fa4_spost_d{d}_m{m}").launcher(dqacc, t["dq_fa4"], scale, dpsum, t["lse"], t["sink"],
                                                       t["dsink_fa4"], stream)
    else:
        post = ffi.ex(f"fa4_post_d{d}_m{m}").launcher(dqacc, t["dq_fa4"], scale, stream)
    post_k = ffi.ex(f"fa4_postkv_d{d}_n{n_tile}").launcher(dkacc, t["dk_fa4"], scale, stream)
    post_v = ffi.ex(f"fa4_postkv_d{d}_n{n_tile}").launcher(dvacc, t["dv_fa4"], 1.0, stream)

    def fa4():
        dkacc.zero_()  # its interface allocates them zeroed on every call
        dvacc.zero_()
        return pre() or main() or post() or post_k() or post_v()
    fa4.keep = (dpsum, lse2, dqacc, dkacc, dvacc, pre, main, post, post_k, post_v)
    return fa4


def cell(layer, seqlen, r, res, bench):
    t = setup(layer, seqlen)

    def check(peers):
        for n in ("dq", "dk", "dv"):
            t[f"{n}_fa4"].fill_(float("nan"))
        rc = peers["fa4"]()
        peers["ours"]()
        torch.cuda.synchronize()
        if rc:
            raise RuntimeError(f"FA4 launch returned {rc}")
        rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
        names = ("dq", "dk", "dv", "dsink") if layer[5] else ("dq", "dk", "dv")
        return {f"rel_{n}": rel(t[f"{n}_fa4"], t[f"{n}_ours"]) for n in names}

    makers = {"ours": lambda: ours_launch(layer, t), "fa4": lambda: fa4_launch(layer, t)}
    local_cells.cell(f"{layer[0]}|{seqlen}", makers, check, flops(layer, seqlen), r, res, bench)


if __name__ == "__main__":
    local_cells.main(sys.argv[1:], LAYERS, SEQLENS, cell, "Backward TFLOP/s of the keys each query sees",
                     {"ours": "fa4_aot", "fa4": "FA4 upstream"}, TOKENS)
