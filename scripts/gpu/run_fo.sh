#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (main at
# call FL's code: the bulk dQ on by default). The whole log goes to $OUT/fo.log.
# Call FO (1 x H200): with the bulk dQ, do the other atomic tilings overtake the defaults?
# Session 15 measured them with the pair atomics: at hd 64 the per-warp 8x64-atomic-cp-vd beat
# the warp grid at S 16k (228 against 220); at hd 128 8x64-...-wg beat 4x64-/8x32-...-wg.
# Prediction: the defaults stay (the reduction costs each tiling about the same).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fo.log
{
for t in 8x64-atomic-cp-vd 4x64-atomic-cp-vd 8x64-atomic-cp-vd-wg 4x64-atomic-cp-vd-wg 8x32-atomic-cp-vd-wg; do
  stamp "hd64 $t"
  for b in 1 micro; do
    timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 4x2-cp --no-check --mma-bwd-tiling $t --head-dim 64 --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
for t in 8x64-atomic-cp-vd-wg 4x64-atomic-cp-vd-wg 8x32-atomic-cp-vd-wg 8x64-atomic-cp-vd; do
  stamp "hd128 $t"
  for b in 1 micro; do
    timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling $t --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|panic|rror" $L | sed 's/(mma kernels)//; s/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
