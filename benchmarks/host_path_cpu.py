#!/usr/bin/env python3
"""The Python portion of fa4_aot's host path, on a machine without a GPU.

The driver calls are replaced by stubs that return success at once (a context, a
function, a launch that does nothing), so what is timed is fa4_aot's own Python: the
repeated-call fast paths of the raw API (``fa4_aot.forward`` with its DeviceArrays kept,
on an int stream) and of the torch adapter (``fa4_aot.torch.flash_attn_fwd`` with outputs
given), and the first call's Python in a fresh process (import; the manifest, the row,
the cubin's sha256, the checks and the packing of the first forward).
The GPU's figures (driver calls included) come from ``benchmarks/launch_overhead.py``.

Run from the repository root, with the built manifest and cubins in fa4_aot/:
    python benchmarks/host_path_cpu.py [--calls 20000] [--profile 15]
The torch figure needs torch (a CPU build will do: the stubs stand in for CUDA); the
stubbed ``Tensor.is_cuda`` and ``get_device`` are Python functions, slower than torch's
own, so that figure is a little high.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_CALL = r"""
import sys, time
sys.path.insert(0, "benchmarks")
start = time.perf_counter()
import fa4_aot
imported = time.perf_counter()
from host_path_cpu import stub_driver
stub_driver(load=True)
b, s, h, d = 1, 128, 2, 64
q, k, v, out = (fa4_aot.DeviceArray((1 << 32) + i * (1 << 20), (b, s, h, d), (s * h * d, h * d, d, 1), "bf16", 0)
                for i in range(4))
