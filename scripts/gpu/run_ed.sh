#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (build of call EC). The whole log goes to $OUT/ed.log; stdout gets the summary.
# Call ED (1 x H200): at head dim 64 (the 1b preset) the atomic tilings now run with the
# deferred dQ and two m-tiles; does one of them beat the split default (184-186 TFLOP/s at S
# 4096) where the 1b model trains? Prediction: no; the best atomic one within 3 % of split.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ed.log
{
stamp bench
for i in 1 2; do
timeout -s KILL 150 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd,4x64-atomic-cp-vd,8x32-atomic-cp-vd,4x32-atomic-cp-vd --lens 4096 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/fwd+bwd.*//' | cut -c1-200
