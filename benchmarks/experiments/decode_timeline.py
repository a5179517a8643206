#!/usr/bin/env python3
"""PROBE: the timeline of one gpt-oss windowed decode call on the span-narrow kernel built
with docs/history/2026-12-07-decode-narrow-timeline-probe.patch (the no-math probe) or
2026-12-07-decode-narrow-timeline.patch (the kernel's own math), whose LSE rows hold, per
item, eight 32-bit words: the consumer's start, its first K tile's
arrival, its tiles' end, its epilogue's end (%globaltimer_lo, ns), the CTA, the
producer's first TMA of the item, the CTA's walk entry (its first item only) and the SM).
Where a call's fixed cost goes (docs/design.md, "Local attention, sinks, softcap":
windowed decode): the CTAs' start, the first tiles' latency, the steady items, the tail.

    python benchmarks/experiments/decode_timeline.py DIR [--batch 256] [--window 127] [--keys 32768]
        [--rounds 5] [--clear read|none] [--out FILE]

DIR: a library folder holding such a decode.sm90a.bf16.d64.local.narrow row (trimmed
as bench_decode_local's --kernels take them). Event times of the same call beside it.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fa4_aot  # noqa: E402
import timing  # noqa: E402
from bench_decode_local import LAYERS, setup, window_bytes  # noqa: E402

SLOTS = ("start", "first_k", "tiles_end", "end", "cta", "issue", "walk_entry", "smid")


def since(t, ref):
    """Nanoseconds from ``ref`` to ``t`` (32-bit timer words, wrapping; signed: within 2 s)."""
    return (t.astype(np.int64) - ref + (1 << 31)) % (1 << 32) - (1 << 31)


def one_call(fn, lse, clear):
    if clear == "read":
        timing.clear_l2()
    fn()
    torch.cuda.synchronize()
    return lse.view(torch.int32).cpu().numpy()


def analyse(words, batch, hkv, group):
    """Per-item slots (batch x KV heads x 8) into the call's phases, in microseconds."""
    items = words[:, :, 0].reshape(batch, hkv, group)[:, :, :8].reshape(batch * hkv, 8).astype(np.int64) & 0xFFFFFFFF
    first = items[:, 6] != 0  # each CTA's first item: the one holding its walk entry
    ref = int(items[first, 6].min())
    t = {name: since(items[:, i], ref) / 1e3 for i, name in enumerate(SLOTS) if name not in ("cta", "smid")}
    q = lambda x: [round(float(np.percentile(x, p)), 2) for p in (0, 50, 90, 100)]  # noqa: E731
    ctas, cta_of = np.unique(items[:, 4], return_inverse=True)
    last_end = np.full(len(ctas), -np.inf)
    np.maximum.at(last_end, cta_of, t["end"])
    return {
        "ctas": len(ctas), "items": len(items),
        "walk_entry (us from the first CTA's, min/median/p90/max)": q(t["walk_entry"][first]),
        "first item: entry to first TMA": q(t["issue"][first] - t["walk_entry"][first]),
        "first item: first TMA to K arrived": q(t["first_k"][first] - t["issue"][first]),
        "other items: TMA issue to K arrived": q(t["first_k"][~first] - t["issue"][~first]),
        "other items: consumer waits for K": q(t["first_k"][~first] - t["start"][~first]),
        "items: tiles (start to tiles end)": q(t["tiles_end"] - t["start"]),
        "items: epilogue": q(t["end"] - t["tiles_end"]),
        "CTAs' last item end": q(last_end),
        "span (first entry to last end, us)": round(float(t["end"].max()), 2),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=127)
    ap.add_argument("--keys", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clear", choices=("read", "none"), default="read")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    name, _, hq, hkv, d, _, cap, sinks = LAYERS[0]
    layer = (name, args.batch, hq, hkv, d, args.window, cap, sinks)
    lengths = torch.full((args.batch,), args.keys, dtype=torch.int32)
    ours_with, _, keep = setup(layer, args.keys, False, lengths)
    library = fa4_aot.KernelLibrary(args.folder)
    fn, lse = ours_with(library), keep[7]
    for _ in range(5):
        fn()
    rounds = [analyse(one_call(fn, lse, args.clear), args.batch, hkv, hq // hkv) for _ in range(args.rounds)]
    ms = timing.bench(fn, clear=args.clear)
    nbytes = window_bytes(layer, lengths)
    result = {"gpu": torch.cuda.get_device_name(), "args": {k: str(v) for k, v in vars(args).items()},
              "event_us": round(ms * 1e3, 2), "event_GBps": round(nbytes / (ms * 1e-3) / 1e9),
              "bytes": nbytes, "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        print(f"{key}: " + " | ".join(str(v) for v in values))
    spans = [r["span (first entry to last end, us)"] for r in rounds]
    print(f"in-kernel GB/s over the span: {nbytes / (statistics.median(spans) * 1e-6) / 1e9:.0f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
