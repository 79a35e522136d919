#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding llama2_train (build
# f498e39, GEMMs on Burn's stream), nsys_busy.py, small.txt and tok2048.json. The whole log goes
# to $OUT/fx.log.
# Call FX (1 x H200): is a 1b step still GPU-bound? The trainer issues a step's forward and
# backward in 65-72 ms of an 83 ms step (call FU), so faster kernels leave less slack. nsys's
# kernel trace of 8 steps, the GPU's busy time per step against the wall time between steps.
# Prediction: busy 95-98 % of each steady step (the host stays ahead: it issues in ~70 ms what
# the GPU runs in ~80), with the idle time at the step's start (the optimizer and the loss
# read-back).
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fx.log
NSYS=$(command -v nsys || find / -name nsys -type f -perm -u+x -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp warm
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 3 $F --out-dir /tmp/o0 2>&1 | grep -E "step +3/" | cut -c1-200
stamp nsys
timeout -s KILL 150 $NSYS profile -t cuda --cuda-event-trace=false -o /tmp/s1b -f true ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 8 $F --out-dir /tmp/o1 2>&1 | grep -E "step +[0-9]+/" | sed 's/.*INFO.[^ ]* //' | cut -c1-140
timeout -s KILL 100 $NSYS export --type sqlite -o /tmp/s1b.sqlite -f true /tmp/s1b.nsys-rep 2>&1 | tail -2
python3 nsys_busy.py /tmp/s1b.sqlite 8
stamp done
} > $L 2>&1
cat $L
