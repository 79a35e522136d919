#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (fused_check, llama2_train), small.txt and tok2048.json (see docs/performance.md,
# session 9). The whole log goes to $OUT/dj.log; stdout gets the summary lines.
# Call DJ (1 x H200): the staged RMSNorm backward (rows brought into shared memory by cp.async,
# two stages): checks, A/B against the lean register kernel (SMP_BURN_NORM_BWD_STAGED=0), a sweep
# of its shape (threads, KiB per stage, cubes per SM), ptxas, and 1b end to end (losses against
# calls DD-DH).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dj.log
{
stamp RMSNorm checks
for s in default 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 120 ./fused_check check --quick 2>&1 | sed "s/^/staged=$s /"
done
stamp RMSNorm timing
for s in default 0 default 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/staged=$s /"
done
for s in 128,32,2 256,16,2 256,48,2 256,32,3 512,32,2 512,64,1; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/staged=$s /"
done
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "rms_norm_bwd_staged" 2>&1
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
stamp 1b
timeout -s KILL 60 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^staged=.*(BW|check rms)|smem=|===" $L | cut -c1-200
grep -E "step +([4-9]|1[0-2])/" $L | cut -c40-200 | tail -9
