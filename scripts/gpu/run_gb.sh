#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding llama2_train (build
# f498e39: GEMMs on Burn's stream, the vectorized dQ convert), torch_llama.py, small.txt and
# tok2048.json. The whole log goes to $OUT/gb.log.
# Call GB (1 x H200): the 7B step beside PyTorch eager in the same call, with the session's
# final build (call FV ran no PyTorch 7B).
# Prediction: 11.2-11.4k tok/s against eager's 8.2k: 1.37-1.39x.
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gb.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp 7b
timeout -s KILL 85 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 9 $F --out-dir /tmp/o7 2>&1 | sed "s/^/7b-ours /"
timeout -s KILL 70 python3 torch_llama.py --preset 7b --steps 8 2>&1 | tail -1 | sed "s/^/7b-eager /"
stamp done
} > $L 2>&1
python3 - "$L" <<'PY'
import re, statistics, sys
L = open(sys.argv[1]).read().splitlines()
v = [int(m.group(2)) for l in L if l.startswith("7b-ours ") for m in [re.search(r"step +(\d+)/\d+: .*\| (\d+) tok/s", l)] if m and 3 <= int(m.group(1)) <= 9]
print("7b-ours median", statistics.median(v) if v else None, "range", (min(v), max(v)) if v else None, len(v))
PY
grep -E "===|eager|train loss|panic|rror" $L | cut -c1-260
