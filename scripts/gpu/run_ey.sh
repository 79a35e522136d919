#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding llama2_train (the
# final build, vendor/cubecl-opt: every kernel's shared memory in declaration order) and
# llama2_train_up (the same sources with upstream cubecl-opt: a random layout per kernel and
# process), small.txt and tok2048.json. The whole log goes to $OUT/ey.log.
# Call EY (1 x H200): call EU's end-to-end figures were 2-3 % under call EN's (torch.compile's
# 1.6 % under). Did fixing the layouts fix some kernel (RMSNorm, loss, AdamW, ...) to a slower
# one than upstream's draws average? Each binary has its own kernel cache.
# Prediction: the same within noise (1 %), since the flash kernels drew their fast layouts.
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train llama2_train_up
export CUDA_VISIBLE_DEVICES=0
L=$OUT/ey.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
for m in 1b 7b; do
  for v in llama2_train llama2_train_up; do
    stamp "$m $v"
    n=12; [ $m = 7b ] && n=9
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 110 ./$v --device cuda --nproc-per-node 1 --model $m --steps $n $F --out-dir /tmp/o_$m 2>&1 | sed "s/^/$m-$v /"
  done
done
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
for tag, lo, hi in (("1b-llama2_train ", 4, 11), ("1b-llama2_train_up ", 4, 11), ("7b-llama2_train ", 3, 9), ("7b-llama2_train_up ", 3, 9)):
    v = [int(m.group(2)) for l in L if l.startswith(tag) for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and lo <= int(m.group(1)) <= hi]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "===|panic|rror|validation" $L | cut -c1-200
