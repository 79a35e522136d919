#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# kernel_bench and llama2_train (build with the warp-grid dK/dV kernel as the hd-128 default,
# dQ not deferred), small.txt and tok2048.json. The whole log goes to $OUT/fd.log; ncu's
# per-instruction source page of the grid kernel to $OUT/grid_source.csv.gz.
# Call FD (1 x H200): does call FC's +4-5 % (B1) on the hd-128 backward carry to a 7B step, and
# would the per-warp atomic kernel (already +4-11 % over the split default at hd 64 and micro
# batches in calls FA and FC) help the 1b preset? Prediction: checks pass; kernel_bench check
# all ok; 7B +1-2 % tok/s (the backward's attention is ~15 % of a 7B step); 1b with
# 8x64-atomic-cp-vd +0.5-1 %.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fd.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 100 ./flash_check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
timeout -s KILL 150 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
stamp "bench hd64"
for b in micro 1; do
timeout -s KILL 90 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd,8x64-atomic-cp-vd,8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
for m in 7b 1b; do
  for t in default 8x64-atomic-cp-vd; do
    stamp "$m $t"
    n=12; [ $m = 7b ] && n=9
    if [ $t = default ]; then unset SMP_BURN_FLASH_MMA_BWD_TILING; else export SMP_BURN_FLASH_MMA_BWD_TILING=$t; fi
    timeout -s KILL 110 ./llama2_train --device cuda --nproc-per-node 1 --model $m --steps $n $F --out-dir /tmp/o_$m 2>&1 | sed "s/^/$m-$t /"
  done
done
unset SMP_BURN_FLASH_MMA_BWD_TILING
stamp ncu source
timeout -s KILL 120 $NCU --section SourceCounters --section WarpStateStats -k regex:dkdv -c 1 -o /tmp/grid ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wg --lens 4096 --iters 1 > /dev/null 2>&1; echo rc=$?
$NCU -i /tmp/grid.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > $OUT/grid_source.csv.gz; ls -la $OUT
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
for tag, lo, hi in (("7b-default ", 3, 9), ("7b-8x64-atomic-cp-vd ", 3, 9), ("1b-default ", 4, 11), ("1b-8x64-atomic-cp-vd ", 4, 11)):
    v = [int(m.group(2)) for l in L if l.startswith(tag) for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and lo <= int(m.group(1)) <= hi]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "^bench|===|passed|FAIL|panic|rror|validation|kernel_bench|rc=|step +9/|step +12/" $L | cut -c1-220
