#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check and
# llama2_train (main at call FL's code), small.txt and tok2048.json. The whole log goes to
# $OUT/fp.log.
# Call FP (1 x H200): call FO had the per-warp 8x64-atomic-cp-vd at or above the warp grid
# (the hd-128 default) at hd 128 with the bulk dQ (243.1 against 239.5 at B1 4k, one run).
# A/B over three runs each and on the 7B step (SMP_BURN_FLASH_MMA_BWD_TILING).
# Prediction: within 1 % of each other; the grid keeps the default unless the per-warp kernel
# wins both the kernel and the step.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fp.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
for rep in 1 2 3; do
  for t in 8x64-atomic-cp-vd-wg 8x64-atomic-cp-vd; do
    stamp "$rep $t"
    for b in 1 micro; do
      timeout -s KILL 60 ./flash_check --variant mma --mma-tiling 8x2-cp --no-check --mma-bwd-tiling $t --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    done
  done
done
for t in 8x64-atomic-cp-vd-wg 8x64-atomic-cp-vd; do
  stamp "7b $t"
  SMP_BURN_FLASH_MMA_BWD_TILING=$t timeout -s KILL 110 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-$t /"
done
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
for tag in ("7b-8x64-atomic-cp-vd-wg ", "7b-8x64-atomic-cp-vd "):
    v = [int(m.group(2)) for l in L if l.startswith(tag) for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and 3 <= int(m.group(1)) <= 9]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "^bench|===|panic|rror|train loss" $L | sed 's/(mma kernels)//; s/bench mma\[[^]]*\]//; s/\/bshd causal//' | cut -c1-200
