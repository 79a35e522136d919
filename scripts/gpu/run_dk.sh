#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and ncu_durations.py. The whole log goes to $OUT/dk.log; stdout gets the summary.
# Call DK (1 x H200): the staged RMSNorm backward at its new default shape (128 threads): checks,
# timing against the lean register kernel (SMP_BURN_NORM_BWD_STAGED=0), and the device time of
# each kernel under ncu at the boost clock (fused_check's figures include the host's issue time
# of two launches and three allocations, which call DJ suggests is most of a 50 us call).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dk.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp RMSNorm checks
timeout -s KILL 120 ./fused_check check --quick 2>&1 | sed "s/^/staged=default /"
stamp RMSNorm timing
for s in default 0 default 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/staged=$s /"
done
stamp ncu device times
for s in default 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 150 $NCU --clock-control none --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    ./fused_check norm --iters 1 > $OUT/ncu_dk_$s.csv 2>$OUT/ncu_dk_$s.err; echo "staged=$s ncu rc=$?"
  python3 ncu_durations.py $OUT/ncu_dk_$s.csv | sed "s/^/staged=$s /"
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^staged=.*(BW|check rms|NCU|ncu)|===" $L | cut -c1-200
