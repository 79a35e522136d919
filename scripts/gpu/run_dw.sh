#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# llama2_train, small.txt and tok2048.json. The whole log goes to $OUT/dw.log; stdout gets the
# summary.
# Call DW (1 x H200), the session's final build: the backward default by head dim (7B: the
# atomic dQ, logged as not bitwise reproducible; 1b: the split dQ), and SMP_BURN_DETERMINISTIC=1
# giving bitwise equal 7B losses in two runs.
# Prediction: 7B default about 10.7k tok/s median (call DV's atomic run); the two deterministic
# runs equal at every step and about 1.4 % slower.
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dw.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp 7b default
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-default /"
for i in 1 2; do
  stamp 7b deterministic $i
  SMP_BURN_DETERMINISTIC=1 timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 6 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-det$i /"
done
stamp 1b default
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-default /"
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "===|attention backward" $L | sed 's/ .*INFO.[^ ]* / /' | cut -c1-200
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-2]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-105
