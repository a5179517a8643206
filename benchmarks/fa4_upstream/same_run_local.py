"""fa4_aot's local forward (sliding window, sinks, softcap) beside FA4 upstream's sm90
forward with the same (compile.py's ``local`` exports), timed in one process on the H200:
gpt-oss-like layers (head_dim 64, GQA 64:8, window 128 back, sinks) and Gemma-like ones
(head_dim 256 and 128, GQA 16:8, windows 1024 and 4096 back, softcap 50), bf16, 4k to
128k tokens a sequence (batch x seqlen = 128k tokens), interleaved rounds (the order turns
each round), do_bench 50/200 ms medians. TFLOP/s count only the keys each query sees
(4 * head_dim * heads * sum over queries of min(i, window) + 1). cuDNN (torch SDPA) takes
no window: not timed. The first round compares FA4's out and LSE with ours.

    PYTHONPATH=$PWD python benchmarks/fa4_upstream/same_run_local.py DIR ROUNDS OUT_JSON [LAYER ...]

Ours: fa4_aot.forward on DeviceArrays made once (a repeated call re-launches its packed
kernel), window_size=(window, 0), the query tiles per CTA by fa4_aot.policy; where two
are built (head_dim 64), also with one ("one_tile"). FA4: window (window, 0) at run time, its sinks, its
softcap score_mod (tanh.approx), pack_gqa, its interface's local tiles.
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402
import local_cells  # noqa: E402

TOKENS = 128 * 1024
SEQLENS = (4096, 16384, 65536, 131072)
# (name, head_dim, heads_q, heads_kv, window back, softcap, sinks)
LAYERS = [("gpt-oss", 64, 64, 8, 128, 0.0, True), ("gemma-d256-w1024", 256, 16, 8, 1024, 50.0, False),
          ("gemma-d256-w4096", 256, 16, 8, 4096, 50.0, False), ("gemma-d128-w1024", 128, 16, 8, 1024, 50.0, False),
          ("gemma-d128-w4096", 128, 16, 8, 4096, 50.0, False)]


def seen_keys(seqlen, window):
    """Keys the queries of a sequence see with a window of ``window`` back and 0 ahead."""
    full = min(seqlen, window + 1)
    return full * (full + 1) // 2 + (seqlen - full) * (window + 1)


def flops(layer, seqlen):
    _, d, hq, _, window, _, _ = layer
    return 4 * d * hq * (TOKENS // seqlen) * seen_keys(seqlen, window)


def setup(layer, seqlen, seed=0):
    _, d, hq, hkv, _, _, sinks = layer
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = TOKENS // seqlen
    t = {"q": torch.randn(b, seqlen, hq, d, device="cuda", dtype=torch.bfloat16, generator=g),
         "k": torch.randn(b, seqlen, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g),
         "v": torch.randn(b, seqlen, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g),
         "sink": torch.randn(hq, device="cuda", generator=g) if sinks else torch.full((hq,), -math.inf, device="cuda")}
    for who in ("ours", "fa4"):
        t[f"out_{who}"] = torch.empty_like(t["q"])
        t[f"lse_{who}"] = torch.empty(b, hq, seqlen, device="cuda")
    return t


def ours_launch(layer, t, library=None, q_tiles=None):
    import fa4_aot
    from fa4_aot.torch import as_device_array

    _, d, _, _, window, cap, sinks = layer
    arrays = [as_device_array(t[n]) for n in ("q", "k", "v", "out_ours", "lse_ours")]
    sink = as_device_array(t["sink"]) if sinks else None
    s = torch.cuda.current_stream().cuda_stream

    def ours():
        fa4_aot.forward(*arrays, window_size=(window, 0), softcap=cap, learnable_sink=sink, stream=s,
                        library=library, q_tiles=q_tiles)
    ours.keep = (arrays, sink)
    return ours


def fa4_launch(layer, t):
    _, d, hq, hkv, window, cap, _ = layer
    name = f"fa4_lfwd_d{d}{f'_g{hq // hkv}' if hq != hkv else ''}{f'_cap{int(cap)}' if cap else ''}"
    go = ffi.ex(name).launcher(t["q"], t["k"], t["v"], t["out_fa4"], t["lse_fa4"], 1 / math.sqrt(d), window, 0,
                               t["sink"], torch.cuda.current_stream().cuda_stream)
    go.name = name
    return go


def cell(layer, seqlen, r, res, bench):
    t = setup(layer, seqlen)
    makers = {"ours": lambda: ours_launch(layer, t), "fa4": lambda: fa4_launch(layer, t)}
    if two_tiles(layer):
        makers["one_tile"] = lambda: ours_launch(layer, t, q_tiles=1)

    def check(peers):
        t["out_fa4"].fill_(float("nan"))
        rc = peers["fa4"]()
        peers["ours"]()
        torch.cuda.synchronize()
        if rc:
            raise RuntimeError(f"{peers['fa4'].name}: launch returned {rc}")
        return {"max_abs_o": (t["out_fa4"].float() - t["out_ours"].float()).abs().max().item(),
                "max_abs_lse": (t["lse_fa4"] - t["lse_ours"]).abs().max().item()}

    local_cells.cell(f"{layer[0]}|{seqlen}", makers, check, flops(layer, seqlen), r, res, bench)


def two_tiles(layer):
    """Whether our local kernel takes two query tiles per CTA at the layer's head dim
    (built at head_dim 64): then also timed with one (q_tiles=1)."""
    return layer[1] == 64


if __name__ == "__main__":
    local_cells.main(sys.argv[1:], LAYERS, SEQLENS, cell, "TFLOP/s of the keys each query sees",
                     {"ours": "fa4_aot", "fa4": "FA4 upstream", "one_tile": "fa4_aot one tile"}, TOKENS)
