#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the
# refactor after call FK: the grid kernel's 15 stride scalars back to `tensor.stride()`,
# `copy_qdo_async` and `fused_dq_apply` computing their offsets from (batch, head), `stage_kv`
# shared by both cp.async dK/dV kernels). The whole log goes to $OUT/fl.log.
# Call FL (1 x H200): the refactored kernels' checks (all shapes; the grid and per-warp atomic
# kernels with the bulk dQ and, quick, with the atomics; the split cp kernel) and speed.
# Prediction: all checks pass; speed as call FK's within 1 % (the strides hit L1, call FC).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fl.log
T="--variant mma --mma-tiling 8x2-cp"
{
stamp "checks, bulk dQ"
timeout -s KILL 200 ./flash_check $T --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd,4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
stamp "checks quick, atomics"
SMP_BURN_FLASH_BULK_DQ=0 timeout -s KILL 100 ./flash_check $T --quick --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  stamp "$rep hd128 grid"
  for b in 1 micro; do
    timeout -s KILL 60 ./flash_check $T --no-check --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
  stamp "$rep hd64 per-warp"
  timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 4x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd --head-dim 64 --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror" $L | sed 's/(mma kernels)//; s/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
