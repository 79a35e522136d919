#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (lane 0's
# wait for the previous bulk dQ reduction moved before a cube barrier: the grid kernel's
# second, the per-warp kernel's block barrier; one warp barrier less per block) and
# flash_check_fl (call FL's build). The whole log goes to $OUT/fr.log.
# Call FR (1 x H200): calls FM/FI put 7 % of the hd-128 backward in the bulk dQ's protocol
# (warp syncs, fence, lane 0's branches), the wait itself costing nothing.
# Prediction: +1-3 % on both kernels; checks pass.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_fl
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fr.log
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_new timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  for v in flash_check_fl flash_check; do
    stamp "$rep $v hd128 grid, hd128 per-warp, hd64 per-warp"
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v --variant mma --mma-tiling 4x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd --head-dim 64 --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror" $L | sed 's/(mma kernels)//; s/\/bshd causal//' | cut -c1-200
