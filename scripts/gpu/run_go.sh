#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# ptx_dump.py and torch_attn.py. The whole log goes to $OUT/go.log.
# Call GO (1 x H200): a third Q/dO buffer in the warpgroup dK/dV kernel, so that the top of
# the loop no longer waits for the previous block's `dK` group (it read the buffer the prefetch
# refilled): `S^T` queues behind it and the tensor pipe does not drain at the barrier (217 KB
# of shared memory). Full checks, ptxas (a `wgmma` serialization warning would undo it), figures.
# Prediction: checks pass; registers as before (253), no serialization; backward +2-5 % over
# call GN's 336-339 / 383-385 (B8 4k / B2 16k); forward unchanged.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/go.log
PTXAS=$(command -v ptxas || find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp check
timeout -s KILL 240 ./flash_check --variant mma --mma-tiling 8x1-wgd,8x1-wg --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --no-bench > /tmp/check.txt 2>&1; echo "flash_check rc=$? ok=$(grep -c '|true$' /tmp/check.txt) false=$(grep -c '|false$' /tmp/check.txt)"
grep -E "FAIL|panic|rror|all checks" /tmp/check.txt | cut -c1-200 | head -10
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$PTXAS" "wgmma" 2>&1 | grep -v "ptxas info" | cut -c1-300
stamp bench
for rep in 1 2; do for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done; done
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp done
} > $L 2>&1
cat $L
