"""What the same-process local benchmarks share (same_run_local.py, the forward;
same_run_local_bwd.py, the backward): a cell's peers made (FA4's may be refused: its
column is then missing), the first round's check of FA4's results against ours, the
peers timed in turns, the table of TFLOP/s with each peer's ratio to ours, and the run
over layers x sequence lengths."""
import sys
from pathlib import Path

import torch

import ffi
from rounds import finish, note, run_rounds, summary, time_round


def cell(key, makers, check, work, r, res, bench):
    """One cell's round: ``makers`` {peer: () -> launcher} ("ours" first), ``check(peers)``
    -> {what: difference} run once (round 0) where ours and FA4's both exist, ``work``
    the FLOPs a launch does."""
    peers = {}
    for name, make in makers.items():
        if name == "ours":
            peers[name] = make()
            continue
        try:
            peers[name] = make()
        except Exception as e:  # noqa: BLE001 (this peer's column of the cell is missing)
            note(res, f"{key}|{name}", e)
    if r == 0 and "fa4" in peers:
        try:
            res["checks"][key] = check(peers)
            print(f"check {key}: " + " ".join(f"{n} {x:.2e}" for n, x in res["checks"][key].items()), flush=True)
        except Exception as e:  # noqa: BLE001
            note(res, f"{key}|check", e)
    figures = time_round(key, peers, r, res, bench, ("flops_per_s", lambda ms: work / (ms * 1e-3)))
    print(f"r{r} {key}: " + " ".join(f"{name} {x / 1e12:.0f}" for name, x in figures.items()) + " TFLOP/s",
          flush=True)


def table(res, keys, title, peers, columns=("layer", "seqlen")):
    """Median TFLOP/s of ``peers`` ({name: column title}, "ours" first) per cell, and
    ours over each other peer's; a cell's key is its ``columns``' values joined by "|"."""
    f = res["flops_per_s"]
    others = [p for p in peers if p != "ours"]
    lines = [f"{title} (median over rounds, range in brackets)", "",
             "| " + " | ".join(columns) + " | " + " | ".join(peers.values()) + " | "
             + " | ".join(f"ours / {peers[p]}" for p in others) + " |",
             "|" + "---|" * (len(columns) + len(peers) + len(others))]
    for key in keys:
        cells = {p: summary(f, f"{key}|{p}", 1e12, 0) for p in peers}
        lines.append("| " + " | ".join(key.split("|")) + " | "
                     + " | ".join(f"{x:.0f}{rng}" for x, rng in cells.values()) + " | "
                     + " | ".join(f"{cells['ours'][0] / cells[p][0]:.3f}" for p in others) + " |")
    return "\n".join(lines)


def main(argv, layers, seqlens, run_cell, title, peers, tokens):
    """``argv``: FA4's export folder, rounds, the JSON to write, then optionally the names
    of the layers to run (default: all). ``run_cell(layer, seqlen, r, res, bench)`` for
    every layer x seqlen, interleaved rounds, do_bench 50/200 ms medians."""
    import triton.testing

    folder, rounds, out_json = Path(argv[0]), int(argv[1]), argv[2]
    spec = ffi.open_dir(folder)
    torch.empty(1, device="cuda")
    bench = lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")  # noqa: E731
    res = {"flops_per_s": {}, "checks": {}, "errors": {}, "fa4": spec.get("sources", ""),
           "fa4_refused": spec.get("refused", {}), "gpu": torch.cuda.get_device_name(), "tokens": tokens}
    chosen = set(argv[3:])
    cells = [(layer, s) for layer in layers for s in seqlens if not chosen or layer[0] in chosen]
    run_rounds(res, out_json, rounds, cells, lambda c, r: run_cell(*c, r, res, bench), lambda c: f"{c[0][0]}|{c[1]}")
    finish(res, out_json, table(res, [f"{layer[0]}|{s}" for layer, s in cells], title, peers))


if __name__ == "__main__":
    sys.exit("a module of same_run_local.py and same_run_local_bwd.py")
