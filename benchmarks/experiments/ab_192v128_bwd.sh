#!/bin/bash
# The 192/128 backward from another build (build/dev/bal, e.g. built with
# docs/history/2026-12-07-bwd-192v128-dkv-by-keys.patch) against the package's, FA4
# upstream in the same process, then the pair's GPU tests with bal's rows swapped in.
# On a device machine with fa4_aot/cubins, fa4_aot/manifest.json, build/fa4 and
# build/dev/bal carried.
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 55 python3 benchmarks/fa4_upstream/same_run_dv.py build/fa4 1 $OUT/dv-bal.json bal=build/dev/bal 2>&1 | grep -v -i warn | grep -E "^r0|check" | tail -12
python3 benchmarks/experiments/swap_in.py build/dev/bal | cut -c1-60
timeout 70 python3 -m pytest -q -p no:warnings -x tests/gpu/test_head_dims.py -k "pair or v128 or 192" 2>&1 | tail -3
