"""CPU check of compile.py's exports and the same-run scripts' FA4 arguments, no GPU:

    python benchmarks/fa4_upstream/check_plumbing.py DIR

1. each export's argument kinds against its header's wrapper (names and order);
2. ffi.py's ctypes structs against the header's C structs (sizes and field offsets, by
   gcc, where gcc and the CUDA headers are here);
3. same_run_varlen.py's, same_run_decode.py's and same_run_gqa.py's FA4 calls built on CPU tensors with the
   library mocked (ffi.ex packs each call's real argument structs, launches nothing):
   every export named exists, every tensor fits its struct, and the shapes FA4's
   interface would make (padded rows, accumulators, LSE layouts) hold;
4. the scripts' tables from made-up figures.
"""
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "."); sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

import ffi  # noqa: E402

D = Path(sys.argv[1] if len(sys.argv) > 1 else "build/fa4")
spec = json.loads((D / "spec.json").read_text())
ffi.spec = spec
fails = []


def check(ok, what):
    if not ok:
        fails.append(what)
        print("FAIL", what)


def header_params(name):
    h = (D / f"{name}.h").read_text()
    m = re.search(r"cute_dsl_" + name + r"_wrapper\(" + name + r"_Kernel_Module_t \*module, (.*?)\) \{", h, re.S)
    params = [p.strip() for p in m.group(1).split(",")]
    return [p.split()[-1].lstrip("*") for p in params], params


# 1. kinds against the wrapper's parameters
for name, s in spec["exports"].items():
    names, params = header_params(name)
    want = [k[2:] if k.startswith("t:") else None for k in s["args"]]
    check(len(names) == len(want), f"{name}: {len(names)} wrapper params, {len(want)} kinds")
    for kind, w, n, p in zip(s["args"], want, names, params):
        if w is not None:
            check(w == n and "_Tensor_" in p, f"{name}: kind {kind} vs param {p}")
        elif kind == "f32":
            check(p.startswith("float "), f"{name}: f32 vs {p}")
        elif kind == "stream":
            check(p.startswith("cudaStream_t "), f"{name}: stream vs {p}")
print(f"1. {len(spec['exports'])} exports: kinds match their wrappers")

# 2. struct layouts by gcc
inc = "/usr/local/cuda/include"
if os.path.exists(f"{inc}/cuda_runtime.h") and subprocess.run(["which", "gcc"], capture_output=True).returncode == 0:
    with tempfile.TemporaryDirectory() as tmp:
        # a parameter named do (dO) is a C keyword: renamed for this check only
        lines = ["#include <stddef.h>", "#include <cuda_runtime.h>", "#define do do_"]
        lines += [f'#include "{D.resolve()}/{n}.h"' for n in spec["exports"]]
        lines.append("int main(void) {")
        rows = []
        for name, s in spec["exports"].items():
            for t, (ns, nst) in s["tensors"].items():
                ty = f"{name}_Tensor_{t}_t"
                sh = f"offsetof({ty}, dynamic_shapes)" if ns else "0"
                st = f"offsetof({ty}, dynamic_strides)" if nst else "0"
                lines.append(f'printf("%zu %zu %zu\\n", sizeof({ty}), (size_t){sh}, (size_t){st});')
                rows.append((name, t, ns, nst))
        lines.append("return 0; }")
        Path(tmp, "l.c").write_text("\n".join(lines))
        r = subprocess.run(["gcc", "-w", f"-I{inc}", "-o", f"{tmp}/l", f"{tmp}/l.c"], capture_output=True, text=True)
        check(r.returncode == 0, f"gcc: {r.stderr[:300]}")
        if r.returncode == 0:
            out = subprocess.run([f"{tmp}/l"], capture_output=True, text=True).stdout.split("\n")
            for (name, t, ns, nst), line in zip(rows, out):
                size, o_sh, o_st = map(int, line.split())
                st = ffi.struct(ns, nst)
                got = (ctypes.sizeof(st), st.shapes.offset if ns else 0, st.strides.offset if nst else 0)
                check(got == (size, o_sh, o_st), f"{name}.{t}: ctypes {got} vs C {(size, o_sh, o_st)}")
            print(f"2. {len(rows)} tensor structs: ctypes layouts match gcc's")
