#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check, ptx_dump.py and torch_attn.py. The whole log goes to $OUT/eb.log; stdout gets the
# summary.
# Call EB (1 x H200): where in a block the deferred fused dQ of the block before should run
# (`SMP_BURN_FLASH_DQ_AT`): 0 right after the barrier (calls DY, EA), 1 behind the block's S^T
# and dP^T products (its MMAs and atomics fill the wait for their results; more registers
# live: spills?), 2 after the block's dS^T store. Checks of 8x64-atomic at each position,
# benches alternating, ptxas registers/spills of each variant. Prediction: 1 is +1-3 % if it
# does not spill, 2 within 1 % of 0.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/eb.log
{
stamp checks
for A in 0 1 2; do
  SMP_BURN_FLASH_DQ_AT=$A timeout -s KILL 120 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd,4x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3 | sed "s/^/at=$A /"
done
stamp bench
for A in 0 1 2 0 1 2; do
  SMP_BURN_FLASH_DQ_AT=$A timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/at=$A /"
  SMP_BURN_FLASH_DQ_AT=$A timeout -s KILL 100 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260 | sed "s/^/at=$A /"
done
timeout -s KILL 90 python3 torch_attn.py --head-dims 128 2>&1 | grep RESULT
timeout -s KILL 60 python3 torch_attn.py --batch micro --head-dims 128 2>&1 | grep RESULT
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 90 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_bwd_dkdv_mma_cp" 2>&1 | cut -c1-220
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "passed|checks|^at=|RESULT|===|registers|spill" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//; s/fwd+bwd.*//' | cut -c1-200
