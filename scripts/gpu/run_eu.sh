#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this session's final build: vendor/cubecl-opt, kernel cache per build),
# flash_check_nop (the same with the forward back in natural-log units with `exp`, call EP's
# change undone), kernel_bench and llama2_train (final build), torch_llama.py, small.txt
# (the Shakespeare corpus) and tok2048.json. The whole log goes to $OUT/eu.log.
# Call EU (1 x H200): (1) is call EP's forward `2^x` worth anything, measured without the
# layout lottery (call ER)? (2) the final build end to end: every fast op against its
# reference, 1b with torch.compile in the same call, and 7B.
# Prediction: (1) 0-2 % (call EP's 6 % was mostly the lottery); (2) 36 of 36; 1b 47.5-48.5k
# tok/s (1.05-1.07x torch.compile; call EN ran 47,745 with a forward that may have drawn the
# slow layout); 7B 11.2-11.4k.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_nop kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
L=$OUT/eu.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks nop
SMP_BURN_CACHE_DIR=/tmp/kc_nop timeout -s KILL 60 ./flash_check_nop --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -2
for rep in 1 2; do
  for v in flash_check flash_check_nop; do
    stamp "$v $rep"
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v $B --lens 4096 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./$v --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
export SMP_BURN_CACHE_DIR=/tmp/kc
stamp check
timeout -s KILL 120 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-default /"
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1
stamp 7b
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-default /"
stamp done
ls /tmp/kc
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|check rc|passed" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
grep -o '"tokens_per_s_per_gpu": [0-9.]*' $L
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-100
tail -3 $L
