#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# llama2_train, torch_attn.py, small.txt and tok2048.json. The whole log goes to $OUT/ge.log.
# Call GE (1 x H200): the decoupled warpgroup forward (8x1-wgd, now the hd-128 default where
# wgmma runs) with each warpgroup's `P V` left running behind its next block's scores
# (SMP_BURN_FLASH_WGMMA_DEFER_PV=1) against waiting for it at once (0, call GD); then the 7B
# step on the new default, with the trainer's attention line.
# Prediction: defer passes the checks; +2-5 % on the forward (the tensor pipe gets P V and the
# next scores back to back; the other warpgroup already fills most gaps). 7B as call GD's
# wgd run: 11.1-11.2k tok/s.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/ge.log
B="--mma-bwd-tiling 8x64-atomic-cp-vd-wg"
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp check
SMP_BURN_FLASH_WGMMA_DEFER_PV=1 timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wgd $B --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp bench
for r in 1 2; do
for df in 0 1; do
for b in 1 micro; do
SMP_BURN_FLASH_WGMMA_DEFER_PV=$df timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd $B --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-150 | sed "s/^/defer=$df /"
done
done
done
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp 7b
for df in 0 1; do
SMP_BURN_FLASH_WGMMA_DEFER_PV=$df timeout -s KILL 170 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-defer$df /"
done
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
tags = sorted({l.split(" ")[0] for l in L if re.match(r"^7b-", l)})
for tag in tags:
    v = [int(m.group(2)) for l in L if l.startswith(tag + " ") for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and 3 <= int(m.group(1)) <= 9]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "===|passed|FAIL|panic|rror|bench|RESULT|train loss|attention \(" $L | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200 | head -60
