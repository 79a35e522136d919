#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and llama2_train, ncu_durations.py, small.txt and tok2048.json.
# The whole log goes to $OUT/dn.log; stdout gets the summary.
# Call DN (1 x H200): the staged RMSNorm backward with two stages in flight (one barrier per
# stage, SMP_BURN_NORM_BWD_AHEAD, the default) against call DJ's one-barrier pipeline
# (SMP_BURN_NORM_BWD_AHEAD=0): checks, device times under ncu per launch, fused_check timing,
# and 1b losses against call DM's build (same reduction order, so they must be bitwise equal).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check llama2_train
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dn.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp RMSNorm checks
timeout -s KILL 120 ./fused_check check --quick 2>&1 | sed "s/^/ahead=default /"
stamp ncu device times
for a in 1 0; do
  SMP_BURN_NORM_BWD_AHEAD=$a timeout -s KILL 100 $NCU --clock-control none --csv -k regex:rms_norm_bwd_staged \
    --metrics gpu__time_duration.sum ./fused_check norm --iters 1 > $OUT/ncu_dn_ahead$a.csv 2>/dev/null; echo "ahead=$a ncu rc=$?"
  python3 ncu_durations.py $OUT/ncu_dn_ahead$a.csv | sed "s/^/ahead=$a /"
done
stamp timing
for a in 1 0; do
  SMP_BURN_NORM_BWD_AHEAD=$a timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/ahead=$a /"
done
stamp 1b
timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^ahead=.*(BW|check rms|NCU|ncu)|===" $L | cut -c1-200
grep -E "step +([2-9]|1[0-2])/" $L | cut -c40-170
