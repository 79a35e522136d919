#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this build) and flash_check_em (call EM's build, the baseline) and ptx_dump.py.
# The whole log goes to $OUT/eo.log; stdout gets the summary.
# Call EO (1 x H200): the `cp.async` dK/dV kernel copies K and V with `cp.async` together with
# the first query block (one round trip to memory before the first block instead of two; no
# staging registers). Prediction: checks pass; backward +0.5-1.5 % at S 4k (the per-cube cost
# weighs there), +0-0.5 % at 16k; the default kernel at or under 253 registers, no spills.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_em
export CUDA_VISIBLE_DEVICES=0
L=$OUT/eo.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_eo timeout -s KILL 150 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd,4x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
for rep in 1 2; do
  stamp "baseline (call EM's build) $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 100 ./flash_check_em $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 100 ./flash_check_em $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  stamp "async K/V $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_eo timeout -s KILL 100 ./flash_check $B --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  SMP_BURN_CACHE_DIR=/tmp/kc_eo timeout -s KILL 100 ./flash_check $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp hd64
SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 60 ./flash_check_em --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
SMP_BURN_CACHE_DIR=/tmp/kc_eo timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc_eo /tmp/ptx "$P" "flash_bwd_dkdv_mma_cp" 2>&1 | cut -c1-170
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|registers|passed|checks" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
