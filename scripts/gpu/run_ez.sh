#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the
# warp-grid dK/dV kernel, `-wg` tilings, beside the session-14 kernels). The whole log goes to
# $OUT/ez.log.
# Call EZ (1 x H200): first run of `flash_bwd_dkdv_mma_grid` (FA2's warp layout: 32 keys by
# half the queries per warp for S/dP, 32 keys by half the columns for dK/dV, P^T and dS^T
# through shared memory, two barriers per block). Prediction: checks pass; shared wavefronts
# -18 % (200 M -> ~165 M at B1 S 4k), backward at hd 128 +8-12 % (B1 S 4k 223 -> ~245,
# B8 4k 233 -> ~255, B2 16k 260 -> ~285); hd 64 unclear (the fused dQ is not its default).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/ez.log
W="8x64-atomic-cp-vd-wg"
OLD="8x64-atomic-cp-vd"
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks hd128
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $W,4x64-atomic-cp-vd-wg,8x32-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -8
stamp checks hd64
timeout -s KILL 90 ./flash_check --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $W,4x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
for rep in 1 2; do
  stamp "bench $rep"
  timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $OLD,$W,4x64-atomic-cp-vd-wg --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  timeout -s KILL 90 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $OLD,$W --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp "bench hd64"
timeout -s KILL 90 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,$OLD,$W,4x64-atomic-cp-vd-wg --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp ncu
for t in $OLD $W; do
timeout -s KILL 90 $NCU --section SpeedOfLight --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread -k regex:dkdv -c 1 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $t --lens 4096 --batch micro --iters 1 2>&1 | grep -E "^  [a-z_]+|Duration|L1/TEX Cache|l1tex__|smsp__|sm__pipe|launch__" | cut -c1-150
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror|Duration|L1/TEX|l1tex|smsp|sm__pipe|launch__|^  [a-z]" $L | sed 's/(mma kernels)//' | cut -c1-220
