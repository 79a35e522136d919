#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check and llama2_train, norm_sweep.py, torch_llama.py, small.txt and tok2048.json.
# The whole log goes to $OUT/ds.log; stdout gets the summary.
# Call DS (1 x H200): the column sum after the staged RMSNorm backward with a pairwise tree for
# its final sum (call DR: group 0 adding 64-256 group sums in turn made more groups slower).
# Checks, then the device-time sweep of SMP_BURN_COLSUM=lanes,groups at the staged kernel's new
# default (128 threads, 16 KiB stages, 3 cubes per SM) and at 2 cubes; 1b end to end (the
# staged kernel is in every layer's two norms).
# Prediction: 4_256 or 8_128 bring the column sum from 5.3-6.3 us to 2.5-3.5 us at h 4096.
# Also: the fused atomic dQ (opt-in -atomic tilings) adds each f32 column pair with one 8-byte
# atomic (sm_90) instead of two scalar ones; checks and hd 128 bench against the split default.
# Prediction: the atomic tilings gain 5-15 % (call DA: 8x32-atomic-cp-vd 160 / 179 TFLOP/s at
# S 4k / 16k against the split default's 187 / 198), still below the split default.
source "$(dirname "$0")/common.sh"
gpu_setup fused_check llama2_train flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ds.log
NCU=$(command -v ncu || find / -name ncu -type f -not -path "*/proc/*" 2>/dev/null | head -1)
F="--eval-interval 0 --no-checkpoint --export-hf none --sample none --no-progress --tokenizer tok2048.json --data small.txt --seq-len 4096 --micro-batch 1"
{
stamp checks
for c in 8_32 4_256 2_512; do
  SMP_BURN_COLSUM=${c//_/,} timeout -s KILL 150 ./fused_check check --quick 2>&1 | sed "s/^/colsum=$c /"
done
stamp sweep
for s in 128_16_3 128_16_2; do
  for c in 8_32 8_64 8_128 4_256 2_512 16_64; do
    SMP_BURN_NORM_BWD_STAGED=${s//_/,} SMP_BURN_COLSUM=${c//_/,} timeout -s KILL 100 $NCU --clock-control none --csv \
      -k regex:"rms_norm_bwd|column_sum" --metrics gpu__time_duration.sum ./fused_check norm --iters 2 \
      > $OUT/ncu_ds_${s}_$c.csv 2>/dev/null
    python3 norm_sweep.py $OUT/ncu_ds_${s}_$c.csv "staged=$s colsum=$c"
  done
done
stamp flash atomic
BW=8x32-atomic-cp-vd,8x64-atomic-cp-vd,4x32-atomic-cp-vd,4x64-split-cp-vd
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -8
timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $BW --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp 1b
for c in 8_32 4_256; do
  SMP_BURN_COLSUM=${c//_/,} timeout -s KILL 80 ./llama2_train --device cuda --nproc-per-node 1 --model 1b --steps 12 $F --out-dir /tmp/o1 2>&1 | sed "s/^/colsum=$c /"
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "check rms|SWEEP|===|^bench|passed|checks" $L | cut -c1-330
grep -E "STEP\||tok/s|val" $L | grep -v "step +[1-3]/" | cut -c1-200 | tail -30
