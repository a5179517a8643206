#!/usr/bin/env python3
"""The plots of bench_attention.py's results, from their JSON (no GPU, no torch: only
matplotlib, the ``bench`` extra), so a result taken where matplotlib is missing is drawn
elsewhere.

    python benchmarks/plot_attention.py benchmarks/results/fwd-bf16.json [more.json ...]

Writes each JSON's plot beside it (the same name, .png): TFLOP/s against seqlen, one panel
per head dim, full (solid) and causal (dashed) attention; the title names the direction,
the dtype, the GPU, the date, the shapes and the rounds, as the JSON records them.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (row key, label, marker, colour) per direction, drawn where the rows have figures
SERIES = {
    "forward": (("tflops", "fa4_aot", "o", "C0"), ("cudnn_tflops", "cuDNN", "s", "C1"),
                ("fa4_upstream_tflops", "FA4 upstream", "^", "C2")),
    "backward": (("tflops", "fa4_aot", "o", "C0"), ("det_tflops", "fa4_aot deterministic", "D", "C3"),
                 ("cudnn_tflops", "cuDNN", "s", "C1"), ("fa4_upstream_tflops", "FA4 upstream", "^", "C2"),
                 ("fa4_upstream_det_tflops", "FA4 upstream deterministic", "v", "C4")),
}


def title(result: dict) -> str:
    return (f"fa4_aot {result['direction']}, {result['dtype']}, {result['device']}, {result['date']}\n"
            f"batch x seqlen = 16384 tokens, heads x head_dim = 2048, seqlen_q = seqlen_k "
            f"(median of {result['rounds']} round(s); FA4 upstream: baselines file, another day)")


def render(result: dict, path: Path) -> None:
    rows, mm = result["rows"], result["matmul_tflops"]
    dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 4.0), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], dims):
        for causal, style in ((False, "-"), (True, "--")):
            sel = [r for r in rows if r["head_dim"] == d and r["causal"] == causal]
            tag = "causal" if causal else "full"
            for key, label, marker, colour in SERIES[result["direction"]]:
                points = [(r["seqlen"], r[key]) for r in sel if r.get(key)]
                if points:
                    ax.plot(*zip(*points), marker + style, color=colour, label=f"{label} {tag}")
        ax.axhline(mm, color="gray", lw=0.8, label="bf16 matmul")
        ax.set_xscale("log", base=2)
        ax.set_title(f"head_dim {d}")
        ax.set_xlabel("seqlen")
    axes[0][0].set_ylabel("TFLOP/s")
    legend = {}  # every panel's series, once each (not every head dim has every peer)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    axes[0][-1].legend(legend.values(), legend.keys(), fontsize=6)
    fig.suptitle(title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    for name in paths:
        path = Path(name)
        render(json.loads(path.read_text()), path.with_suffix(".png"))
        print(path.with_suffix(".png"))


if __name__ == "__main__":
    main(sys.argv[1:])
