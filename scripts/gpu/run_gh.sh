#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check. The whole
# log goes to $OUT/gh.log.
# Call GH (1 x H200): after folding the warpgroup forward's loop bodies into shared helpers
# (copy_kv_swizzled, wg_finish_block; CubeCL inlines them, so the kernel should be unchanged):
# the full check of 8x1-wgd and the quick one of 8x1-wg, and the forward's figures.
# Prediction: checks pass; figures within calls GD-GF's spread (B8 4k 425-432, B2 16k 441-455).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gh.log
B="--mma-bwd-tiling 8x64-atomic-cp-vd-wg"
{
stamp check
timeout -s KILL 100 ./flash_check --variant mma --mma-tiling 8x1-wgd $B --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x1-wg $B --quick --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
stamp bench
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-150
stamp done
} > $L 2>&1
cat $L
