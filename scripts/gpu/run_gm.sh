#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# ptx_dump.py and torch_attn.py. The whole log goes to $OUT/gm.log.
# Call GM (1 x H200): the warpgroup dK/dV kernel at head dim 64 (the 1b's): dV / dK by
# m64n64k16, dQ by m64n32k16 per head-dim half, the second half's B descriptor starting 64
# bytes into K's one swizzled column block. Its full check, ptxas, and its figures beside the
# hd-64 default `8x64-atomic-cp-vd` and PyTorch.
# Prediction: checks pass if a descriptor may start inside an MN-major 128-byte swizzle atom
# (the risk); about 170 registers; backward 250-280 against the default's 218 / 244 (B8 4k /
# B2 16k) and PyTorch's 228 / 268.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gm.log
PTXAS=$(command -v ptxas || find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp check
timeout -s KILL 240 ./flash_check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --no-bench > /tmp/check.txt 2>&1; echo "flash_check rc=$? ok=$(grep -c '|true$' /tmp/check.txt) false=$(grep -c '|false$' /tmp/check.txt)"
grep -E "FAIL|panic|rror|all checks" /tmp/check.txt | cut -c1-200 | head -10
grep -E "D64.*\|(dQ|dK|dV)\|" /tmp/check.txt | head -6
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$PTXAS" "flash_bwd_dkdv_wgmma" 2>&1 | grep -v "ptxas info" | cut -c1-300
stamp bench
for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma,8x64-atomic-cp-vd --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
done
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wgd --mma-bwd-tiling 8x64-atomic-cp-vd-wgmma --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-200
timeout -s KILL 60 python3 torch_attn.py --batch micro --lens 4096,16384 --head-dims 64 2>&1 | grep -E "RESULT|rror" | cut -c1-200
stamp done
} > $L 2>&1
cat $L
