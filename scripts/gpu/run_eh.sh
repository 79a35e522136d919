#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check, kernel_bench and llama2_train, ptx_dump.py, torch_attn.py, torch_llama.py,
# small.txt (the Shakespeare corpus) and tok2048.json (a 2,048-token BPE trained on it by
# llama2_train). The whole log goes to $OUT/eh.log; stdout gets the summary.
# Call EH (1 x H200): the new defaults (forward: rescale skip with slack 8; every flash kernel:
# the causal mask chosen per warp) checked, benched against PyTorch, and end to end. Prediction:
# checks pass; backward +1-2 % at S 4k, +0-1 % at 16k (only the diagonal blocks change);
# dK/dV kernel still 252 registers without spills; 1b 47.6-48.2k tok/s (the forward's
# attention is ~8 % of a step), 7B 11.0-11.2k.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/eh.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp bench
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --head-dim 64 --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 90 python3 torch_attn.py 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 90 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_bwd_dkdv_mma_cp|flash_fwd_mma_cp|flash_bwd_dq_mma_cp" 2>&1 | cut -c1-220
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
grep -E "^bench|RESULT|===|registers|passed|checks|check rc" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
grep -o '"tokens_per_s_per_gpu": [0-9.]*' $L
grep -E "step +[0-9]+/|val" $L | grep -v "step +[1-3]/" | sed 's/ .*INFO.[^ ]* / /' | cut -c1-100
