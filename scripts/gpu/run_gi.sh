#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check, ptx_dump.py
# and torch_attn.py. The whole log goes to $OUT/gi.log.
# Call GI (1 x H200, branch wgmma-bwd): the first run of the warpgroup-MMA dK/dV kernel
# (`8x64-atomic-cp-vd-wgmma`, flash_bwd_dkdv_wgmma): its checks, its registers / spills under
# ptxas, and its TFLOP/s beside the default `8x64-atomic-cp-vd-wg` and PyTorch's flash backward.
# Prediction: if the layouts are right (dS^T and K read transposed as A and B of dQ are the new
# ones), the checks pass; 240+ registers; backward 300-350 at S 16k if nothing spills.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gi.log
PTXAS=$(command -v ptxas || find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp check
timeout -s KILL 150 ./flash_check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --quick --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks|RESULT\|check" | grep -E "D128|FAIL|panic|rror|passed" | cut -c1-200 | head -30
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$PTXAS" "flash_bwd_dkdv_wgmma" 2>&1 | cut -c1-220
stamp bench
for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma,8x64-atomic-cp-vd-wg --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 128 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp done
} > $L 2>&1
cat $L
