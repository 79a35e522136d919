#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# kernel_bench and llama2_train, torch_llama.py, small.txt (the Shakespeare corpus) and
# tok2048.json. The whole log goes to $OUT/en.log; stdout gets the summary.
# Call EN (1 x H200): the session's final build (call EM's kernels): every fast op against its
# reference, then 1b with torch.compile in the same call, and 7B. Prediction: 36 of 36 checks
# ok; 1b 46.8-47.6k tok/s (1.04-1.06x torch.compile); 7B 10.9-11.2k.
source "$(dirname "$0")/common.sh"
gpu_setup kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/en.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp check
timeout -s KILL 200 ./kernel_bench check > $OUT/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' $OUT/check.txt) FAIL=$(grep -c FAIL $OUT/check.txt)"
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-default /"
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1
stamp 7b
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-default /"
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "===|check rc" $L
grep -o '"tokens_per_s_per_gpu": [0-9.]*' $L
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-100
