#!/bin/bash
# The 192/128 backward's main kernels under ncu, FA4 upstream's then ours (the first
# cell's check calls of same_run_dv.py, each once: 4 x 4096, 16 heads, not causal), from
# the repository root on a device machine with fa4_aot's cubins and manifest and FA4's
# library (build/fa4) carried. Under $OUT: the details page as CSV and ncu's log; with
# SOURCE=1 also per-SASS-instruction warp-state samples (SourceCounters), the source page
# of each kernel as CSV (sass-flash_attn.csv FA4's, sass-fa4_aot.csv ours), to put the stalls on roles.
#   [SOURCE=1] benchmarks/experiments/ncu_dv_bwd.sh
export PYTHONPATH=$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 ncu --clock-control none -k regex:"kernel_cutlass_kernel_.*bwd_sm90" --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
  ${SOURCE:+--section SourceCounters} \
  -o $OUT/dv python3 benchmarks/fa4_upstream/same_run_dv.py build/fa4 1 /tmp/dv.json > $OUT/ncu.log 2>&1
echo "ncu rc=$?"; tail -5 $OUT/ncu.log
ncu --import $OUT/dv.ncu-rep --page details --csv > $OUT/dv-details.csv 2>&1
ncu --import $OUT/dv.ncu-rep --page details | grep -E "kernel_cutlass|Duration|Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Executed Ipc|Warp Cycles Per Issued|Shared Memory|Executed Instructions  " | tr -s ' ' | cut -c1-160
if [ -n "${SOURCE:-}" ]; then
  for k in flash_attn fa4_aot; do
    ncu --import $OUT/dv.ncu-rep -k regex:$k --page source --print-source sass --csv > $OUT/sass-$k.csv 2>&1
  done
  gzip $OUT/sass-*.csv
fi
rm -f $OUT/dv.ncu-rep
