#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and norm_sweep.py. The whole log goes to $OUT/dr.log; stdout gets the summary.
# (SMP_BURN_COLSUM existed only in build 239b5a0.) Call DR (1 x H200): the column sum after the staged RMSNorm backward. Call DQ: with 3-4
# cubes per SM (396-528 partial rows) it takes 6.0-6.3 us at h 4096, as long as 18 % of the
# kernel, because its 128 cubes of 256 threads (one per SM) each chain three rounds of loads.
# Sweep of SMP_BURN_COLSUM=lanes,groups against SMP_BURN_NORM_BWD_STAGED shapes; device time
# under ncu. Prediction: 128 row groups (1,024 threads per cube, every row's load in flight at
# once) bring it to 2.5-3.5 us.
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dr.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp checks
SMP_BURN_COLSUM=8,128 timeout -s KILL 150 ./fused_check check --quick 2>&1
stamp sweep
for s in 128_16_3 128_16_4 128_16_2; do
  for c in 8_32 8_64 8_128 4_128 4_256 16_64; do
    SMP_BURN_NORM_BWD_STAGED=${s//_/,} SMP_BURN_COLSUM=${c//_/,} timeout -s KILL 100 $NCU --clock-control none --csv \
      -k regex:"rms_norm_bwd|column_sum" --metrics gpu__time_duration.sum ./fused_check norm --iters 2 \
      > $OUT/ncu_dr_${s}_$c.csv 2>/dev/null
    python3 norm_sweep.py $OUT/ncu_dr_${s}_$c.csv "staged=$s colsum=$c"
  done
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^check rms|SWEEP|===" $L | cut -c1-330
