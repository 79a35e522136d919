#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check and torch_attn.py. The whole log goes to $OUT/ea.log; stdout gets the summary.
# Call EA (1 x H200): the deferred fused dQ with two m-tiles per warp (`dq_m_tiles`: each warp
# forms a 32-row x d/4 slice of the block's dQ instead of 16 rows x d/2, so each loaded K
# fragment feeds two MMAs: 16 KB of shared-memory reads per warp and block instead of 20 KB).
# Checks of the atomic tilings, then benches with SMP_BURN_FLASH_DQ_MTILES=1 (the old shape)
# and the default, alternating, against PyTorch's flash. Prediction: hd 128 backward +1-2 %
# (S 16k 248 -> 250-253).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ea.log
AT=8x64-atomic-cp-vd,4x64-atomic-cp-vd,8x32-atomic-cp-vd
{
stamp checks
timeout -s KILL 200 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling $AT --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
timeout -s KILL 100 ./flash_check --quick --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -4
stamp bench
for M in 2 1 2 1; do
  E=""; [ $M = 1 ] && E="SMP_BURN_FLASH_DQ_MTILES=1"
  env $E timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/mt=$M /"
  env $E timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/mt=$M /"
done
for M in 2 1; do
  E=""; [ $M = 1 ] && E="SMP_BURN_FLASH_DQ_MTILES=1"
  env $E timeout -s KILL 100 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/mt=$M /"
done
timeout -s KILL 90 python3 torch_attn.py --head-dims 128 2>&1 | grep RESULT
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|^mt=|RESULT|===" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/fwd+bwd.*//' | cut -c1-200
