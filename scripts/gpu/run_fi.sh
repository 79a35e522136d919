#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check built on
# branch exp-dq-sink (SMP_BURN_EXP_DQ_SINK picks what the grid kernel does with each block's dQ
# tile: 0 the f32-pair atomics, 1 nothing (never-true runtime guard), 2 fragment-order stores
# into a 32 KB shared tile, as a bulk asynchronous reduction would stage it). The whole log goes
# to $OUT/fi.log.
# Call FI (1 x H200): the upper bound of removing the dQ atomics from the grid kernel's loop.
# Prediction: sink 1 +8-12 %, sink 2 +5-9 % over sink 0 at B1 4k and B2 16k.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fi.log
W="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384"
{
for rep in 1 2; do
  for sink in 0 1 2; do
    stamp "$rep sink $sink"
    for b in 1 micro; do
      SMP_BURN_EXP_DQ_SINK=$sink SMP_BURN_CACHE_DIR=/tmp/kc timeout -s KILL 60 ./flash_check $W --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror" $L | sed 's/(mma kernels)//; s/bench mma\[8x2-cp,8x64-atomic-cp-vd-wg\]//; s/\/bshd causal//' | cut -c1-200
