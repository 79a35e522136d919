#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check builds: _base (main at 427610b, call EP's kernels), _a (scripts/gpu/
# flash_bwd_exp2.patch applied) and _b (the patch, with the dK/dV kernel's per-score
# `lse * log2(e)` left out: wrong values, timing only, to price pre-scaled lse), and
# ptx_dump.py. The whole log goes to $OUT/eq.log; stdout gets the summary.
# Call EQ (1 x H200): call EP's `2^x` in the backward too (`P = 2^(s scale log2 e - lse log2
# e)` in the dK/dV and dQ block code), and which `ex2` the PTX holds.
# Prediction: checks pass; backward +3-6 % (the forward gained 5-6 % in call EP); _b a
# further +0.5-1 %; PTX: `ex2.approx.ftz.f32` in the backward kernels (the fix-up gone).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check_base flash_check_a flash_check_b
export CUDA_VISIBLE_DEVICES=0
L=$OUT/eq.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_a timeout -s KILL 120 ./flash_check_a --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-split-cp-vd,8x64-atomic --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
SMP_BURN_CACHE_DIR=/tmp/kc_a timeout -s KILL 60 ./flash_check_a --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp ptx
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc_a /tmp/ptx "$P" "flash_fwd_mma_cp|flash_bwd_dkdv_mma_cp|flash_bwd_dq_mma" 2>&1 | cut -c1-170
for f in /tmp/ptx/*.ptx; do echo "$(basename $f): ex2.ftz $(grep -c 'ex2.approx.ftz.f32' $f) ex2 $(grep -c 'ex2.approx.f32' $f) lg2 $(grep -c 'lg2.approx' $f)"; done
for rep in 1 2; do
  for v in base a b; do
    stamp "$v $rep"
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 100 ./flash_check_$v $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
    SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 100 ./flash_check_$v $B --lens 4096 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  done
done
stamp hd64
for v in base a; do
SMP_BURN_CACHE_DIR=/tmp/kc_$v timeout -s KILL 60 ./flash_check_$v --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|registers|passed|checks|ex2" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
