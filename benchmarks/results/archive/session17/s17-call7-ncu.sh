#!/bin/bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
M=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,lts__t_sectors_op_red.sum,dram__bytes.sum
STALL=smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_membar.ratio,smsp__average_warp_latency_issue_stalled_sleeping.ratio
run() { # name kernels impl causal
  KERNELS=$2 timeout 100 ncu --clock-control none -k regex:"FlashBwdSm90|FlashAttentionBackwardSm90" --launch-skip 2 --launch-count 1 \
    --metrics $M,$STALL --csv python3 benchmarks/fa4_upstream/one.py build/s17/fa4lib $3 bwd 64 16384 $4 > $OUT/ncu_$1.csv 2>&1
  echo "== $1 rc $?"
}
run ours_causal "" ours 1
run wide_causal build/wd3 ours 1
run fa4_causal "" fa4 1
run ours_nc "" ours 0
run fa4_nc "" fa4 0
