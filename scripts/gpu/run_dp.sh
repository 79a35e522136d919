#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# fused_check. Call DP (1 x H200): checks after the register RMSNorm backward kept only its lean
# form (the A/B switch removed) and both RMSNorm backward kernels write their partial dweight
# rows through one helper: fused_check's checks with the staged kernel (default) and with the
# register kernel (SMP_BURN_NORM_BWD_STAGED=0), and their timing.
source "$(dirname "$0")/common.sh"
gpu_setup fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/dp.log
{
for s in default 0; do
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 120 ./fused_check check --quick 2>&1 | sed "s/^/staged=$s /"
  SMP_BURN_NORM_BWD_STAGED=$s timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/staged=$s /"
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^staged=.*(BW|check )|===" $L | cut -c1-200
