#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check built on
# branch exp-bulk-parts: SMP_BURN_EXP_BULK 0 is the default grid kernel with the bulk dQ,
# 3 leaves out the async-proxy fence before each reduction (racy: measures the fence), 4
# issues the fence, warp sync and reduction of block i after block i + 1's barrier (the
# stores stay at the end of block i). The whole log goes to $OUT/fn.log.
# Call FN (1 x H200): call FM put 7 % of the backward in the bulk dQ's protocol (staging,
# fence, warp syncs, lane 0's branch) and 7-8 % in the reductions themselves.
# Prediction: 3 recovers 3-5 %; 4 about half of that.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fn.log
{
stamp "checks quick, exp 4"
SMP_BURN_EXP_BULK=4 timeout -s KILL 100 ./flash_check --variant mma --mma-tiling 8x2-cp --quick --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  for x in 0 3 4; do
    stamp "$rep exp $x"
    for b in 1 micro; do
      SMP_BURN_EXP_BULK=$x timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|panic|rror|passed|FAIL" $L | sed 's/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
