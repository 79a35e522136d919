#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check (this build) and flash_check_em (call EM's build, the baseline) and ptx_dump.py.
# The whole log goes to $OUT/ep.log; stdout gets the summary.
# Call EP (1 x H200): the forward in log2 units with `2^x` as `__powf(2, x)` (CubeCL has no
# exp2): does NVVM fold `log2(2)` so that each score loses `__expf`'s multiply by log2(e)?
# Prediction: if the PTX shows no `lg2.approx` in the loop, forward +3-5 % (64 of ~1,270
# instructions per block path); if not folded, within noise. Checks pass either way.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check flash_check_em
export CUDA_VISIBLE_DEVICES=0
L=$OUT/ep.log
B="--no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd"
{
stamp checks
SMP_BURN_CACHE_DIR=/tmp/kc_ep timeout -s KILL 120 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp,8x1 --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp ptx
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc_ep /tmp/ptx "$P" "flash_fwd_mma_cp" 2>&1 | cut -c1-170
for f in /tmp/ptx/*.ptx; do echo "$(basename $f): lg2 $(grep -c 'lg2.approx' $f) ex2 $(grep -c 'ex2.approx' $f) mul.f32 $(grep -c 'mul.f32\|mul.ftz.f32' $f) fma $(grep -c 'fma.rn.f32\|fma.rn.ftz.f32' $f)"; done
for rep in 1 2; do
  stamp "baseline (call EM's build) $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 100 ./flash_check_em $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
  stamp "exp2 $rep"
  SMP_BURN_CACHE_DIR=/tmp/kc_ep timeout -s KILL 100 ./flash_check $B --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
done
stamp hd64
SMP_BURN_CACHE_DIR=/tmp/kc_em timeout -s KILL 60 ./flash_check_em --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
SMP_BURN_CACHE_DIR=/tmp/kc_ep timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|===|registers|passed|checks|lg2" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/,8x64-atomic-cp-vd\]//' | cut -c1-200
