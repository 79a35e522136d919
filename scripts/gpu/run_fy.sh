#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding llama2_train (build
# f498e39), nsys_busy.py, small.txt and tok2048.json. The whole log goes to $OUT/fy.log.
# Call FY (1 x H200): call FX again with a working Nsight Systems: FX took the first `nsys` on
# the machine, a launcher inside Nsight Compute's folder that wrote no report. This one lists
# every `nsys`, takes the first that writes a report, and measures how much of each 1b step the
# GPU is busy.
# Prediction (as FX's): busy 95-98 % of each steady step; the idle time at the step's start
# (after the loss read-back, while the host issues the first layer).
source "$(dirname "$0")/common.sh"
gpu_setup llama2_train
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/fy.log
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp find
CANDS=$( (command -v nsys; find / \( -path /proc -o -path /sys \) -prune -o -name nsys -type f -perm -u+x -print 2>/dev/null) | sort -u)
echo "$CANDS"
stamp warm
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 2 $F --out-dir /tmp/o0 2>&1 | grep -E "step +2/" | cut -c1-160
for N in $CANDS; do
  stamp "try $N"
  timeout -s KILL 120 $N profile -t cuda -o /tmp/s1b -f true ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 6 $F --out-dir /tmp/o1 > /tmp/nsys_out.txt 2>&1
  grep -E "step +[0-9]+/" /tmp/nsys_out.txt | sed 's/.*INFO.[^ ]* //' | cut -c1-100
  grep -vE "INFO|WARN" /tmp/nsys_out.txt | tail -4
  if [ -f /tmp/s1b.nsys-rep ]; then
    timeout -s KILL 100 $N export --type sqlite -o /tmp/s1b.sqlite -f true /tmp/s1b.nsys-rep 2>&1 | tail -2
    python3 nsys_busy.py /tmp/s1b.sqlite 6
    break
  fi
done
stamp done
} > $L 2>&1
cat $L
