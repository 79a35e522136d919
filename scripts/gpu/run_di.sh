#!/bin/bash
# Runs from the repository root on the device machine with .gpu/ holding the stripped, gzipped
# binaries (flash_check, fused_check, kernel_bench, llama2_train), torch_attn.py, ptx_dump.py,
# small.txt and tok2048.json (see docs/performance.md, session 9). Every output goes to $OUT/di.log
# (call DH printed more than the device tool returns); stdout gets the summary lines.
# Call DI (1 x H200), build with the backward mask split (now on main):
# 1. the backward mask split's checks and benches again (DH's were cut from its output; its 1b
#    losses were bitwise DG's);
# 2. the lean RMSNorm backward, now with the weight and the partial dweight row in shared memory
#    (fewer registers again): checks, A/B against SMP_BURN_NORM_BWD_LEAN=0, cube-size sweep,
#    ptxas registers.
source "$(dirname "$0")/common.sh"
gpu_setup flash_check fused_check
export SMP_BURN_CACHE_DIR=/tmp/kc CUDA_VISIBLE_DEVICES=0
L=$OUT/di.log
{
stamp flash check
timeout -s KILL 100 ./flash_check --quick --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd,4x64-split,8x64-split-pf-vd,8x64-atomic-cp-vd,8x64-atomic --no-bench 2>&1
stamp flash bench
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1
timeout -s KILL 40 ./flash_check --no-check --variant mma --mma-tiling 8x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 --batch micro 2>&1
timeout -s KILL 40 ./flash_check --no-check --variant mma --head-dim 64 --mma-tiling 4x2-cp --mma-bwd-tiling 4x64-split-cp-vd --lens 4096,16384 2>&1
stamp torch attention
timeout -s KILL 60 python3 torch_attn.py 2>&1
timeout -s KILL 40 python3 torch_attn.py --batch micro --head-dims 128 2>&1
stamp RMSNorm checks
for l in 1 0; do
  SMP_BURN_NORM_BWD_LEAN=$l timeout -s KILL 120 ./fused_check check --quick 2>&1 | sed "s/^/lean=$l /"
done
stamp RMSNorm timing
for l in 1 0 1 0; do
  SMP_BURN_NORM_BWD_LEAN=$l timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/lean=$l default /"
done
for t in 128,8 128,12 256,4 256,6 256,8 512,3; do
  SMP_BURN_NORM_BWD=$t timeout -s KILL 60 ./fused_check norm --iters 200 2>&1 | grep "^BW|" | sed "s/^/lean=1 $t /"
done
stamp ptxas
P=$(find / -name ptxas -type f -not -path "*/proc/*" 2>/dev/null | head -1)
timeout -s KILL 60 python3 ptx_dump.py /tmp/kc /tmp/ptx "$P" "rms_norm_bwd_v2" 2>&1
stamp done
} > $L 2>&1
grep -E "FAIL|panic|rror" $L | head -20 | cut -c1-230
grep -E "passed|checks" $L | grep -v "^lean" | tail -4 | cut -c1-230
grep -E "^bench|RESULT|^lean=.*(BW|rms_norm)|smem=|===" $L | cut -c1-200
