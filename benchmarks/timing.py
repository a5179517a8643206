"""The benchmarks' timer: the median of CUDA-event timings of single calls, the L2 cleared
before each by a read.

``triton.testing.do_bench`` clears the L2 by zeroing 256 MB: the timed call then starts
with the L2 full of dirty lines and pays their write-back (about 50 MB, some 12 us at
4 TB/s) out of its own bandwidth. A 1 ms copy hardly feels that; a 70 us decode loses
a seventh of its figure to it (docs/design.md, "Where the figures are"). Here the
L2 is cleared by summing 256 MB instead: it is left full of clean lines of other data,
as after the weight-reading matmuls that come before attention in a model. Otherwise
the same method as do_bench: a short estimate, ``warmup`` ms of calls, then ``rep`` ms of
timed calls, each between two events after a clear.
"""

import statistics

import torch

_CLEAR = {}
MODE = {"clear": "read"}  # how the L2 is cleared before each timed call: "read" or "zero" (do_bench)


def add_argument(parser):
    """The benchmarks' --clear-l2 (read: this module's timer; zero: triton's do_bench)."""
    parser.add_argument("--clear-l2", choices=("read", "zero"), default=MODE["clear"],
                        help="clear the L2 before each timed call by a read of 256 MB (clean lines) or by "
                        "do_bench's zeroing (dirty lines the call writes back)")


def configure(args):
    MODE["clear"] = args.clear_l2


def clear_l2():
    """Replace the L2's contents by clean lines: a read of 256 MB (the L2 holds 50-60 MB)."""
    device = torch.cuda.current_device()
    if device not in _CLEAR:
        _CLEAR[device] = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    _CLEAR[device].sum()


def bench(fn, warmup=50, rep=200, clear=None):
    """Median milliseconds of ``fn()`` (its launches only), the L2 cleared first as ``clear``
    says (default MODE's): "read", "zero" (do_bench itself) or "none" (the last call's
    lines left)."""
    clear = clear or MODE["clear"]
    if clear == "zero":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    clear_l2_if = clear_l2 if clear == "read" else (lambda: None)
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        clear_l2_if()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end) / 5
    n_warmup, n_rep = max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for s, e in zip(starts, ends):
        clear_l2_if()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def host_us(fn, steps: int) -> float:
    """The median over ``steps`` calls of one call's host time (us), the GPU idle at each
    start (its synchronize untimed): what a call costs the issuing thread."""
    import time

    host = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(host) * 1e6


def host_blocks(fns: dict, blocks: int, steps: int) -> dict:
    """Host time in turns: ``blocks`` blocks, in each every fn of ``fns`` (name -> callable)
    timed over ``steps`` calls (host_us), in alternating order from block to block (the
    host's speed drifts between seconds, so fns compare within a block); name -> the
    blocks' figures."""
    figures = {name: [] for name in fns}
    for block in range(blocks):
        for name in (list(fns) if block % 2 == 0 else list(reversed(fns))):
            figures[name].append(host_us(fns[name], steps))
    return figures
