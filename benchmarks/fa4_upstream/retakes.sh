#!/bin/bash
# The H200 retakes the open issues owe (38, 39, 40, 42), as device calls of at most ten
# minutes each, from the repository root on the device with the package's cubins and
# manifest and FA4's library (build/fa4: libfa4.so and spec.json, setup.sh)
# carried. Each command has its own limit so that one slow cell does not cost the call.
#   benchmarks/fa4_upstream/retakes.sh PART OUT      (PART 1: issue 42; 2: issues 38, 39, 40)
set -u
PART=$1; OUT=$2; FA4=${FA4:-build/fa4}
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
run() { local limit=$1; shift; echo "== $*"; timeout "$limit" "$@" 2>&1 | tail -30; }
if [ "$PART" = 1 ]; then  # local attention: forward and backward against FA4, windowed decode
    run 200 python3 benchmarks/fa4_upstream/same_run_local.py "$FA4" 2 "$OUT/fa4-same-process-local.json" gpt-oss
    run 200 python3 benchmarks/fa4_upstream/same_run_local_bwd.py "$FA4" 2 "$OUT/fa4-same-process-local-bwd.json" gpt-oss
    run 150 python3 benchmarks/bench_decode_local.py --rounds 2 --caches 32768 --out "$OUT"
else  # GQA prefill (38), 192/128 (39), the decode shapes and FP8 (38, 40)
    run 150 python3 benchmarks/fa4_upstream/same_run_gqa.py "$FA4" 2 "$OUT/fa4-same-process-gqa.json" dense
    run 150 python3 benchmarks/fa4_upstream/same_run_dv.py "$FA4" 2 "$OUT/fa4-same-process-dv.json"
    run 120 python3 benchmarks/bench_dense_decode.py --rounds 2 --out "$OUT"
    run 150 python3 benchmarks/bench_decode.py --fp8 --quick --rounds 2 --out "$OUT"
fi
