#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (call EH's build). The whole log goes to $OUT/ek.log; stdout gets the summary.
# Call EK (1 x H200): the backward tilings at head dim 64 (the 1b preset's, where the backward
# is about a quarter of a step) again, now that every kernel picks its mask per warp. Call ED
# had the atomic 8x64 tie the default split 4x64 (180-184 against 183-185 at S 4k).
# Prediction: the ranking stands (4x64-split-cp-vd first or within 2 %); nothing beats it by
# more than 3 % at S 4k.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ek.log
T=4x64-split-cp-vd,8x64-split-cp-vd,8x32-split-cp-vd,4x64-atomic-cp-vd,8x64-atomic-cp-vd,4x32-atomic-cp-vd,8x32-atomic-cp-vd
{
stamp bench-hd64
timeout -s KILL 200 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling $T --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp bench-hd64-repeat-default
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
