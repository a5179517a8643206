"""The local forward's tile shapes, measured: fa4_aot's local kernels from several build
folders (each a tile shape, built with fwd/config.py's LOCAL_TILES changed) beside FA4
upstream's, on same_run_local.py's gpt-oss and Gemma head_dim 256 cells, plus the head_dim
256 kernel without softcap (what the cap costs), interleaved rounds.

    PYTHONPATH=$PWD python benchmarks/experiments/local_tiles.py FA4_DIR ROUNDS OUT_JSON NAME=DIR[:q1|:q2] ...

FA4_DIR "-": no FA4 column.

``:q1``, ``:q2``: that library's kernels launched with q_tiles 1 or 2. Round 0 prints each library's largest difference from the first's out.
``LAYERS`` (environment, comma-separated names): only those layers; ``SEQLENS`` likewise the
sequence lengths (default 16384,131072).
"""
import os
import sys

sys.path.insert(0, "benchmarks/fa4_upstream")
import torch  # noqa: E402

import ffi  # noqa: E402
import same_run_local as srl  # noqa: E402
from rounds import finish, note, summary, time_round  # noqa: E402

SEQLENS = tuple(int(x) for x in os.environ.get("SEQLENS", "16384,131072").split(","))
NO_CAP = ("gemma-d256-w1024-nocap", 256, 16, 8, 1024, 0.0, False)
# windows between gpt-oss's and Gemma's, for the local two-tile policy
WINDOWS = [(f"d{d}-w{w}", d, hq, hkv, w, cap, sinks) for d, hq, hkv, cap, sinks in ((64, 64, 8, 0.0, True),
                                                                                  (128, 16, 8, 50.0, False))
           for w in (128, 256, 512)]


def main(argv):
    import triton.testing
    from fa4_aot.launch.loader import KernelLibrary

    fa4_dir, rounds, out_json = argv[0], int(argv[1]), argv[2]
    libs = {}
    for arg in argv[3:]:
        name, path = arg.split("=")
        path, _, flag = path.partition(":")
        libs[name] = (KernelLibrary(path), int(flag[1:]) if flag else None)
    if fa4_dir != "-":  # "-": no FA4 column
        ffi.open_dir(fa4_dir)
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"flops_per_s": {}, "errors": {}, "libraries": argv[3:], "gpu": torch.cuda.get_device_name()}
    layers = [*srl.LAYERS, NO_CAP, *WINDOWS]
    if os.environ.get("LAYERS"):
        layers = [x for x in layers if x[0] in os.environ["LAYERS"].split(",")]
    keys = []
    for r in range(rounds):
        for layer in layers:
            for seqlen in SEQLENS:
                key = f"{layer[0]}|{seqlen}"
                keys += [key] if r == 0 else []
                t = srl.setup(layer, seqlen)
                peers = {}
                for name, (lib, q_tiles) in libs.items():
                    if lib.manifest.built(kind="fwd", arch="sm90a", dtype="bf16", head_dim=layer[1], causal=False,
                                          local=True, softcap=layer[5] > 0, q_tiles=q_tiles or 1):
                        peers[name] = srl.ours_launch(layer, t, lib, q_tiles)
                if r == 0:
                    first = None
                    for name in list(peers):
                        t["out_ours"].fill_(float("nan"))
                        peers[name]()
                        torch.cuda.synchronize()
                        if first is None:
                            first = t["out_ours"].clone()
                        diff = (t["out_ours"].float() - first.float()).abs().max().item()
                        res.setdefault("diffs", {})[f"{key}|{name}"] = diff
                        print(f"{key} {name}: max|out - first's| {diff:.3e}", flush=True)
                if layer in srl.LAYERS and fa4_dir != "-":
                    try:
                        peers["fa4"] = srl.fa4_launch(layer, t)
                    except Exception as e:  # noqa: BLE001
                        note(res, f"{key}|fa4", e)
                work = srl.flops(layer, seqlen)
                figures = time_round(key, peers, r, res, bench, ("flops_per_s", lambda ms: work / (ms * 1e-3)))
                print(f"r{r} {key}: " + " ".join(f"{n} {x / 1e12:.0f}" for n, x in figures.items()), flush=True)
                del t
                torch.cuda.empty_cache()
    names = list(libs) + ["fa4"]
    lines = ["| cell | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key in keys:
        cells = [summary(res["flops_per_s"], f"{key}|{n}", 1e12, 0) for n in names]
        lines.append(f"| {key} | " + " | ".join(f"{m:.0f}{rng}" for m, rng in cells) + " |")
    finish(res, out_json, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
