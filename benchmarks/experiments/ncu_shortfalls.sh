#!/bin/bash
# Where each cell that falls short of its issue's bar spends its time (shortfalls.py's
# cases), on the H200 from the repository root: per case one launch of its main kernel
# (the third launch of a decode, forward or backward main kernel; a backward case's setup
# forward is the first, so the second call's backward) under ncu with the sections that
# tell a memory bound from an issue bound (SpeedOfLight, MemoryWorkloadAnalysis, WarpStateStats,
# SchedulerStats, Occupancy, LaunchStats, ComputeWorkloadAnalysis) and per-SASS warp-state
# samples (SourceCounters), so stalls can be put on a role's instructions. One archive
# under $OUT: per case the details page and the SASS source page as CSV, and the log.
# Usage: ncu_shortfalls.sh [CASE ...]   (default: every case; KERNELS=DIR: that build's cubins)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
dir=$(mktemp -d)
cases=("$@")
[ ${#cases[@]} -eq 0 ] && mapfile -t cases < <(python3 benchmarks/experiments/shortfalls.py --list)
extra=()
[ -n "$KERNELS" ] && extra=(--kernels "$KERNELS")
for c in "${cases[@]}"; do
  timeout 240 ncu --clock-control none -k regex:"fa4_aot_decode_sm90|FlashFwdSm90|FlashBwdSm90" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section SourceCounters \
    -o "$dir/$c" python3 benchmarks/experiments/shortfalls.py "$c" "${extra[@]}" > "$dir/$c.log" 2>&1
  echo "$c rc=$?"
  if [ -f "$dir/$c.ncu-rep" ]; then
    ncu --import "$dir/$c.ncu-rep" --page details --csv > "$dir/details_$c.csv" 2>&1
    ncu --import "$dir/$c.ncu-rep" --page source --print-source sass --csv > "$dir/sass_$c.csv" 2>&1
    ncu --import "$dir/$c.ncu-rep" --page details | grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy" | tr -s ' '
    rm -f "$dir/$c.ncu-rep"
  fi
done
tar czf "$OUT/ncu-shortfalls.tar.gz" -C "$dir" .
