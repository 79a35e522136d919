#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# ptx_dump.py and torch_attn.py. The whole log goes to $OUT/gn.log.
# Call GN (1 x H200): `wgmma` descriptors as one base per operand and product plus 64-bit adds
# of the chunk offset (`wgmma_descriptor_at`), in the warpgroup forward and backward, where
# each `wgmma` had a descriptor of its own (about five instructions each, 40 per thread and
# block in the backward). Full checks of both, ptxas, figures beside PyTorch (two runs).
# Prediction: checks pass (same descriptor bits); registers at or below 253; backward +2-5 %
# over calls GK-GL's 333-335 / 378-380 (B8 4k / B2 16k), forward +0-3 % over 430-432 / 449-456.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gn.log
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
