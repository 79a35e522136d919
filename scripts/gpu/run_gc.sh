#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding flash_check,
# ptx_dump.py and torch_attn.py. The whole log goes to $OUT/gc.log.
# Call GC (1 x H200): the first warpgroup-MMA forward (`8x1-wg`, flash_fwd_wgmma): its checks
# against the f32 reference, its registers / spills / wgmma serialization under ptxas, and its
# TFLOP/s beside the mma.sync default (8x2-cp) and PyTorch's flash forward.
# Prediction: if the swizzled layouts and descriptors are right, the checks pass at bf16
# error; forward at hd 128 380-450 TFLOP/s at B1 4k and 420-500 at 16k (no producer warps,
# no intra-warpgroup overlap: the two warpgroups alternate the tensor cores), against
# 294-360 for 8x2-cp. If a layout is wrong, O's error is O(1) and the C++ source shows why.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check
export CUDA_VISIBLE_DEVICES=0
export SMP_BURN_CACHE_DIR=/tmp/kc
L=$OUT/gc.log
B="--mma-bwd-tiling 8x64-atomic-cp-vd-wg"
PTXAS=$(command -v ptxas || find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
{
stamp check
CUBECL_DEBUG_LOG=stdout timeout -s KILL 150 ./flash_check --variant mma --mma-tiling 8x1-wg $B --quick --no-bench > /tmp/kernels.log 2>&1
grep -E "FAIL|panic|rror|passed|checks|RESULT\|check|probe" /tmp/kernels.log | cut -c1-200 | head -60
grep -n "wgmma" /tmp/kernels.log | head -3
python3 - <<'PY'
import re
s = open('/tmp/kernels.log', errors='replace').read()
i = s.find('flash_fwd_wgmma')
j = s.find('wgmma.mma_async')
print('log bytes', len(s), 'kernel name at', i, 'first wgmma at', j)
if j >= 0:
    k = s.rfind('extern "C"', 0, j)
    open('/tmp/wgmma_src.cu', 'w').write(s[max(k, 0): j + 60000])
PY
cp /tmp/wgmma_src.cu $OUT/ 2>/dev/null
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$PTXAS" "flash_fwd_wgmma|flash_fwd_mma_cp" 2>&1 | cut -c1-220
for f in /tmp/ptx/flash_fwd_wgmma*.ptx; do "$PTXAS" -v --gpu-name sm_90a "$f" -o /dev/null 2>&1 | grep -iE "warn|serial" | head -5; done
stamp full-check
timeout -s KILL 200 ./flash_check --variant mma --mma-tiling 8x1-wg $B --no-bench 2>&1 | grep -E "FAIL|panic|rror|passed|checks" | cut -c1-220 | tail -6
stamp bench
for b in 1 micro; do
timeout -s KILL 60 ./flash_check --no-check --variant mma --mma-tiling 8x1-wg,8x2-cp $B --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 8x1-wg,4x2-cp --mma-bwd-tiling 8x64-atomic-cp-vd --lens 4096,16384 --batch $b 2>&1 | grep -E "^bench|panic|rror" | cut -c1-260
timeout -s KILL 60 python3 torch_attn.py --batch $b --lens 4096,16384 --head-dims 128,64 2>&1 | grep -E "RESULT|rror" | cut -c1-200
done
stamp end
} > $L 2>&1
cat $L
