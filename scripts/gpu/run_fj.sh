#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the bulk
# dQ reduction: vendor/cubecl-ir + vendor/cubecl-cpp's cp.reduce.async.bulk, on by default on
# sm_90, SMP_BURN_FLASH_BULK_DQ=0 for the f32-pair atomics). The whole log goes to $OUT/fj.log.
# Call FJ (1 x H200): checks of both atomic kernels with the bulk dQ (all shapes, both head
# dims), then backward TFLOP/s with and without it.
# Prediction: hd 128 grid +15-18 % (call FI's stage-only bound was +20-24 %); hd 64 per-warp
# kernel +10-15 %.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fj.log
T="--variant mma --mma-tiling 8x2-cp"
{
stamp "checks, bulk dQ"
SMP_BURN_CACHE_DIR=/tmp/kc timeout -s KILL 200 ./flash_check $T --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks|RESULT\|check.*dq" | cut -c1-220 | tail -40
stamp "checks quick, atomics"
SMP_BURN_FLASH_BULK_DQ=0 SMP_BURN_CACHE_DIR=/tmp/kc timeout -s KILL 100 ./flash_check $T --quick --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  for bulk in 1 0; do
    stamp "$rep bulk $bulk hd128 grid"
    for b in 1 micro; do
      SMP_BURN_FLASH_BULK_DQ=$bulk SMP_BURN_CACHE_DIR=/tmp/kc timeout -s KILL 60 ./flash_check $T --no-check --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
    stamp "$rep bulk $bulk hd64 per-warp"
    for b in 1 micro; do
      SMP_BURN_FLASH_BULK_DQ=$bulk SMP_BURN_CACHE_DIR=/tmp/kc timeout -s KILL 60 ./flash_check $T --no-check --mma-bwd-tiling 8x64-atomic-cp-vd --head-dim 64 --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror|RESULT" $L | sed 's/(mma kernels)//; s/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
