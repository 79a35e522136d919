#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and ncu_durations.py. The whole log goes to $OUT/dl.log; stdout gets the summary.
# Call DL (1 x H200): the staged RMSNorm backward's cubes per SM. Call DK's device times fit
# t = 11.5 us + bytes / 3.45 TB/s: the fixed part is each cube's chain of 16 rows (reduction,
# barrier, stores) with only 2 cubes (8 warps) per SM, so this sweeps smaller stages and more
# cubes per SM (SMP_BURN_NORM_BWD_STAGED=threads,kib,cubes), device time under ncu per launch.
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dl.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
for s in 128,32,2 128,16,3 128,16,4 128,8,4 128,8,6 64,16,4 64,8,8 256,16,3; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 100 $NCU --clock-control none --csv -k regex:rms_norm_bwd_staged \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
    ./fused_check norm --iters 1 > $OUT/ncu_dl_$s.csv 2>/dev/null; echo "staged=$s ncu rc=$?"
  python3 ncu_durations.py $OUT/ncu_dl_$s.csv | sed "s/^/staged=$s /"
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^staged=.*(NCU|ncu)|===" $L | cut -c1-200
