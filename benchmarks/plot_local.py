#!/usr/bin/env python3
"""The plot of same_run_local.py's (or, ``--backward``, same_run_local_bwd.py's) results,
from their JSON (no GPU: only matplotlib): time per sequence against sequence length for
each fixed-window layer, fa4_aot beside FA4 upstream (same process), on log axes: a local
kernel's time grows with the sequence (slope 1), not its square.

    python benchmarks/plot_local.py benchmarks/results/2026-12-04-fa4-same-process-local.json
    python benchmarks/plot_local.py --backward benchmarks/results/2026-12-03-fa4-same-process-local-bwd.json

Writes the plot beside the JSON (.png)."""

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "fa4_upstream"))


def main(path, backward=False):
    # the layers and FLOP model the figures were taken with
    if backward:
        from same_run_local_bwd import LAYERS, flops
    else:
        from same_run_local import LAYERS, flops
    res = json.loads(Path(path).read_text())
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, layer in enumerate(LAYERS):
        for peer, style in (("ours", "-o"), ("fa4", "--^")):
            points = []
            for key, rates in res["flops_per_s"].items():
                name, seqlen, who = key.split("|")
                if name == layer[0] and who == peer:
                    batch = res["tokens"] // int(seqlen)
                    # time of one sequence: the batch's time over its sequences
                    points.append((int(seqlen), flops(layer, int(seqlen)) / statistics.median(rates) / batch * 1e3))
            points.sort()
            if points:
                ax.plot(*zip(*points), style, color=f"C{i}", label=f"{layer[0]} {'fa4_aot' if peer == 'ours' else 'FA4'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    what = "backward" if backward else "forward"
    ax.set_ylabel(f"{what} time per sequence, ms (all heads)")
    ax.set_title(f"local {what}, bf16, {res['gpu']}: fixed windows (gpt-oss 128 + sinks; Gemma 1024 / 4096, "
                 f"softcap 50{' and none' if backward else ''})\nmedian over rounds, FA4 upstream in the same process",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main(sys.argv[-1], backward="--backward" in sys.argv[1:-1])
