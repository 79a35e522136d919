#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# kernel_bench, llama2_train, torch_attn.py, torch_llama.py, small.txt and tok2048.json. The
# whole log goes to $OUT/gg.log.
# Call GG (1 x H200): the session's final build on its defaults: every kernel's check, the
# attention kernels beside PyTorch's SDPA, and the 1b and 7B steps, 7B beside PyTorch eager.
# Prediction: checks pass; forward hd 128 430 / 440+ at torch_micro's shapes; 1b as before
# (about 50k tok/s, its hd-64 kernels unchanged); 7B 11.2-11.4k against eager 8.2-8.3k
# (1.36-1.39x).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check kernel_bench llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gg.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
timeout -s KILL 150 ./kernel_bench check > /tmp/check.txt 2>&1; echo "kernel_bench check rc=$? ok=$(grep -c ' ok$' /tmp/check.txt) FAIL=$(grep -c FAIL /tmp/check.txt)"; grep -E "FAIL|panic" /tmp/check.txt | head -5
stamp kernels
timeout -s KILL 60 ./flash_check --no-check --variant mma --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128,64 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp 7b
timeout -s KILL 170 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-ours /"
timeout -s KILL 130 python3 torch_llama.py --preset 7b --steps 8 2>&1 | tail -1 | sed "s/^/7b-eager /"
stamp 1b
timeout -s KILL 90 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/1b-ours /"
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
for tag, lo, hi in (("7b-ours", 3, 9), ("1b-ours", 4, 11)):
    v = [int(m.group(2)) for l in L if l.startswith(tag + " ") for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and lo <= int(m.group(1)) <= hi]
    print(tag, "median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "===|passed|FAIL|panic|rror|kernel_bench|^bench|RESULT|eager|train loss|attention \(" $L | sed 's/\x1b\[[0-9;]*m//g' | grep -v "step +[0-9]" | cut -c1-220 | head -60
