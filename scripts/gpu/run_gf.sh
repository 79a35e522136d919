#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check and
# torch_attn.py. The whole log goes to $OUT/gf.log.
# Call GF (1 x H200): the decoupled warpgroup forward with three K/V buffers
# (SMP_BURN_FLASH_WGMMA_3STAGE=1: 224 KiB of shared memory, block kb + 2 copied while block kb
# runs, so a warpgroup may run up to two blocks ahead) against two (the default, calls GD, GE).
# Prediction: checks pass; +0-6 %, most at S 4k where each cube's first copies are not hidden
# (block 1 now goes out with block 0) and least at 16k.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gf.log
B="--mma-bwd-tiling 8x64-atomic-cp-vd-wg"
{
stamp check
SMP_BURN_FLASH_WGMMA_3STAGE=1 timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wgd $B --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp bench
for r in 1 2; do
for st in 0 1; do
for b in 1 micro; do
SMP_BURN_FLASH_WGMMA_3STAGE=$st timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd $B --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-150 | sed "s/^/3stage=$st /"
done
done
done
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp done
} > $L 2>&1
cat $L
