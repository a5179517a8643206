#!/bin/bash
# Where the head_dim 64 backward's cycles go, per SASS instruction (warp-state samples),
# ours (16k causal picks the .q2 two-query-tile kernel; KERNELS= another build) against FA4
# upstream's, causal and not. On the H200 from the repository root with build/s17/fa4lib
# carried; one archive under $OUT: per cell the source page as CSV and the details page.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
dir=$(mktemp -d)
for cell in "ours 1" "fa4 1" "ours 0" "fa4 0"; do
  set -- $cell
  rep=$dir/rep_$1_c$2
  timeout 150 ncu --clock-control none -k regex:"FlashBwdSm90|FlashAttentionBackwardSm90" \
    --launch-skip 2 --launch-count 1 --section WarpStateStats --section SourceCounters \
    --section SpeedOfLight -o "$rep" \
    python3 benchmarks/fa4_upstream/one.py build/s17/fa4lib "$1" bwd 64 16384 "$2" > "$rep.log" 2>&1
  echo "$1 causal=$2 profile rc $?"
  ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$dir/sass_$1_c$2.csv" 2>&1
  echo "  source page rc $? $(wc -l < "$dir/sass_$1_c$2.csv") lines"
  ncu --import "$rep.ncu-rep" --page details > "$dir/details_$1_c$2.txt" 2>&1
  grep -E "Duration|Elapsed Cycles|Warp Cycles Per Issued|Issued Warp" "$dir/details_$1_c$2.txt" | head -6
done
tar czf "$OUT/ncu-sass.tar.gz" -C "$dir" .
