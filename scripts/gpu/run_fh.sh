#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the final
# build: `mma_atb_acc` and `mma_ab_acc` share one loop, `mma_acc_core`) and flash_check_ff (call
# FF's build). The whole log goes to $OUT/fh.log.
# Call FH (1 x H200): a refactor that must not change the kernels. Prediction: checks pass; the
# same speed within noise.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_ff
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fh.log
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 50 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 40 ./flash_check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
for v in flash_check_ff flash_check; do
  stamp "$v"
  SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 30 ./$v --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror" $L | sed 's/(mma kernels)//; s/\/bshd causal//' | cut -c1-200
