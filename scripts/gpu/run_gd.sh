#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# llama2_train, torch_attn.py, small.txt and tok2048.json. The whole log goes to $OUT/gd.log.
# Call GD (1 x H200): the warpgroup-MMA forward with the two warpgroups decoupled (`8x1-wgd`:
# per-buffer full / empty mbarriers instead of a cube barrier per block) beside the lockstep
# `8x1-wg` (call GC) and the mma.sync default `8x2-cp`; then a 7B step with each forward.
# Prediction: wgd's checks pass; its forward +10-25 % over wg (GC: 338 / 401 at B1 4k / 16k,
# 363 / 391 at B8 / B2), as one warpgroup's softmax (about a third of a block's time) overlaps
# the other's wgmma: 400-470 TFLOP/s at 16k. 7B step +1-2 % with the faster forward (the
# forward attention is about 4 % of a 7B step's time).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gd.log
B="--mma-bwd-tiling 8x64-atomic-cp-vd-wg"
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp check
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wgd $B --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp bench
for b in 1 micro; do
timeout -s KILL 80 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd,8x1-wg,8x2-cp $B --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 8x1-wgd,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 python3 torch_attn.py --batch $b --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
done
stamp 7b
for t in 8x1-wgd 8x2-cp; do
SMP_BURN_FLASH_MMA_TILING=$t timeout -s KILL 170 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-$t /"
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
grep -E "===|passed|FAIL|panic|rror|^bench|RESULT|train loss|step +9/" $L | cut -c1-230 | head -80
