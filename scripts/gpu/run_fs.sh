#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check and
# llama2_train (the bulk dQ decision in one place, `bulk_dq_used`, shared by the launch and the
# trainer's log), small.txt and tok2048.json. The whole log goes to $OUT/fs.log.
# Call FS (1 x H200): quick checks of both head dims' defaults, and the trainer's log line with
# and without SMP_BURN_FLASH_BULK_DQ=0. Prediction: checks pass; the log names the bulk
# reductions, then the atomics; the backward's speed as call FL's.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fs.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 100 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg,8x64-atomic-cp-vd --quick --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-check --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
for x in 1 0; do
  stamp "1b bulk=$x"
  SMP_BURN_FLASH_BULK_DQ=$x timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 4 $F --out-dir /tmp/o1 2>&1 | grep -E "attention backward|step 4/|rror|panic" | cut -c1-260
done
stamp done
} > $L 2>&1
cat $L
