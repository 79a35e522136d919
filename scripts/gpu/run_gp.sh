#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check. The whole
# log goes to $OUT/gp.log.
# Call GP (1 x H200): the forward's `O += P V` and the backward's `dV` / `dK` products issued by
# one helper (`wgmma_rs_block`, review of the session's change: the two loops were the same
# but for the tile's row count). Full check of the defaults, one benchmark run.
# Prediction: the same instructions, so checks pass and the figures stay within calls GN-GO's.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gp.log
{
stamp check
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --no-bench > /tmp/check.txt 2>&1; echo "flash_check rc=$? ok=$(grep -c '|true$' /tmp/check.txt) false=$(grep -c '|false$' /tmp/check.txt)"
grep -E "FAIL|panic|rror|all checks" /tmp/check.txt | cut -c1-200 | head -10
stamp bench
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
stamp done
} > $L 2>&1
cat $L
