#!/bin/bash
# Per-SASS-instruction warp-state samples of the backward's main kernel for each cell
# "IMPL HEAD_DIM SEQLEN CAUSAL DET" (IMPL ours|fa4; KERNELS= another build of ours), on
# the H200 from the repository root with build/s17/fa4lib carried. One archive under
# $OUT: per cell the source page as CSV and the kernel's duration.
# Usage: ncu_sass_cells.sh "ours 64 16384 0 1" "fa4 64 16384 0 1" ...
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
. "$(dirname "$0")/ncu_common.sh"
dir=$(mktemp -d)
for cell in "$@"; do
  set -- $cell
  tag=$1_d$2_s$3_c$4_det$5
  NCU_TIMEOUT=150 ncu_profile "$dir/$tag" "FlashBwdSm90|FlashAttentionBackwardSm90" "WarpStateStats SourceCounters SpeedOfLight" \
    -- python3 benchmarks/fa4_upstream/one.py build/s17/fa4lib "$1" bwd "$2" "$3" "$4" "$5" > /dev/null
  echo "$tag $(ncu_export "$dir/$tag" "Duration|Elapsed Cycles" . | tr '\n' ' ')"
done
tar czf "$OUT/ncu-cells.tar.gz" -C "$dir" .
