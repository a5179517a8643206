#!/bin/bash
# Build FA4 upstream's library for the same-process benchmarks (build/fa4: libfa4.so and
# spec.json, carried to the device) on a CPU machine, from a git directory of
# flash-attention holding the pinned commit (the library's `fetch` of Dao-AILab/flash-attention
# gives one). About 90 s on 2 cores: compile.py's sources as its docstring names them
# (flash_attn/cute by git archive; quack-kernels 0.6.5, einops, apache-tvm-ffi and triton by
# pip --target; torch from the venv), every kind compile.py has, then link.sh.
#   benchmarks/fa4_upstream/setup.sh FLASH_ATTENTION_GIT_DIR [OUT=build/fa4] [PYTHON=.venv/bin/python]
set -euo pipefail
GIT=$1; OUT=${2:-build/fa4}; PY=${3:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # absolute, the venv's link kept
COMMIT=0251105a2fb1
WORK=$(mktemp -d)
mkdir -p "$WORK/src" "$OUT"
git -C "$GIT" archive "$COMMIT" flash_attn/cute | tar -x -C "$WORK/src"
"$PY" -m pip install -q --target "$WORK/deps" --no-deps einops quack-kernels==0.6.5 apache-tvm-ffi triton
FA4_PATH="$WORK/src:$WORK/deps" FA4_SOURCES="flash-attention $COMMIT (flash_attn/cute); quack-kernels 0.6.5" \
    CUTE_DSL_ARCH=sm_90a "$PY" benchmarks/fa4_upstream/compile.py "$OUT" fwd bwd varlen gqa decode local local_bwd dv
bash benchmarks/fa4_upstream/link.sh "$OUT" "$PY"
rm -rf "$WORK"
