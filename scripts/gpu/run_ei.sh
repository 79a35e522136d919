#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ as for run_eh.sh (call EH's
# build). The whole log goes to $OUT/ei.log; stdout gets the summary.
# Call EI (1 x H200): call EH's hd-64 forward at B1 S 4k (175.6 TFLOP/s against 241.2 in call
# EG) again, with the rescale policy varied (default slack 8, slack 0, no skip), twice each;
# then 1b with the skip off against the default, for the losses (the slack changes the
# forward's rounding only) and the throughput. Prediction: call EH's 175.6 was a one-off
# (all three policies 235-245 at 4k, 290-300 at 16k); 1b losses equal to 3-4 digits.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ei.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
B="--no-check --variant mma --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --head-dim 64"
{
for policy in "" "SMP_BURN_FLASH_RESCALE_SLACK=0" "SMP_BURN_FLASH_SKIP_RESCALE=0"; do
  stamp "hd64 policy [$policy]"
  for rep in 1 2; do
    env $policy timeout -s KILL 60 ./flash_check $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
  env $policy timeout -s KILL 60 ./flash_check $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp 1b-default
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-default /"
stamp 1b-noskip
SMP_BURN_FLASH_SKIP_RESCALE=0 timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o2 2>&1 | sed "s/^/1b-noskip /"
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-100
