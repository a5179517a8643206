#!/bin/bash
# Prepared in session 19, not yet run: where the head_dim 64 causal backward's cycles go,
# per SASS instruction (warp-state samples), ours (16k causal picks the .q2 two-tile kernel;
# KERNELS= another build) against FA4 upstream's, then the not-causal pair for reference.
# Run on the H200 from the repository root with build/s17/fa4lib carried; results under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for cell in "ours 1" "fa4 1" "ours 0" "fa4 0"; do
  set -- $cell
  timeout 240 ncu --clock-control none -k regex:"FlashBwdSm90|FlashAttentionBackwardSm90" \
    --launch-skip 2 --launch-count 1 --section WarpStateStats --section SourceCounters \
    --page source --print-source sass --csv \
    python3 benchmarks/fa4_upstream/one.py build/s17/fa4lib "$1" bwd 64 16384 "$2" > "$OUT/sass_$1_c$2.csv" 2>&1
  echo "$1 causal=$2 rc $?"
done
gzip "$OUT"/sass_*.csv
