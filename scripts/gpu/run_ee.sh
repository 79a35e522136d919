#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check and kernel_bench. The whole log goes to $OUT/ee.log; stdout gets the summary.
# Call EE (1 x H200): the review mends of the final commit (host code only: the backward launch
# reads the dQ deferral once; kernel_bench's issue time from one helper). Checks of the default
# backward tilings and `kernel_bench gemm`. Prediction: checks pass, figures as in calls EA/DZ.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ee.log
{
stamp checks
timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
stamp gemm
timeout -s KILL 120 ./kernel_bench gemm 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|^bench|===|x .* -> |shape" $L | cut -c1-200
