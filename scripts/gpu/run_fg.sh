#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check (the grid
# kernel in FlashAttention-2's order: dV, then the dQ atomics, then dK) and flash_check_ff (call
# FF's final build: dV, dK, then dQ). The whole log goes to $OUT/fg.log.
# Call FG (1 x H200): call FD found 11 % of the grid kernel's stall samples on registers the
# dQ's atomics had not yet read, at the end of each block. FA2 issues its dQ atomics between
# the dV and dK products. Also SMP_BURN_FLASH_DQ_MTILES=1 (16-row dQ tiles) on the final build.
# Prediction: FA2's order +1-3 %; one dQ m-tile 2-4 % slower (more ldmatrix per product).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_ff
export CUDA_VISIBLE_DEVICES=0
L=$OUT/fg.log
W="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096,16384"
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_flash_check timeout -s KILL 60 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
for rep in 1 2; do
  for v in flash_check_ff flash_check; do
    stamp "$rep $v"
    for b in 1 micro; do
      SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v $W --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
  stamp "$rep flash_check_ff dq_mtiles=1"
  for b in 1 micro; do
    SMP_BURN_FLASH_DQ_MTILES=1 SMP_BURN_CACHE_DIR=/tmp/kc_flash_check_ff timeout -s KILL 60 ./flash_check_ff $W --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp done
} > $L 2>&1
grep -E "^bench|===|passed|FAIL|panic|rror" $L | sed 's/(mma kernels)//; s/bench mma\[8x2-cp,8x64-atomic-cp-vd-wg\]//; s/\/bshd causal//' | cut -c1-200
