#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this build) and ptx_dump.py. The whole log goes to $OUT/eq.log; stdout gets it.
# NOT RUN (session 13's device time ran out): apply scripts/gpu/flash_bwd_exp2.patch first
# (`git apply scripts/gpu/flash_bwd_exp2.patch`), build, then run.
# Call EQ (1 x H200): call EP's `2^x` in the backward too (`P = 2^(s scale log2 e - lse log2
# e)` in the dK/dV and dQ block code), and which `ex2` the PTX holds. Kept short: the
# session's device time is nearly spent. Prediction: checks pass; backward +3-6 % (the
# forward gained 5-6 % in call EP); PTX: `ex2.approx.ftz.f32` (the fix-up gone).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0 SMP_BURN_CACHE_DIR=/tmp/kc_eq
L=$OUT/eq.log
{
stamp checks
timeout -s KILL 60 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp bench
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 30 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp ptx
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 30 python3 ptx_dump.py /tmp/kc_eq /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp|flash_bwd_dq_mma_cp" 2>&1 | cut -c1-150
for f in /tmp/ptx/*.ptx; do echo "$(basename $f): ex2.approx.ftz $(grep -c 'ex2.approx.ftz.f32' $f) ex2.approx.f32 $(grep -c 'ex2.approx.f32' $f) lg2 $(grep -c 'lg2.approx' $f)"; done
stamp done
} > $L 2>&1
cat $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
