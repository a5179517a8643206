#!/bin/bash
# Where each cell that falls short of its issue's bar spends its time (shortfalls.py's
# cases), on the H200 from the repository root: per case one launch of its main kernel
# (the third launch of a decode, forward or backward main kernel; a backward case's setup
# forward is the first, so the second call's backward) under ncu with the sections that
# tell a memory bound from an issue bound (SpeedOfLight, MemoryWorkloadAnalysis, WarpStateStats,
# SchedulerStats, Occupancy, LaunchStats, ComputeWorkloadAnalysis) and per-SASS warp-state
# samples (SourceCounters), so stalls can be put on a role's instructions. One archive
# under $OUT: per case the details page and the SASS source page as CSV (CASE-details.csv,
# CASE-sass-0.csv), and the log.
# Usage: ncu_shortfalls.sh [CASE ...]   (default: every case; KERNELS=DIR: that build's cubins)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
. "$(dirname "$0")/ncu_common.sh"
dir=$(mktemp -d)
cases=("$@")
[ ${#cases[@]} -eq 0 ] && mapfile -t cases < <(python3 benchmarks/experiments/shortfalls.py --list)
extra=()
[ -n "$KERNELS" ] && extra=(--kernels "$KERNELS")
for c in "${cases[@]}"; do
  ncu_profile "$dir/$c" "fa4_aot_decode_sm90|FlashFwdSm90|FlashBwdSm90" \
    "SpeedOfLight MemoryWorkloadAnalysis WarpStateStats SchedulerStats Occupancy LaunchStats ComputeWorkloadAnalysis SourceCounters" \
    -- python3 benchmarks/experiments/shortfalls.py "$c" "${extra[@]}"
  ncu_export "$dir/$c" "Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy" .
done
tar czf "$OUT/ncu-shortfalls.tar.gz" -C "$dir" .
