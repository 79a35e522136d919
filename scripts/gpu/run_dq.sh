#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check, ptx_dump.py and norm_sweep.py. The whole log goes to $OUT/dq.log; stdout gets the
# summary.
# Call DQ (1 x H200): the staged RMSNorm backward with the weight and partial dweight rows in
# registers and one barrier per stage's reduction, so shared memory holds only the stages and
# an SM runs 3-6 cubes (call DO: 2 cubes, 12.5 % occupancy, latency-bound). Checks; ptxas
# registers; device time under ncu for a sweep of SMP_BURN_NORM_BWD_STAGED=threads,kib,cubes.
# Prediction: h 4096 kernel 40.7 -> 28-32 us (3.1-3.6 TB/s with the column sum's 4.4 us: 2.8-3.1).
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=$OUT/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dq.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks
timeout -s KILL 150 ./fused_check check --quick 2>&1
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py $OUT/kc /tmp/ptx "$P" rms_norm 2>&1 | cut -c1-250 | tail -30
stamp sweep
for s in 128,16,4 128,16,6 128,16,3 128,32,3 128,16,2 256,16,2 256,16,3 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 100 $NCU --clock-control none --csv -k regex:"rms_norm_bwd|column_sum" \
    --metrics gpu__time_duration.sum ./fused_check norm --iters 2 > $OUT/ncu_dq_$s.csv 2>/dev/null; echo "staged=$s ncu rc=$?"
  python3 norm_sweep.py $OUT/ncu_dq_$s.csv "staged=$s"
done
stamp occupancy
timeout -s KILL 100 $NCU --clock-control none -k regex:rms_norm_bwd_staged --launch-skip 8 -c 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  ./fused_check norm --iters 1 > $OUT/ncu_dq_occ.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|Registers Per|Issue Slots|Eligible Warps|Active Warps Per|No Eligible|Achieved Occupancy|Theoretical Occupancy|Block Limit|DRAM Throughput" $OUT/ncu_dq_occ.txt | cut -c1-120
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^check rms|rms_norm.*(registers|spill)|SWEEP|ncu rc|===" $L | cut -c1-330
grep -A 14 "=== .* occupancy" $L | tail -13