else:
    print("2. skipped (no gcc or CUDA headers)")


# 3. the scripts' FA4 calls with the library mocked
class Mock(ffi.Export):
    def __init__(self, name):  # the spec's fields, no library
        s = spec["exports"][name]
        self.name, self.kinds, self.tensors = name, s["args"], s["tensors"]
        self.fn = lambda arr, n: None


calls = []


def mock_ex(name):
    check(name in spec["exports"], f"export {name} missing")
    e = Mock(name)
    real = e.launcher

    def launcher(*values):
        check(len(values) == len(e.kinds), f"{name}: {len(values)} values for {len(e.kinds)} kinds")
        calls.append((name, values))
        return real(*values)
    e.launcher = launcher
    return e


ffi.ex = mock_ex
try:
    import triton.testing  # noqa: F401 (bench_varlen and bench_decode import it)
except ImportError:  # a stand-in: nothing here times
    import types
    sys.modules["triton"] = types.ModuleType("triton")
    sys.modules["triton.testing"] = sys.modules["triton"].testing = types.ModuleType("triton.testing")
import same_run_decode as dec  # noqa: E402
import same_run_gqa as gqa  # noqa: E402
import same_run_varlen as var  # noqa: E402
from benchmarks.bench_decode import ISSUE  # noqa: E402
from benchmarks.bench_varlen import mixes  # noqa: E402

var.DEV = dec.DEV = "cpu"


def args_of(name):
    return dict(zip(spec["exports"][name]["args"], [v for n, v in calls if n == name][-1]))


for label, (lengths, hq, hkv) in mixes().items():
    for causal in (False, True):
        q, k, v, cu = var.inputs(lengths, hq, hkv)
        total, b = q.shape[0], len(lengths)
        calls.clear()
        launch, o, lse = var.fa4_fwd(q, k, v, cu, causal)
        name = calls[-1][0]
        check(name.endswith("_g4") == (hq != hkv) and ("_causal" in name) == causal, f"fwd name {name}")
        a = args_of(name)
        check(a["t:lse"].shape == (hq, total) and a["t:o"].shape == q.shape, f"{name} lse/o shapes")
        launch()
        calls.clear()
        out, dout = torch.empty_like(q), torch.empty_like(q)
        launch, dq, dk, dv = var.fa4_bwd(spec, q, k, v, out, dout, lse, cu, causal)
        names = [n for n, _ in calls]
        m = spec["bwd_cfg"]["128"][str(causal)]["m_block_size"]
        n = spec["bwd_cfg"]["128"][str(causal)]["n_block_size"]
        rows = (total + (b + 1) * m - 1) // m * m
        main = names[1]
        a = args_of(main)
        check(a["t:dqacc"].shape == (hq, rows * 128) and a["t:lse2"].shape == (hq, rows), f"{main} accumulators")
        if hq != hkv:
            krows = (total + (b + 1) * n - 1) // n * n
            check(a["t:dk"].shape == (hkv, krows * 128) and a["t:dk"].dtype == torch.float32, f"{main} dk accum")
            check(names.count(f"fa4_vpostkv_d128_n{n}") == 2, f"GQA post calls {names}")
        else:
            check(a["t:dk"] is dk and a["t:dv"] is dv, f"{main} dk/dv direct")
        launch()
        print(f"3. varlen {label} causal={causal}: {' '.join(names)}")

