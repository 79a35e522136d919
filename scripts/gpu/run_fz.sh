#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding llama2_train (build
# f498e39), ncu_step.py, small.txt and tok2048.json. The whole log goes to $OUT/fz.log.
# Call FZ (1 x H200): is a 1b step still GPU-bound? (Calls FX, FY: the machine's only nsys is
# Nsight Compute's launcher, which writes a raw .qdstrm and cannot import it.) As call AA did:
# ncu's device time of every kernel of a 2-step run at the GPU's own clocks, one step's sum
# (between the AdamW runs) against an unprofiled step's wall time.
# Prediction: 75-80 ms of GPU time against an 83 ms step (the host issues forward and backward
# in 65-72 ms, so the GPU runs behind it); flash 25-27 ms, cuBLAS 33-36 ms, AdamW 8-9 ms.
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fz.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp plain
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 10 $F --out-dir /tmp/o0 2>&1 | grep -E "step +[0-9]+/" | sed 's/.*INFO.[^ ]* //' | cut -c1-70 > /tmp/plain.txt
cat /tmp/plain.txt
MS=$(grep -E "step +([4-9]|10)/" /tmp/plain.txt | sed -E 's/.*\| ([0-9]+) ms.*/\1/' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
echo "median step ms (steps 4-10): $MS"
stamp ncu
timeout -s KILL 400 $NCU --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 2 $F --out-dir /tmp/o1 > $OUT/ncu_fz.csv 2>/tmp/ncu_err.txt
tail -2 /tmp/ncu_err.txt
python3 ncu_step.py $OUT/ncu_fz.csv $MS
stamp done
} > $L 2>&1
cat $L
