#!/bin/bash
# The 192/128 backward's main kernels under ncu, FA4 upstream's then ours (the first
# cell's check calls of same_run_dv.py, each once: 4 x 4096, 16 heads, not causal), from
# the repository root on a device machine with fa4_aot's cubins and manifest and FA4's
# library (build/fa4) carried. Under $OUT: the details page as CSV (dv-details.csv) and
# ncu's log (dv.log); with SOURCE=1 also per-SASS-instruction warp-state samples
# (SourceCounters), the source page of each kernel as CSV (dv-sass-0.csv FA4's,
# dv-sass-1.csv ours, gzipped), to put the stalls on roles.
#   [SOURCE=1] benchmarks/experiments/ncu_dv_bwd.sh
export PYTHONPATH=$PWD:$PWD/benchmarks
. "$(dirname "$0")/ncu_common.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
NCU_TIMEOUT=300 NCU_LAUNCH="--launch-count 2" ncu_profile "$OUT/dv" "kernel_cutlass_kernel_.*bwd_sm90" \
  "SpeedOfLight WarpStateStats SchedulerStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis Occupancy LaunchStats InstructionStats ${SOURCE:+SourceCounters}" \
  -- python3 benchmarks/fa4_upstream/same_run_dv.py build/fa4 1 /tmp/dv.json
tail -5 "$OUT/dv.log"
ncu_export "$OUT/dv" "kernel_cutlass|Duration|Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Executed Ipc|Warp Cycles Per Issued|Shared Memory|Executed Instructions  " \
  "${SOURCE:+flash_attn fa4_aot}"
if [ -n "${SOURCE:-}" ]; then gzip "$OUT"/dv-sass-*.csv; fi
