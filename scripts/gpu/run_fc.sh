#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the
# warp-grid kernel reading its strides from scalar arguments) and ptx_dump.py. The whole log
# goes to $OUT/fc.log.
# Call FC (1 x H200): call FB's SASS showed the dK/dV loops reloading tensor strides from
# CubeCL's metadata buffer (about 18 LDG per block, waited on: 20-23 % of stall samples on
# long scoreboards against FA2's 7 %). The grid kernel now takes its 15 strides as u32 scalars
# (constant bank). Prediction: checks pass (the per-warp kernels' calls changed shape too);
# the grid's loop holds no LDG; long-scoreboard stalls halve; grid backward +3-6 % over call
# FA's grid at every shape.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fc.log
W="8x64-atomic-cp-vd-wg"
OLD="8x64-atomic-cp-vd"
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
M="--section SpeedOfLight --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio,smsp__average_warp_latency_issue_stalled_selected.ratio"
K="^  [a-zA-Z_]|Duration|L1/TEX Cache|l1tex__|smsp__|sm__pipe"
{
stamp checks hd128
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W,$OLD,8x64-atomic,4x64-atomic-cp-vd-wg,8x32-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
SMP_BURN_FLASH_DEFER_DQ=0 timeout -s KILL 100 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W,$OLD --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
stamp checks hd64
timeout -s KILL 90 ./flash_check --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $W,$OLD --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  for defer in 1 0; do
    stamp "bench $rep defer=$defer"
    SMP_BURN_FLASH_DEFER_DQ=$defer timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $OLD,$W --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_FLASH_DEFER_DQ=$defer timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $OLD,$W --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp "bench hd64"
timeout -s KILL 90 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,$OLD,$W --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp ncu
for defer in 1 0; do
  echo "--- defer=$defer $W"
  SMP_BURN_FLASH_DEFER_DQ=$defer timeout -s KILL 90 $NCU $M -k regex:dkdv -c 1 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W --lens 4096 --iters 1 2>&1 | grep -E "$K" | cut -c1-150
done
stamp sass
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
C=$(find / -name cuobjdump -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_bwd_dkdv_mma_grid" 2>&1 | cut -c1-220
mkdir -p $OUT/sass
for f in /tmp/ptx/*.ptx; do
  n=$(basename $f .ptx)
  "$P" --gpu-name sm_90a -O3 $f -o /tmp/$n.cubin && "$C" -sass /tmp/$n.cubin | gzip > $OUT/sass/$n.sass.gz
done
stamp done
} > $L 2>&1
grep -E "^bench|===|^---|passed|FAIL|panic|rror|Duration|L1/TEX|l1tex|smsp|sm__pipe|^  [a-z]|registers" $L | sed 's/(mma kernels)//; s/smsp__average_warp_latency_issue_stalled_//; s/bench mma\[8x2-cp,//; s/\/bshd causal//' | cut -c1-200
