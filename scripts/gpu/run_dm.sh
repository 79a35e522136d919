#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and llama2_train, ncu_durations.py, torch_llama.py, small.txt and tok2048.json.
# The whole log goes to $OUT/dm.log; stdout gets the summary.
# Call DM (1 x H200), the session's final build: the memory-bound kernels' table (fused_check
# bench, host time included) and their device times under ncu; 1b against torch.compile in the
# same call; 7B (automatic checkpointing choice) as a regression check against call CC.
source "$(dirname "$0")/common.sh"
gpu_setup fused_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dm.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp fused bench
timeout -s KILL 120 ./fused_check bench 2>&1
stamp ncu device times of the memory-bound kernels
timeout -s KILL 120 $NCU --clock-control none --csv -k regex:"rms_norm|swiglu|rope|column_sum|copy_kernel" \
  --metrics gpu__time_duration.sum ./fused_check bench --iters 1 > $OUT/ncu_dm.csv 2>/dev/null; echo "ncu rc=$?"
python3 ncu_durations.py $OUT/ncu_dm.csv
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1
timeout -s KILL 150 python3 torch_llama.py --preset 1b --steps 10 --compile 2>&1 | tail -3
stamp 7b
timeout -s KILL 150 ./llama2_train --device cuda --nproc-per-node 1 --model 7b --steps 10 $F --out-dir /tmp/o7 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^(BW|STEP|MEM)\||^NCU|^\{|tok/s|recompute|===|ncu rc" $L | grep -v "step +[1-3]/" | cut -c1-220