lse = fa4_aot.DeviceArray((1 << 32) + (4 << 20), (b, h, s), (h * s, s, 1), "fp32", 0)
stubbed = time.perf_counter()
fa4_aot.forward(q, k, v, out, lse, causal=True, stream=7)
done = time.perf_counter()
print(f"{(imported - start) * 1e3:.2f} {(done - stubbed) * 1e3:.2f}")
"""


def first_call(runs: int) -> tuple[float, float]:
    """Medians (ms) over fresh processes: ``import fa4_aot``; then the first
    ``fa4_aot.forward`` with the driver stubbed (the manifest, the row, the cubin read
    and its sha256 checked, the checks, the parameters packed; no module loaded)."""
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(out.stdout + out.stderr)
        times.append(tuple(float(x) for x in out.stdout.split()))
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def stub_driver(load: bool = False):
    """Every driver call the host path makes, answered at once; ``load``: a kernel's
    first use still reads its cubin and checks its sha256 (the module load is stubbed)."""
    import fa4_aot.launch.loader as loader
    from fa4_aot.launch import tma

    cu = loader.cu
    ok = cu.CUresult.CUDA_SUCCESS
    context = cu.CUcontext(7)
    cu.cuCtxGetCurrent = lambda: (ok, context)
    cu.cuCtxGetDevice = lambda: (ok, 0)
    cu.cuCtxGetId = lambda ctx: (ok, 1)
    cu.cuLaunchKernelEx = lambda config, fn, params, extra: (ok,)
    tma.encode = lambda recipe, ptr, *a: bytes(128)
    loader.KernelLibrary.arch = lambda self, device: "sm90a"
    loader.KernelLibrary.sm_count = lambda self, device: 132

    def functions(self, row, device, context=None):
        if load:
            self.manifest.cubin(row)
        return [object() for _ in row["launches"]]

    loader.KernelLibrary.functions = functions


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(200):
        fn()
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - start) / calls * 1e6)
    return min(best)


def _varlen_call(fa4_aot, base):
    """A serving prefill's varlen forward: 4 sequences, a new total of tokens each call, so
    every call takes the checked path (sizes its workspace, checks, packs)."""
    from fa4_aot import DeviceArray

    calls = iter(range(1 << 62))

    def packed(ptr, shape, dtype="bf16"):
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return DeviceArray(base + (ptr << 30), tuple(shape), tuple(strides), dtype, 0)

    def call():
        total = 4096 + next(calls) % 512
        q, k, v, out = (packed(i, (total, h, 128)) for i, h in enumerate((8, 2, 2, 8)))
        lse, cu = packed(4, (8, total), "fp32"), packed(5, (5,), "i32")
        workspace = packed(6, (fa4_aot.forward_varlen_workspace_bytes(4),), "u8")
        fa4_aot.forward_varlen(q, k, v, out, lse, cu, cu, 2048, 2048, causal=True, workspace=workspace, stream=7)
    return call


def _hook_paths(torch, b, s, h, d) -> dict:
    """The SDPA hook's two ops called as SDPA calls them, on the CPU key (SDPA itself picks
    no flash op on a CPU): the hook's Python from the dispatcher down, every call taken as on
    an sm_90 GPU (the capability and the built kernels stand in for a CUDA device's)."""
    if not hasattr(torch.nn.attention, "register_flash_attention_impl"):
        return {}
    import fa4_aot.torch.sdpa as hook

    decide = hook.fallback_reason
    hook.fallback_reason = lambda *a, capability, built, **kw: decide(*a, capability=(9, 0), built=hook._built(), **kw)
    hook.current_stream = lambda device: 7
    handle = hook.register_kernels("CPU")  # for as long as the calls below hold it
    q, k, v = (torch.empty(b, s, h, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    fwd = torch.ops.aten._scaled_dot_product_flash_attention.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    out, lse, cq, ck, mq, mk, seed, offset, _ = fwd(q, k, v, 0.0, True)
    dout = torch.empty_like(out)

    def forward():
        assert handle.library is not None
        return fwd(q, k, v, 0.0, True)

    def both():
        o, l, *_ = fwd(q, k, v, 0.0, True)
        return bwd(dout, q, k, v, o, l, cq, ck, mq, mk, 0.0, True, seed, offset)
    return {"SDPA hook: the flash op (repeat)": forward, "SDPA hook: the flash op and its backward (repeat)": both}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--fresh", type=int, default=5, help="fresh processes for the first call's figures")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's N costliest functions of each path")
    args = p.parse_args()
    imported, selected = first_call(args.fresh)
    print(f"fresh process, ms (median of {args.fresh}): import fa4_aot {imported:.1f} | "
          f"first forward, driver stubbed {selected:.1f}")

    stub_driver()
    import fa4_aot
    from fa4_aot import DeviceArray

    b, s, h, d = 1, 128, 2, 64
    stride = (s * h * d, h * d, d, 1)
    base = 1 << 32
    q, k, v, out = (DeviceArray(base + i * (1 << 20), (b, s, h, d), stride, "bf16", 0) for i in range(4))
    lse = DeviceArray(base + (4 << 20), (b, h, s), (h * s, s, 1), "fp32", 0)
    paths = {"raw fa4_aot.forward (DeviceArrays kept)": lambda: fa4_aot.forward(q, k, v, out, lse, stream=7),
             "raw fa4_aot.forward_varlen, a new total each call (the checked path)": _varlen_call(fa4_aot, base)}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        import fa4_aot.torch as fa4_torch

        torch.Tensor.is_cuda = property(lambda self: True)
        torch.Tensor.get_device = lambda self: 0
        import fa4_aot.torch.dense as torch_dense
        from fa4_aot.torch.tensors import DTYPES

        torch_dense.current_stream = lambda device: 7
        torch_dense.stream_of = lambda t: 7
        import fa4_aot.torch.autograd as torch_autograd
        torch_autograd.current_stream = lambda device: 7
        # the host's allocator aligns less than CUDA's: the pointers are rounded up (never read)
        torch_dense.as_device_array = lambda t: DeviceArray((t.data_ptr() + 255) // 256 * 256, tuple(t.shape),
                                                            tuple(t.stride()), DTYPES[t.dtype], 0)
        tq, tk, tv, tout = (torch.empty(b, s, h, d, dtype=torch.bfloat16) for _ in range(4))
        tlse = torch.empty(b, h, s)
        paths["fa4_aot.torch.flash_attn_fwd (outputs given)"] = (
            lambda: fa4_torch.flash_attn_fwd(tq, tk, tv, out=tout, lse=tlse))
        # a training step's attention: autograd forward and backward, every call on the
        # checked path (the kept launches dropped each step: the host's allocator reuses
        # addresses by luck, so otherwise some steps repeat and the figure is bimodal)
        gq, gk, gv = (torch.randn(b, s, 8, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        library = fa4_aot.default_library()

        def step():
            library._plans.clear()
            out = fa4_torch.flash_attn_func(gq, gk, gv, causal=True)
            out.backward(torch.ones_like(out))
        paths["fa4_aot.torch.flash_attn_func forward + backward (checked path)"] = step
        hook = _hook_paths(torch, b, s, h, d)
        if hook:
            paths.update(hook)
    for name, fn in paths.items():
        print(f"{name}: {per_call_us(fn, args.calls):.2f} us a call (Python only, driver stubbed)")
        if args.profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.runcall(per_call_us, fn, args.calls, 1)
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
