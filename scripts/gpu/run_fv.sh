#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding kernel_bench and
# llama2_train (build with vendor/cubecl-cuda: the cuBLAS GEMMs on Burn's own stream),
# torch_llama.py, small.txt and tok2048.json. The whole log goes to $OUT/fv.log.
# Call FV (1 x H200): GEMMs on Burn's stream (default now) against the event crossings
# (SMP_BURN_GEMM_ORDER=auto, the previous default) in the same binary: kernel_bench's checks and
# host-timed single GEMMs beside cuBLAS called directly, then 1b and 7B steps, alternated,
# and PyTorch's 1b (eager and torch.compile) in the same call.
# Prediction: single GEMMs 88-95 % -> 97-100 % of direct cuBLAS (the 5-13 us per call the GPU
# waited at the two crossings go); 1b +2-3 % (about 300 batches per step), 7B +0.5-1 %.
source "$(dirname "$0")/common.sh"
gpu_setup kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fv.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 150 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
SMP_BURN_GEMM_ORDER=auto timeout -s KILL 150 ./kernel_bench check > /tmp/check2.txt 2>&1; echo "auto: kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check2.txt) FAIL=$(grep -c FAIL /tmp/check2.txt)"
stamp gemm
timeout -s KILL 100 ./kernel_bench gemm 2>&1 | sed "s/^/stream /"
SMP_BURN_GEMM_ORDER=auto timeout -s KILL 100 ./kernel_bench gemm 2>&1 | sed "s/^/auto /"
stamp steps
for r in 1 2; do
for o in stream auto; do
SMP_BURN_GEMM_ORDER=$o timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-$o-$r /"
done
done
for o in stream auto; do
SMP_BURN_GEMM_ORDER=$o timeout -s KILL 110 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-$o /"
done
stamp torch
timeout -s KILL 100 python3 torch_llama.py --preset 1b --steps 10 2>&1 | tail -1 | sed "s/^/1b-eager /"
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -1 | sed "s/^/1b-compile /"
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
tags = sorted({l.split(" ")[0] for l in L if re.match(r"^(1b|7b)-(stream|auto)", l)})
for tag in tags:
    lo, hi = (4, 11) if tag.startswith("1b") else (3, 9)
    v = [int(m.group(2)) for l in L if l.startswith(tag + " ") for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and lo <= int(m.group(1)) <= hi]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "^(stream|auto) |===|passed|FAIL|panic|rror|kernel_bench|eager|compile|cuBLAS GEMMs|train loss" $L | grep -v "step +[0-9]" | cut -c1-230 | head -80
