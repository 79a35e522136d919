#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# flash_check, ptx_dump.py and torch_attn.py. The whole log goes to $OUT/ef.log; stdout gets
# the summary.
# Call EF (1 x H200): the forward tilings at hd 128 again, now that the kernels changed since
# session 4 chose 8x2-cp (unmasked blocks, ldmatrix addressing). Question: does FA2's own
# shape, 4x2-cp (128 rows, 4 warps: two cubes per SM), beat 8x2-cp (one cube per SM) where
# per-cube costs weigh most (S 4096)? Prediction: 4x2-cp +5-10 % at B8 S 4k and B1 S 4k,
# 0-5 % slower at S 16k; ptxas: 4x2-cp fits two cubes per SM (<= 255 registers at 128
# threads, ~104 KB of shared memory). Also: the forward at S 2k-16k with torch_micro's batches
# (the same tokens per call), to size the per-cube cost that makes S 4k slower than 16k; and
# the opt-in skip of the O rescale where no row's maximum grew (SMP_BURN_FLASH_SKIP_RESCALE=1,
# checks first): +0-3 % predicted (128 of ~1,300 instructions per warp and block).
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/ef.log
T=8x2-cp,4x2-cp
B="--no-check --variant mma --mma-bwd-tiling 8x64-atomic-cp-vd"
{
stamp checks
SMP_BURN_FLASH_SKIP_RESCALE=1 timeout -s KILL 100 ./flash_check --quick --variant mma --mma-tiling 8x2-cp,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -3
stamp bench
timeout -s KILL 100 ./flash_check $B --mma-tiling $T --lens 4096,16384 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 120 ./flash_check $B --mma-tiling $T --lens 2048,4096,8192,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp skip-rescale
SMP_BURN_FLASH_SKIP_RESCALE=1 timeout -s KILL 100 ./flash_check $B --mma-tiling 8x2-cp --lens 4096,16384 --batch micro 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
stamp torch
timeout -s KILL 90 python3 torch_attn.py --head-dims 128 2>&1 | grep RESULT
timeout -s KILL 90 python3 torch_attn.py --batch micro --lens 2048,4096,8192,16384 --head-dims 128 2>&1 | grep RESULT
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 90 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "flash_fwd_mma" 2>&1 | cut -c1-220
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-300
grep -E "^bench|RESULT|===|registers" $L | sed 's/bench mma\[//; s/\/bshd causal//; s/(mma kernels)//' | cut -c1-200
