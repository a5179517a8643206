#!/bin/bash
# Link compile.py's objects into one self-contained shared library: the CuTe DSL's static
# CUDA-dialect runtime (from the DSL wheel) and the static CUDA runtime (CUDART_STATIC,
# default: a CUDA 13 toolkit's) linked in, so the device needs neither.
#   link.sh OUT [PYTHON]
set -euo pipefail
cd "$1"
PY=${2:-python3}
RT=$($PY -c "import nvidia_cutlass_dsl, pathlib; print(next(pathlib.Path(nvidia_cutlass_dsl.__path__[0]).glob('cu13/lib/libcuda_dialect_runtime_static.a')))")
CUDART=${CUDART_STATIC:-/usr/local/cuda-13.0/lib/libcudart_static.a}
gcc -shared -o libfa4.so fa4_*.o -Wl,--whole-archive "$RT" -Wl,--no-whole-archive "$CUDART" -ldl -lpthread -lrt
ls -la libfa4.so