for shape in ISSUE:
    name, batch, sq, hq, hkv, d, keys, _ = shape
    keys //= 16  # the same plumbing on a smaller cache (every page size still divides it)
    for page in (None, 128, 256, 64, 16):
        t = dec.setup(batch, sq, hq, hkv, d, keys, page)
        used = []
        for cp in ((False, True) if page == 128 else (False,)):
            calls.clear()
            go = dec.fa4_launch(t, page, cp)
            n = calls[-1][0]
            a = args_of(n)
            check(a["t:lse"].shape == (batch, hq, sq) and a["t:used"].dtype == torch.int32, f"{n} lse/used")
            if page:
                check(a["t:k"].shape == (batch * keys // page, page, hkv, d) and a["t:table"].shape == (batch, keys // page),
                      f"{n} paged shapes")
                check(("tma" in n) == (page == 128 and not cp), f"{n} for page {page}")
                flat = a["t:k"][a["t:table"].long()].reshape(batch, keys, hkv, d)
                check(flat.shape == (batch, keys, hkv, d), "table gathers the cache")
            go()
            used.append(n)
        print(f"3. decode {name} page {page}: {' '.join(used)}")

for label, (d, hq, hkv, b, sl) in gqa.dense_cells().items():
    for causal in (False, True):
        q = torch.empty(b, 64, hq, d, dtype=torch.bfloat16)  # 64 tokens: the plumbing, not the size
        k, v = (torch.empty(b, 64, hkv, d, dtype=torch.bfloat16) for _ in range(2))
        calls.clear()
        launch, o, lse = gqa.fa4_dense(q, k, v, causal)
        name = calls[-1][0]
        check(name.endswith(f"_g{hq // hkv}") and ("_causal" in name) == causal and f"_d{d}" in name,
              f"gqa dense name {name}")
        a = args_of(name)
        check(a["t:k"].shape[2] == hkv and a["t:lse"].shape == (b, hq, 64), f"{name} k heads / lse shape")
        launch()
    print(f"3. gqa dense {label}: both causal modes")
for label, (lengths, hq, hkv) in gqa.varlen_mixes().items():
    short = [min(x, 300) for x in lengths]  # the plumbing on shorter sequences
    check(len(lengths) == len(short) and min(lengths) >= 1, f"gqa mix {label} lengths")
    for causal in (False, True):
        q, k, v, cu = var.inputs(short, hq, hkv)
        calls.clear()
        launch, o, lse = gqa.fa4_varlen(q, k, v, cu, causal)
        name = calls[-1][0]
        check(name.endswith(f"_g{hq // hkv}") and ("_causal" in name) == causal, f"gqa varlen name {name}")
        check(args_of(name)["t:lse"].shape == (hq, sum(short)), f"{name} lse shape")
        launch()
    print(f"3. gqa varlen {label} ({len(lengths)} sequences, {min(lengths)}-{max(lengths)} tokens)")

# 4. tables
res = {"tflops": {f"{k}|{m}|{c}|{p}": [100.0 + i, 110.0] for k in ("fwd", "bwd") for m in mixes() for c in (0, 1)
                  for i, p in enumerate(("ours", "fa4"))}}
print(var.table(res, ["fwd", "bwd"], list(mixes())))
res = {"bytes_per_s": {"8x1x32768|dense|ours": [3e12], "8x1x32768|dense|fa4": [2e12, 2.2e12],
                       "8x1x32768|128|fa4_cpasync": [1e12]}, "copy_bytes_per_s": [3.9e12]}
print(dec.table(res, ["8x1x32768|dense", "8x1x32768|128"]))
keys = [f"{k}|{c}|{x}" for k, cells in (("dense", gqa.dense_cells()), ("varlen", gqa.varlen_mixes())) for c in cells
        for x in gqa.CAUSAL.values()]
res = {"flops_per_s": {f"{key}|{p}": [1e14 + i * 1e12, 1.05e14] for key in keys for i, p in enumerate(gqa.PEERS)}}
print(gqa.local_cells.table(res, keys, "GQA prefill forward, TFLOP/s", gqa.PEERS, ("kind", "cell", "causal")))
print("FAILED" if fails else "all checks passed", len(fails))
sys.exit(1 if fails else 0)
