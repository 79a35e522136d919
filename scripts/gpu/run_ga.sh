#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check and
# llama2_train (build f498e39), small.txt and tok2048.json. The whole log goes to $OUT/ga.log.
# Call GA (1 x H200): the hd-64 backward default (`8x64-atomic-cp-vd`) against
# `4x64-atomic-cp-vd`, which call FO had 1.3 % faster at B1 S 4k (one run) and 3 % slower at
# 16k: kernels at the 1b shape, then 1b steps alternated. The flash dK/dV kernel is a fifth of
# a 1b step (call FZ).
# Prediction: within 1 % at S 4k on the kernel; steps within noise (+-0.5 %), so the default
# stays unless 4x64 wins both runs by more than that.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/ga.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp kernels
for r in 1 2; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-atomic-cp-vd --lens 4096,16384 --batch 1 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done
stamp steps
for r in 1 2; do
for t in 8x64-atomic-cp-vd 4x64-atomic-cp-vd; do
SMP_BURN_FLASH_MMA_BWD_TILING=$t timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-$t-$r /"
done
done
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
tags = sorted({l.split(" ")[0] for l in L if l.startswith("1b-")})
for tag in tags:
    v = [int(m.group(2)) for l in L if l.startswith(tag + " ") for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and 4 <= int(m.group(1)) <= 11]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "^bench|===|panic|rror|attention backward" $L | cut -c1-200 | head -30
