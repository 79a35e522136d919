#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check built on
# branch exp-bulk-parts: SMP_BURN_EXP_BULK picks a part of the grid kernel's bulk dQ to leave
# out: 0 none (the default kernel), 1 the reduction itself (lane 0 never issues it: the staging,
# fences, warp syncs and waits remain, no L2 traffic), 2 the wait for the previous reduction's
# reads (racy: measures the wait only). The whole log goes to $OUT/fm.log.
# Call FM (1 x H200): where the bulk dQ's remaining cost lies (call FI: no dQ adds at all ran
# 273-290 / 332-337 TFLOP/s at S 4k / 16k; the bulk dQ 238-250 / 287-288).
# Prediction: 1 recovers most of it (the L2 reductions), 2 little.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fm.log
{
for rep in 1 2; do
  for x in 0 1 2; do
    stamp "$rep exp $x"
    for b in 1 micro; do
      SMP_BURN_EXP_BULK=$x timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|panic|rror" $L | sed 's/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
