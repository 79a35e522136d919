#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (main at
# call FL's code). The whole log goes to $OUT/fq.log.
# Call FQ (1 x H200): ncu's warp-state and compute sections of the hd-128 grid dK/dV kernel at
# B1 S 4k with the bulk dQ and with the pair atomics (SMP_BURN_FLASH_BULK_DQ=0), for the next
# session: where do the warps wait now?
# Prediction: long-scoreboard stalls (the atomics' registers, call FD) fall by about a half;
# the tensor pipe rises from 39-40 % to 42-43 %.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fq.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
for bulk in 1 0; do
  stamp "ncu bulk=$bulk"
  SMP_BURN_FLASH_BULK_DQ=$bulk timeout -s KILL 150 $NCU --section WarpStateStats --section ComputeWorkloadAnalysis --section SpeedOfLight --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__pcsamp_warps_issue_stalled_branch_resolving,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_sample_count,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active -k regex:dkdv -c 1 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096 --iters 1 2>&1 | grep -vE "^bench|^ B1|^==PROF==" | grep -E "Duration|Tensor|Issued|Stall|stalled|sample|hmma|Pipe|Warp Cycles|Throughput|Eligible|Active Warps" | cut -c1-160
done
stamp done
} > $L 2>&1
cat $L
